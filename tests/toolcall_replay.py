"""The canitoolcall fixtures replayed through the server's own path: token ids -> serve.jobs.Output (its
TextStream drops the special tokens the splitter does not read, then the splitter or the format's reader splits
reasoning, content and calls) -> the events an OpenAI client merges -> a canitoolcall ParseResult.

Each fixture's text is encoded by a test tokenizer of its family: byte-level BPE without merges (so a marker that
is not one token is split byte by byte, the hardest case for a splitter) plus the family's markers as added
tokens, special or not as the family's published tokenizer declares them (PROFILES cites each source). The
fixture's own `output_token_ids` belong to tokenizers this machine cannot download, so the text is encoded again;
every marker the suite's family.json lists is one token here, as it is in those tokenizers, or plain text where
the published tokenizer has it as text.

The tokenizer carries a chat-template excerpt with the lines a real checkpoint's template has that
toolcalls.detect reads, so the format, the reasoning markers and whether the answer opens inside the
reasoning are decided the way the server decides them for that checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from canitoolcall import checks
from canitoolcall.chunking import DEFAULT_STRATEGIES, split
from canitoolcall.fixtures import Fixture
from canitoolcall.pytest_plugin import family_for
from canitoolcall.results import Observation, ParsedToolCall, ParseResult

from mlx_engine import text as text_ops
from mlx_engine.serve.jobs import Done, Job, Output, Request
from mlx_engine.serve.turn import AnswerSpec, _markers, _opens_reasoning
from mlx_engine.toolcalls import detect
from mlx_engine.toolcalls.stream import CallArgs, CallStart, Text


@dataclass(frozen=True)
class Profile:
    """A family's tokenizer as this test builds it."""
    template: str  # the lines of the checkpoint's chat template that detect() reads
    special: tuple[str, ...]  # markers the published tokenizer holds as special tokens
    plain: tuple[str, ...] = ()  # markers it holds as ordinary added tokens (one token, not special)
    stops: tuple[str, ...] = ()  # the end-of-turn tokens a complete answer ends with (special)
    source: str = ""  # where the special status comes from
    published_ids: tuple[tuple[int, str], ...] = ()  # (id, marker) in the published tokenizer: placed as the
    # fixture's own output_token_ids place them (marker text the model wrote inside a value stays text)


QWEN_TOKENS = dict(special=("<|im_start|>",), plain=("<tool_call>", "</tool_call>", "<think>", "</think>"),
                   stops=("<|im_end|>",),
                   source="Qwen/Qwen3-8B tokenizer_config.json added_tokens_decoder: <|im_start|>/<|im_end|> "
                          "special, <tool_call>/</tool_call>/<think>/</think> added with special: false")

