"""DeepSeek's DSML tool calls (V3.2, V4, V4.1): the format, its parser and its stream reader.

The format, as DeepSeek's own encoder writes an assistant turn (encoding/encoding_dsv32.py of
deepseek-ai/DeepSeek-V3.2, ported as mlx_lm/chat_templates/deepseek_v32.py; V4's and V4.1's encoders change
only the block's name and the tag prefix):

    <｜DSML｜function_calls>                                    V3.2 (V4: tool_calls; V4.1: `<｜DSML｜ calls>`,
    <｜DSML｜invoke name="NAME">                                  every V4.1 tag written `<｜DSML｜ invoke ...`)
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

A string="true" value is the string's raw text (no escaping, its whitespace kept); string="false" is JSON
(numbers, booleans, null, arrays, objects). An invoke without parameters is written with an empty line
between its tags; SGLang reports V4 writing `<｜DSML｜invoke name="NAME"/>` as well, read here too. DeepSeek's
reference parser (parse_message_from_completion_text) reads a value up to the first closing parameter tag, so
tag text inside a value (`<｜DSML｜invoke name="x">`) is part of the value; a call is read structurally, never
cut at a marker inside a value.

The reader accepts every dialect whatever the checkpoint (a model writes one); the format's own dialect
(from its template) is the one a forced call is written in (dsml_grammar.py). `｜DSML｜` is text in
DeepSeek's tokenizers (no added token), the reasoning markers `<think>` / `</think>` come from the
tokenizer. Calls come out when their block closes; an answer cut at its token limit keeps its complete
invokes only (an unclosed one is never returned), and a block that does not read as calls is content.
"""

from __future__ import annotations

import json
import re

from .formats import Call, ToolCallError, ToolFormat
from .reader import Reader, _held
from .stream import Splitter

DSML = "｜DSML｜"
# format name -> (the tags' prefix after `<` / `</`, the block's name)
DIALECTS = {"dsml_v32": (DSML, "function_calls"), "dsml_v4": (DSML, "tool_calls"), "dsml_v41": (DSML + " ", "calls")}
_PREFIXES = (DSML, DSML + " ")
_BLOCK_NAMES = ("function_calls", "tool_calls", "calls")
BLOCK_OPENERS = tuple(f"<{p}{n}>" for p in _PREFIXES for n in _BLOCK_NAMES)
_D = re.escape(DSML) + " ?"
_BLOCK_OPEN = re.compile(f"<{_D}(?:function_calls|tool_calls|calls)>")
_BLOCK_CLOSE = re.compile(f"</{_D}(?:function_calls|tool_calls|calls)>")
_INVOKE_OPEN = re.compile(f'<{_D}invoke\\s+name="([^"]*)"\\s*(/?)>')
_INVOKE_CLOSE = re.compile(f"</{_D}invoke>")
_PARAM_OPEN = re.compile(f'<{_D}parameter\\s+name="([^"]*)"(?:\\s+string="(true|false)")?\\s*>')
_PARAM_CLOSE = re.compile(f"</{_D}parameter>")
_OPEN_HEADS = tuple(f'<{p}{t} name="' for p in _PREFIXES for t in ("invoke", "parameter"))
_CLOSE_TAGS = tuple(f"</{p}{t}>" for p in _PREFIXES for t in ("invoke", *_BLOCK_NAMES))
_SPACE = re.compile(r"\s*")


def tags(fmt_name: str) -> tuple[str, ...]:
    """Every tag text of a dialect (the format's `markers`)."""
    p, block = DIALECTS[fmt_name]
    return (f"<{p}invoke", f"</{p}invoke>", f"<{p}parameter", f"</{p}parameter>", f"<{p}{block}>", f"</{p}{block}>")


def _partial_tag(text: str) -> bool:
    """`text` (what is left, no tag read from it yet) may still become a tag as more text comes."""
    if ">" in text:
        return False
    return any(h.startswith(text) or text.startswith(h) for h in _OPEN_HEADS) or \
        any(c.startswith(text) for c in _CLOSE_TAGS)


