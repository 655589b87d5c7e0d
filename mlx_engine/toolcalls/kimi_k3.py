"""Kimi K3's answers (XTML), read as the model writes them: reasoning, content and tool calls.

The format (moonshotai/Kimi-K3 encoding_k3.py; mlx-lm's tool_parsers/kimi_k3.py reads the tools element):
an answer is channels, each `<|open|>NAME ATTRS<|sep|>` ... `<|close|>NAME<|sep|>`, the three markers control
(special) tokens of K3's tokenizer:

    <|open|>think<|sep|>REASONING<|close|>think<|sep|>
    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="KEY" type="string|number|boolean|null|array|object"<|sep|>VALUE<|close|>argument<|sep|>
        ... (or one <|open|>json type="object"<|sep|>{JSON}<|close|>json<|sep|>)
      <|close|>call<|sep|> ...
    <|close|>tools<|sep|><|close|>message<|sep|>

The generation prompt opens the think channel (thinking) or the response channel (thinking off); an answer
that opens with the response or tools channel skipped its reasoning. A string value is its raw text, any
other type JSON; attribute values escape `&` and `"` as `&amp;` / `&quot;`. Value text is encoded as ordinary
tokens, so marker text inside a value reads the same as the markers: an argument ends at the first
`<|close|>argument<|sep|>` that the call's structure follows (the next argument or the call's close).
The channel markers never reach content; a call comes whole when it closes, and a call the answer never closed
(cut at max_tokens) is never returned: its text is content.
"""

from __future__ import annotations

import json
import re

from .formats import Call, ToolCallError, ToolFormat, json_value_end
from .reader import Reader, _held

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
THINK_OPEN, THINK_CLOSE = OPEN + "think" + SEP, CLOSE + "think" + SEP
RESPONSE_OPEN, RESPONSE_CLOSE = OPEN + "response" + SEP, CLOSE + "response" + SEP
TOOLS_OPEN, TOOLS_CLOSE = OPEN + "tools" + SEP, CLOSE + "tools" + SEP
MESSAGE_CLOSE = CLOSE + "message" + SEP
CALL_OPEN, CALL_CLOSE = OPEN + "call", CLOSE + "call" + SEP
ARG_OPEN, ARG_CLOSE = OPEN + "argument", CLOSE + "argument" + SEP
JSON_OPEN, JSON_CLOSE = OPEN + "json", CLOSE + "json" + SEP
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_ENTITY = re.compile(r"&(quot|amp|lt|gt|apos);")
_ENTITIES = {"quot": '"', "amp": "&", "lt": "<", "gt": ">", "apos": "'"}
_NEED_MORE = object()


def attributes(text: str) -> dict[str, str]:
    """`key="value" ...` of an element's open tag, values unescaped."""
    return {k: _ENTITY.sub(lambda m: _ENTITIES[m.group(1)], v) for k, v in _ATTR.findall(text)}


def _value(text: str, kind: str):
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # (mlx-lm's reading: a value that is not JSON stays its text)


def _open_tag(text: str, at: int, final: bool):
    """(attributes, where the element's body starts) of the open tag at `at` (after its name), or _NEED_MORE."""
    end = text.find(SEP, at)
    if end < 0:
        return None if final else _NEED_MORE
    return attributes(text[at:end]), end + len(SEP)


def _argument_end(text: str, at: int, final: bool):
    """(where the value starting at `at` ends, where the next item starts): the first `<|close|>argument<|sep|>`
    that the call's structure follows; _NEED_MORE while undecided; None when none does."""
    j = text.find(ARG_CLOSE, at)
    while j >= 0:
        after = j + len(ARG_CLOSE)
        rest = text[after:].lstrip()
        if rest.startswith((ARG_OPEN, CALL_CLOSE, JSON_OPEN)):
            return j, after
        if not final and any(m.startswith(rest) for m in (ARG_OPEN, CALL_CLOSE, JSON_OPEN)):
            return _NEED_MORE
        j = text.find(ARG_CLOSE, after)
    return None if final else _NEED_MORE


def read_call(text: str, final: bool = False):
    """One call element at the start of `text` (after any whitespace): (Call, characters used), _NEED_MORE while
    it may still become one, or None when it is no call (no tool name, an unclosed element at the end)."""
    pos = len(text) - len(text.lstrip())
    if not text.startswith(CALL_OPEN, pos):
        return None if final or not CALL_OPEN.startswith(text[pos:]) else _NEED_MORE
    got = _open_tag(text, pos + len(CALL_OPEN), final)
    if not isinstance(got, tuple):
        return got
    attrs, pos = got
    arguments: dict = {}
    while True:
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        rest = text[pos:]
        if rest.startswith(CALL_CLOSE):
            name = attrs.get("tool")
            call = Call(name, json.dumps(arguments, ensure_ascii=False)) if name else None
            return (call, pos + len(CALL_CLOSE)) if call else None
        if rest.startswith(ARG_OPEN):
            got = _open_tag(text, pos + len(ARG_OPEN), final)
            if not isinstance(got, tuple):
                return got
            arg, start = got
            ends = _argument_end(text, start, final)
            if not isinstance(ends, tuple):
                return ends
            if "key" not in arg:
                return None
            arguments[arg["key"]] = _value(text[start:ends[0]], arg.get("type", "string"))
            pos = ends[1]
        elif rest.startswith(JSON_OPEN):  # the arguments as one JSON object
            got = _open_tag(text, pos + len(JSON_OPEN), final)
            if not isinstance(got, tuple):
                return got
            start = got[1]
            end = json_value_end(text, start)
            if end is None:
                return None if final else _NEED_MORE
            tail = text[end:].lstrip()
            if not tail.startswith(JSON_CLOSE):
                return _NEED_MORE if not final and JSON_CLOSE.startswith(tail) else None
            try:
                value = json.loads(text[start:end])
            except json.JSONDecodeError:
                return None
            if not isinstance(value, dict):
                return None
            arguments.update(value)
            pos = len(text) - len(tail) + len(JSON_CLOSE)
        elif not final and any(m.startswith(rest) for m in (CALL_CLOSE, ARG_OPEN, JSON_OPEN)):
            return _NEED_MORE
        else:
            return None