PROFILES: dict[str, Profile] = {
    "qwen3-hermes": Profile(
        '{%- if tools %}<tools>{{ tools }}</tools>{% endif %}'
        '{{- "<tool_call>\\n{\\"name\\": \\"" }}{{- tool_call.name }}', **QWEN_TOKENS),
    "qwen3-xml": Profile(
        '{%- if tools %}<tools>{{ tools }}</tools>{% endif %}'
        '{{- "<tool_call>\\n<function=" + tool_call.name + ">\\n" }}', **QWEN_TOKENS),
    "deepseek-v3": Profile(
        "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
        special=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        plain=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<think>", "</think>"),
        stops=("<｜end▁of▁sentence｜>",),
        source="deepseek-ai/DeepSeek-V3.1 tokenizer_config.json: BOS/EOS and the role tokens special, the "
               "tool-call tokens and <think> added with special: false"),
    "deepseek-dsml": Profile(
        "{{'<｜Assistant｜>'}}{{ '<｜DSML｜' }}",
        special=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"), plain=("<think>", "</think>"),
        stops=("<｜end▁of▁sentence｜>",),
        source="deepseek-ai/DeepSeek-V3.2 tokenizer_config.json and encoding/encoding_dsv32.py: the DSML "
               "markup is text (｜DSML｜ is no added token); <think> added with special: false"),
    "glm": Profile(
        "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>",
        special=("[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"),
        plain=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
               "<think>", "</think>"),
        stops=("<|user|>",),
        source="zai-org/GLM-4.7 tokenizer_config.json: role tokens special, <tool_call>/<arg_key>/<arg_value>/"
               "<think> added with special: false"),
    "kimi-k2": Profile(
        "{{'<|tool_calls_section_begin|>'}}{{'<|tool_call_begin|>' + tool_call['id'] + "
        "'<|tool_call_argument_begin|>'}}",
        special=("<|im_assistant|>", "<|im_middle|>", "<|im_system|>", "<|tool_calls_section_begin|>",
                 "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
                 "<|tool_call_argument_begin|>", "<think>", "</think>"),
        stops=("<|im_end|>",),
        source="moonshotai/Kimi-K2.6 tokenizer_config.json added_tokens_decoder: every <|...|> token and "
               "<think>/</think> special: true (tiktoken special tokens)"),
    "kimi-k3": Profile(
        "{{'<|open|>message role=\"assistant\"<|sep|>'}}",
        special=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"), stops=("<|end_of_msg|>",),
        source="moonshotai/Kimi-K3 tokenizer_config.json: the XTML control tokens special: true"),
    "mistral": Profile(
        "{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}",
        special=("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]",
                 "[/THINK]", "[TOOL_RESULTS]"),
        stops=("</s>",),
        source="mistral-common's Tekken control tokens (tekken.json special_tokens): [TOOL_CALLS], [ARGS], "
               "[CALL_ID], [THINK], [/THINK] are control tokens, never text"),
    "gemma4": Profile(
        "{{'<|tool_call>call:' + tool_call.name }}{{ '<tool_call|>' }}",
        special=("<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|\"|>", "<|channel>", "<channel|>",
                 "<|tool_response>", "<tool_response|>"),
        stops=("<turn|>",),
        source="google/gemma-4-31B-it tokenizer.json added_tokens: the turn, channel, tool-call and string "
               "delimiter tokens special: true"),
    "gpt-oss": Profile(
        "{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name + ' <|constrain|>json"
        "<|message|>' }}",
        special=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
        stops=("<|call|>", "<|return|>"),
        source="openai/gpt-oss-20b tokenizer.json (o200k_harmony): the Harmony tokens special: true",
        published_ids=((200002, "<|return|>"), (200003, "<|constrain|>"), (200005, "<|channel|>"),
                       (200006, "<|start|>"), (200007, "<|end|>"), (200008, "<|message|>"), (200012, "<|call|>"))),
    "llama3": Profile(
        "{{- '<|python_tag|>' }}{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}",
        special=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"),
        stops=("<|eot_id|>", "<|eom_id|>"),
        source="meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json: the header, <|python_tag|>, <|eom_id|> "
               "and <|eot_id|> tokens special: true"),
    "llama4": Profile(
        "{{- '<|header_start|>assistant<|header_end|>' }}{{- '[' + tool_call.name + '(' }}",
        special=("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|python_start|>", "<|python_end|>",
                 "<|eom|>"),
        stops=("<|eot|>", "<|eom|>"),
        source="meta-llama/Llama-4-Scout-17B-16E-Instruct tokenizer_config.json: header, python and end tokens "
               "special: true"),
}


def profile_name(fixture: Fixture) -> str:
    tags, fam = set(fixture.tags), fixture.family
    if fam == "deepseek":
        return "deepseek-v3" if tags & {"x-deepseek-v3", "x-deepseek-v31"} else "deepseek-dsml"
    if fam == "kimi":
        return "kimi-k3" if "x-kimi-k3" in tags or "Kimi-K3" in fixture.models[0] else "kimi-k2"
    if fam == "llama":
        return "llama4" if "x-llama-pythonic" in tags or "Llama-4" in fixture.models[0] else "llama3"
    return fam