def _value(raw: str, string: str | None, key: str) -> str:
    """The JSON text of one parameter's value."""
    if string == "true":
        return json.dumps(raw, ensure_ascii=False)
    try:
        json.loads(raw)
    except json.JSONDecodeError:
        if string is None:  # no string attribute: text that is no JSON is a string
            return json.dumps(raw, ensure_ascii=False)
        raise ToolCallError(f"DSML: parameter {key!r} is string=\"false\" but not JSON: {raw[:80]!r}") from None
    return raw.strip()


def _arguments(params: dict[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in params.items()) + "}"


def read_invokes(text: str, pos: int = 0) -> tuple[list[Call], int, str]:
    """The complete invokes of a block's text from `pos`: (calls, where the first unread text starts, why the
    reading stopped: "end" (nothing but whitespace left), "close" (the block's closing tag is next), "more" (an
    invoke begun, not finished) or "bad" (text that is no invoke)). Raises ToolCallError for a value that does
    not read (string="false" that is not JSON)."""
    calls: list[Call] = []
    while True:
        at = _SPACE.match(text, pos).end()
        if at == len(text):
            return calls, pos, "end"
        if _BLOCK_CLOSE.match(text, at):
            return calls, at, "close"
        head = _INVOKE_OPEN.match(text, at)
        if head is None:
            return calls, pos, "more" if _partial_tag(text[at:]) else "bad"
        if head.group(2):  # self-closing: no arguments
            calls.append(Call(head.group(1), "{}"))
            pos = head.end()
            continue
        params: dict[str, str] = {}
        i = head.end()
        while True:
            i = _SPACE.match(text, i).end()
            close = _INVOKE_CLOSE.match(text, i)
            if close is not None:
                break
            param = _PARAM_OPEN.match(text, i)
            if param is None:
                return calls, pos, "more" if i == len(text) or _partial_tag(text[i:]) else "bad"
            end = _PARAM_CLOSE.search(text, param.end())
            if end is None:
                return calls, pos, "more"
            params[param.group(1)] = _value(text[param.end() : end.start()], param.group(2), param.group(1))
            i = end.end()
        calls.append(Call(head.group(1), _arguments(params)))
        pos = close.end()


def parse_dsml(body: str, tools=None) -> list[Call]:
    """The text between a block's opening and closing tags -> its calls."""
    calls, _, why = read_invokes(body)
    if why != "end" or not calls:
        raise ToolCallError("DSML: a block that is not a list of complete invokes")
    return calls


class DsmlReader(Reader):
    """An answer in DSML split as it streams: reasoning (before the reasoning end marker, when the answer opens
    inside it), content, and the calls of each block when the block closes. The text policy is the marker
    splitter's (stream.Splitter): whitespace before a call is not content, nor the blank lines after the
    reasoning."""

    def __init__(self, fmt: ToolFormat, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        super().__init__()
        self.fmt, self.tools = fmt, tools or []
        self.think = think if think and think[0] and think[1] else None
        self.state = "reasoning" if reasoning and self.think else "content"
        self.opener = ""  # the open block's opening tag
        self.body = ""  # the open block's text so far
        self.started = False  # content or a call seen (a reasoning start marker counts only before)
        self.space_before = ""  # the whitespace held before the open block (content again if it is no call)
        self.after_reasoning = False

    def feed(self, text: str) -> list:
        out: list = []
        if self.state != "block":
            self.buf += text
        else:
            self.body += text
            if ">" not in text:  # every tag ends with ">": nothing new to read
                return out
            self._block_step(out)
        while self.buf and self.state != "block" and self._step(out):
            pass
        return out

    def _finish(self, out: list, truncated: bool) -> None:
        """The end of the answer: text held back, and an open block's complete invokes (its unfinished one,
        cut by the token limit or never closed, is no call; a block with no complete invoke is content)."""
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "block":
            try:
                calls, _, why = read_invokes(self.body)
            except ToolCallError:
                calls, why = [], "bad"
            if calls and why != "bad":
                self._emit(out, calls)
            else:
                self._content(out, self.space_before + self.opener + self.body)
        elif self.buf:
            self._content(out, self.buf)

    def _step(self, out: list) -> bool:
        if self.state == "reasoning":
            if not self._reasoning_to(out, self.think[1]):
                return False
            self.state, self.after_reasoning = "content", True
            return True
        if not self.started and self.think and self._enters_reasoning(self.think[0]):
            return True
        m = _BLOCK_OPEN.search(self.buf)
        if m is not None:
            if m.start():
                self._content(out, self.buf[: m.start()])
            self.opener, self.body, self.buf = m.group(0), self.buf[m.end() :], ""
            self.state, self.started = "block", True
            self.space_before, self.space = self.space, ""
            self._block_step(out)
            return bool(self.buf)
        keep = _held(self.buf, list(BLOCK_OPENERS) + ([self.think[0]] if not self.started and self.think else []))
        if not self.started and self.think and self.think[0].startswith(self.buf.lstrip()):
            keep = len(self.buf)  # may still be the reasoning start marker
        self._content_to(out, keep)
        return False

    def _block_step(self, out: list) -> None:
        """The open block read as far as it has come: when it closes, its calls (or, not calls, its text as
        content) and the text after it back to `buf`."""
        try:
            calls, at, why = read_invokes(self.body)
        except ToolCallError:
            calls, at, why = [], 0, "bad"
        if why == "close":
            close = _BLOCK_CLOSE.match(self.body, at)
            rest, self.state = self.body[close.end() :], "content"
            if calls:
                self._emit(out, calls)
            else:
                self._content(out, self.space_before + self.opener + self.body[: close.end()])
            self.body, self.buf = "", rest + self.buf
        elif why == "bad":  # no calls: the block's text, to its closing tag, is content
            close = _BLOCK_CLOSE.search(self.body, at)
            if close is not None:
                self._content(out, self.space_before + self.opener + self.body[: close.end()])
                self.state, self.buf, self.body = "content", self.body[close.end() :] + self.buf, ""

    def _emit(self, out: list, calls: list[Call]) -> None:
        for c in calls:
            self._call(out, c.name, c.arguments)

    _content = Splitter._content  # the splitter's: content out, its trailing whitespace held (dropped beside a call)


def _format(name: str) -> ToolFormat:
    p, block = DIALECTS[name]
    return ToolFormat(name, f"<{p}{block}>", f"</{p}{block}>", True, parse_dsml, markers=tags(name),
                      reader=DsmlReader)


FORMATS = {name: _format(name) for name in DIALECTS}


def dsml_format(tokenizer, template: str) -> ToolFormat | None:
    """The DSML format of a checkpoint, or None. DeepSeek V3.2 / V4 ship no Jinja template (their encoder
    script renders the prompt): a checkpoint is DSML when its chat template text writes `｜DSML｜` (a Jinja port
    of the encoder), or when mlx-lm renders its prompts with its DSML renderer (tokenizer_config.json's
    `chat_template_type: deepseek_v32` makes TokenizerWrapper use mlx_lm/chat_templates/deepseek_v32.py, whose
    `tool_calls_template` names the block). The dialect is the block the renderer writes (V3.2's
    function_calls when the text does not say)."""
    text = template if DSML in template else ""
    renderer = getattr(tokenizer, "_chat_template", None)
    if not text and callable(renderer):
        import sys

        module = sys.modules.get(getattr(renderer, "__module__", "") or "")
        if getattr(module, "dsml_token", None) == DSML:
            text = str(getattr(module, "tool_calls_template", "")).replace("{dsml_token}", DSML) or DSML
    if not text:
        return None
    for name, (p, block) in DIALECTS.items():
        if f"{p}{block}" in text:
            return FORMATS[name]
    return FORMATS["dsml_v32"]