def parse_kimi_k3(body: str, tools=None) -> list[Call]:
    """The text inside a tools element -> its calls."""
    calls, pos = [], 0
    while body[pos:].strip():
        got = read_call(body[pos:], final=True)
        if not isinstance(got, tuple):
            raise ToolCallError("kimi_k3: a tools element whose text is no call")
        calls.append(got[0])
        pos += got[1]
    if not calls:
        raise ToolCallError("kimi_k3: a tools element without calls")
    return calls


class KimiK3Reader(Reader):
    """An XTML answer as it streams -> reasoning, content and calls (stream.Text / CallStart / CallArgs)."""

    def __init__(self, fmt: ToolFormat, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        super().__init__()
        self.state = "reasoning" if reasoning else "content"
        self.thought = False  # reasoning text sent (an answer opening another channel first skipped it)
        self.opened = False  # a tools element opened (a think channel opens only before, and before content)
        self.unsent = ""  # the tools element's text since its last call (content if the answer is cut in a call)

    def _finish(self, out: list, truncated: bool) -> None:
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "content":
            self._content(out, self.buf)
        elif self.state == "tools" and self.buf.strip():
            got = None if truncated else read_call(self.buf, final=True)
            if isinstance(got, tuple):
                self._emit(out, got[0])
            else:  # never closed (or no call): its text is content, never a call
                self._content(out, self.unsent + self.buf)

    def _step(self, out: list) -> bool:
        if self.state == "reasoning":
            return self._reasoning_step(out)
        if self.state == "content":
            return self._content_step(out)
        return self._tools(out)

    def _reasoning_step(self, out: list) -> bool:
        if not self.thought:  # the answer may skip its reasoning: the response or tools channel first
            lead = self.buf.lstrip()
            for opener in (RESPONSE_OPEN, TOOLS_OPEN):
                if lead.startswith(opener):
                    self.buf, self.state = lead, "content"
                    return True
            if any(m.startswith(lead) for m in (RESPONSE_OPEN, TOOLS_OPEN, THINK_CLOSE)) and THINK_CLOSE not in lead:
                return False
        if not self._reasoning_to(out, THINK_CLOSE):
            return False
        # whitespace before the reasoning, and after it before any content, is not content
        self.state, self.thought, self.space, self.drop_lead = "content", True, "", True
        return True

    def _reasoning(self, out: list, text: str) -> None:
        if text:
            self.thought = True
        super()._reasoning(out, text)

    def _content_step(self, out: list) -> bool:
        tags = [RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE] + (
            [] if self.opened or self.content_seen or self.thought else [THINK_OPEN])
        found = [(i, t) for t in tags if (i := self.buf.find(t)) >= 0]
        if not found:
            keep = _held(self.buf, tags)
            self._content_to(out, keep)
            return False
        i, tag = min(found)
        self._content(out, self.buf[:i])
        self.buf = self.buf[i + len(tag):]
        if tag == THINK_OPEN:
            self.state = "reasoning"
        elif tag == TOOLS_OPEN:
            self.state, self.unsent, self.opened = "tools", TOOLS_OPEN, True
        return True

    def _tools(self, out: list) -> bool:
        rest = self.buf.lstrip()
        if rest.startswith(TOOLS_CLOSE):
            self.buf, self.state, self.unsent = rest[len(TOOLS_CLOSE):], "content", ""
            return True
        got = read_call(self.buf)
        if got is _NEED_MORE or (got is None and TOOLS_CLOSE.startswith(rest)):
            return False
        if got is None:  # not a call: its text up to the next call or the element's close is dropped
            stops = [i for i in (self.buf.find(CALL_OPEN, 1), self.buf.find(TOOLS_CLOSE)) if i >= 0]
            cut = min(stops) if stops else len(self.buf) - _held(self.buf, [CALL_OPEN, TOOLS_CLOSE])
            if cut <= 0:
                return False
            self.unsent += self.buf[:cut]
            self.buf = self.buf[cut:]
            return True
        self._emit(out, got[0])
        self.buf, self.unsent = self.buf[got[1]:], ""
        return True

    def _emit(self, out: list, call: Call) -> None:
        """The call out; whitespace held before it is dropped, and so is the whitespace after it before any
        content."""
        self._call(out, call.name, call.arguments)
        self.space = ""
        self.drop_lead = self.drop_lead or not self.content_seen


KIMI_K3 = ToolFormat("kimi_k3", TOOLS_OPEN, TOOLS_CLOSE, True, parse_kimi_k3, markers=(OPEN, CLOSE, SEP),
                     reader=KimiK3Reader)
