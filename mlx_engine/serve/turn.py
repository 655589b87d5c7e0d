"""What every wire API asks of the engine, in one shape: a conversation (OpenAI's chat shapes as dicts,
which the Anthropic and Responses adapters translate into) with its tools, or a completion prompt, and the
answer's settings. `prepare` makes it the engine's request: the prompt through the model's chat template
(tools included, or the generic form), the grammar (response_format, or a forced tool call in the model's
own format), and how the answer is split (its tool-call format, the reasoning markers, whether the answer
opens inside the reasoning). One path through the engine for the three APIs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..grammar import GrammarError, grammar_tokenizer
from ..grammar.requests import from_response_format
from ..sampling import SamplingConfig
from ..toolcalls import detect, template_input
from ..toolcalls.formats import DS_CALL_BEGIN, DS_CALL_END, DS_SEP, PYTHON_TAG, ToolFormat, UnwritableCall
from ..toolcalls.grammars import forced_call, optional_calls, strict_view
from .errors import APIError


@dataclass
class Turn:
    model: str
    messages: list[dict] | None = None  # a chat: OpenAI's message shapes (tool_calls, tool_call_id, ...)
    prompt: list[int] | str | None = None  # a completion: text or token ids
    tools: list[dict] = field(default_factory=list)  # OpenAI function tools {"type", "function": {...}}
    tool_choice: str | dict = "auto"  # none | auto | required | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, reasoning_effort
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int | None = None  # None: the server's default, cut to the room left
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    num_draft: int | str | None = None
    logprobs: int | None = None  # None: off; 0: the chosen tokens'; n: also the n most likely
    stream: bool = False
    named: frozenset = frozenset()  # the body's fields it set: its sampling values win over the checkpoint's

    @property
    def offered(self) -> list[dict]:
        """The tools the model is shown (none under tool_choice "none")."""
        return [] if self.tool_choice == "none" else self.tools

    @property
    def strict_auto(self) -> bool:
        """tool_choice auto with a tool marked `strict`: the answer's calls are held to the grammar."""
        return self.tool_choice == "auto" and any(t.get("function", t).get("strict") is True for t in self.tools)

    @property
    def forced_tools(self) -> list[dict] | None:
        """The tools a call is forced among (required: all; a named function: that one), or None."""
        if self.tool_choice == "required":
            return self.tools
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name") or self.tool_choice.get("name")
            chosen = [t for t in self.tools if t.get("function", t).get("name") == name]
            if not chosen:
                raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                               param="tool_choice")
            return chosen
        return None


@dataclass(frozen=True)
class AnswerSpec:
    """How the engine thread splits this answer (toolcalls/stream.py)."""
    fmt: ToolFormat | None  # None: no tools offered
    tools: tuple = ()
    think: tuple[str, str] | None = None
    reasoning: bool = False  # the answer opens inside the reasoning


@dataclass
class Prepared:
    prompt: list[int]
    grammar: object  # mlx_engine.grammar.Grammar or None
    answer: AnswerSpec


def _markers(tokenizer) -> tuple[str, str] | None:
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return (start, end) if start and end else None


def _opens_reasoning(tokenizer, prompt: list[int], think) -> bool:
    """The prompt ends inside an open reasoning block (the template put the start marker last)."""
    if think is None:
        return False
    tail = tokenizer.decode(prompt[-64:], skip_special_tokens=False)
    return tail.rfind(think[0]) > tail.rfind(think[1])


def marker_texts(answer: AnswerSpec) -> list[str]:
    """The texts the splitter reads that a tokenizer may hold as special tokens."""
    out = list(answer.think or ())
    if answer.fmt is not None:
        out += [answer.fmt.start, answer.fmt.end, *answer.fmt.markers, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, PYTHON_TAG]
    return [m for m in out if m]


def _render(turn: Turn, tokenizer, fmt: ToolFormat) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    messages, extra = template_input(turn.messages, fmt, turn.offered, template=template)
    kwargs = {**turn.template_kwargs, **extra}
    if not template:  # no template: role lines
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant: "
        return list(tokenizer.encode(text))
    try:
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except TypeError:  # a template that concatenates a call's arguments as text (DeepSeek-V3's)
            if not any(m.get("tool_calls") for m in messages):
                raise
            messages, _ = template_input(turn.messages, fmt, turn.offered, arguments_as_text=True, template=template)
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as e:
        if type(e).__module__.startswith("jinja2"):  # the template refused the conversation (e.g. roles)
            raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") \
                from None
        raise
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def prepare(turn: Turn, tokenizer, vocab_size: int) -> Prepared:
    """The engine's request for this turn (400s for what cannot be served: an unknown forced tool, a schema
    the grammar engine cannot compile). Runs off the event loop (tokenizing a long conversation takes time)."""
    if turn.messages is None:  # a completion: its prompt as it is, no tools
        prompt = list(tokenizer.encode(turn.prompt)) if isinstance(turn.prompt, str) else list(turn.prompt)
        return Prepared(prompt, _format_grammar(turn, tokenizer, vocab_size), AnswerSpec(None))
    fmt = detect(tokenizer)
    prompt = _render(turn, tokenizer, fmt)
    think = _markers(tokenizer)
    reasoning = _opens_reasoning(tokenizer, prompt, think)
    grammar = _format_grammar(turn, tokenizer, vocab_size)
    forced = turn.forced_tools
    if grammar is None and (forced is not None or turn.strict_auto):
        try:
            if forced is not None:
                grammar = forced_call(fmt, forced, _llg(tokenizer, vocab_size), turn.parallel_tool_calls)
            else:  # tool_choice auto with strict tools: free text, and any call held to its schema
                grammar = optional_calls(fmt, strict_view(turn.tools), _llg(tokenizer, vocab_size),
                                         turn.parallel_tool_calls)
        except UnwritableCall as e:
            if forced is not None:
                raise APIError(400, f"tools: {e}", param="tools") from None
            grammar = None  # auto: the model's format cannot write every strict tool's call; parsed, not held
        except (GrammarError, ValueError) as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
    if grammar is not None and think is not None:  # a reasoning model: the grammar starts after its reasoning
        grammar = grammar.after_reasoning(tokenizer.encode(think[1], add_special_tokens=False))
    offered = turn.offered
    return Prepared(prompt, grammar, AnswerSpec(fmt if offered else None, tuple(offered), think, reasoning))


def _llg(tokenizer, vocab_size: int):
    return grammar_tokenizer(tokenizer, vocab_size, list(getattr(tokenizer, "eos_token_ids", None) or ()))


def _format_grammar(turn: Turn, tokenizer, vocab_size: int):
    fmt = turn.response_format
    if not fmt or fmt.get("type", "text") == "text":
        return None
    try:
        return from_response_format(fmt, _llg(tokenizer, vocab_size))
    except (GrammarError, ValueError) as e:
        raise APIError(400, f"response_format: {e}", param="response_format") from None


def encode_chat(tokenizer, messages) -> list[int]:
    """A conversation's prompt through the model's chat template, no tools (tests, tools that count)."""
    turn = Turn("", messages=[m.as_dict() if hasattr(m, "as_dict") else m for m in messages], tool_choice="none")
    return prepare(turn, tokenizer, 0).prompt