@lru_cache(maxsize=None)
def tokenizer(name: str):
    """The family's test tokenizer, wrapped as the server wraps a checkpoint's (mlx-lm's TokenizerWrapper)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    p = PROFILES[name]
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in p.special + p.stops])
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in p.plain])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=p.stops[0])
    hf.chat_template = p.template
    wrapper = TokenizerWrapper(hf, eos_token_ids=[hf.convert_tokens_to_ids(s) for s in p.stops])
    return wrapper


def generation_prompt(fixture: Fixture) -> str:
    """The text the chat template put last (the fixture's, else its family's reference model's default)."""
    if fixture.generation_prompt is not None:
        return fixture.generation_prompt
    fam = family_for(fixture)
    refs = list(fam.reference_models) if fam is not None else []
    for ref in refs:
        if ref.repo == fixture.models[0]:
            return ref.default_generation_prompt or ""
    return (refs[0].default_generation_prompt or "") if refs else ""


class _Collected(Job):
    """A job whose events are kept in a list (no event loop: the test is the engine thread and the client)."""

    def __init__(self, request: Request):
        super().__init__(request, loop=object())
        self.got: list = []

    def put(self, event) -> None:
        self.got.append(event)


def _stop_token(name: str, raw: str) -> str:
    """The end-of-turn token that followed a complete answer (gpt-oss: <|call|> after a call, else <|return|>)."""
    stops = PROFILES[name].stops
    if name == "gpt-oss":
        last = raw.rsplit("<|start|>", 1)[-1].rsplit("<|channel|>", 1)[-1]
        return "<|call|>" if " to=" in last.split("<|message|>", 1)[0] else "<|return|>"
    return stops[0]


def output_ids(fixture: Fixture) -> tuple[list[int], bool]:
    """The answer's token ids as the model emitted them, and whether it ended at max_tokens (no stop token)."""
    name = profile_name(fixture)
    tok = tokenizer(name)
    ids = _encoded(fixture, PROFILES[name], tok._tokenizer)
    truncated = "truncated" in fixture.tags
    if not truncated:
        ids.append(tok._tokenizer.convert_tokens_to_ids(_stop_token(name, fixture.raw_output)))
    stops = set(tok.eos_token_ids)
    first = next((i for i, t in enumerate(ids) if t in stops), None)
    if first is not None and first < len(ids) - 1:  # the engine ends the answer at its first stop token
        return ids[: first + 1], False
    return ids, truncated


def _encoded(fixture: Fixture, p: Profile, hf) -> list[int]:
    """raw_output's ids: where the profile knows the published tokenizer's marker ids and the fixture has its own
    ids, a marker is a special token exactly where those ids hold it and text elsewhere (openai-harmony renders
    `<|call|>` inside an argument as text tokens), else every marker text is its token."""
    published = dict(p.published_ids)
    if not published or not fixture.output_token_ids:
        return list(hf.encode(fixture.raw_output, add_special_tokens=False))
    raw, at, ids = fixture.raw_output, 0, []
    for marker in (published[t] for t in fixture.output_token_ids if t in published):
        i = raw.index(marker, at)
        ids += hf.encode(raw[at:i], add_special_tokens=False, split_special_tokens=True) if i > at else []
        ids.append(hf.convert_tokens_to_ids(marker))
        at = i + len(marker)
    return ids + (hf.encode(raw[at:], add_special_tokens=False, split_special_tokens=True) if at < len(raw) else [])


def answer_spec(fixture: Fixture) -> AnswerSpec:
    """What serve.turn.prepare decides for this checkpoint and prompt."""
    tok = tokenizer(profile_name(fixture))
    prompt = list(tok._tokenizer.encode(generation_prompt(fixture), add_special_tokens=False)) or [0]
    think = _markers(tok)
    return AnswerSpec(detect(tok), tuple(fixture.tools), think, _opens_reasoning(tok, prompt, think))


def replay(fixture: Fixture, groups: list[list[int]], truncated: bool) -> ParseResult:
    """The deltas `groups` (token ids) through the server's Output; the events merged as a client merges them."""
    tok = tokenizer(profile_name(fixture))
    answer = answer_spec(fixture)
    n = sum(len(g) for g in groups)
    job = _Collected(Request([0], max_tokens=n if truncated else n + 1, answer=answer))
    out = Output(job, tok, text_ops.special_ids(tok), frozenset(tok.eos_token_ids))
    for g in groups:
        if out.add(g):
            break
    out.finish({}, "length" if truncated else None)
    return merged(job.got)


def merged(events: list) -> ParseResult:
    text = {"content": "", "reasoning": ""}
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, Text):
            text[e.kind] += e.text
        elif isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
        elif isinstance(e, Done):
            break
    return ParseResult(content=text["content"] or None, reasoning_content=text["reasoning"] or None,
                       tool_calls=tuple(ParsedToolCall(name, args) for name, args in (calls[i] for i in sorted(calls))))


def observe(fixture: Fixture, strategies=DEFAULT_STRATEGIES) -> Observation:
    """One non-streamed parse (every token in one delta, as the server's non-streamed response builds it) and
    one per chunking strategy."""
    ids, truncated = output_ids(fixture)
    tok = tokenizer(profile_name(fixture))
    special = text_ops.special_ids(tok)
    streams = {s.id: replay(fixture, split(ids, s, special=special), truncated) for s in strategies}
    return Observation(nonstream=replay(fixture, [ids], truncated), streams=streams)


def verdict(fixture: Fixture, obs: Observation | None = None):
    """The suite's own judgement: (status, the rows that are not a pass)."""
    obs = obs or observe(fixture)
    rows = checks.run_checks(fixture, family_for(fixture), obs)
    status = checks.case_status(rows)
    return status, [r for r in rows if r.status.value != "pass"]


def describe(fixture: Fixture, obs: Observation, bad) -> str:
    lines = [f"{fixture.id} ({profile_name(fixture)}):"]
    lines += [f"  {r.check} [{r.strategy}]: {r.status.value} {r.detail or ''}" for r in bad[:8]]
    lines.append("  nonstream: " + json.dumps(obs.nonstream.to_dict(), ensure_ascii=False)[:600])
    lines.append("  raw: " + json.dumps(fixture.raw_output, ensure_ascii=False)[:600])
    return "\n".join(lines)
