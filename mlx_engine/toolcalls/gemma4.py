"""Gemma 4's tool calls, as its chat template writes them (google/gemma-4-31B-it chat_template.jinja: the
`format_argument` macro; vLLM's gemma4 tool parser reads the same):

    <|tool_call>call:NAME{key:VALUE,key:VALUE}<tool_call|>      (calls of one answer back to back)

VALUE: a string between `<|"|>` marks (its text as written: quotes, braces, newlines, backslashes, even
`<tool_call|>`), a number, true / false / null, `[v,v]`, `{k:v}`; keys bare (a key may hold spaces: the
template writes a dict's keys as they are, in `dictsort` order), `, ` between members as a model may write it.
Reasoning is the thought channel, `<|channel>thought\\n...<channel|>` at the start of the answer (the template's
thinking-off prompt ends with an empty one already closed).

mlx-lm's parser (mlx_lm/tool_parsers/gemma4.py) reads names of `[\\w-]` only, quotes keys of `\\w` only,
reads a `<|"|>...<|"|>` inside a call's string as a call of its own and a string holding JSON as that JSON:
this one reads the values by the grammar above, and a call ends at a `<tool_call|>` outside a string.
"""

from __future__ import annotations

import json
import math
import re

import regex

from .formats import Call, ToolCallError, ToolFormat
from .marked_reader import CALL, MORE, NOT, MarkedReader, ReasoningMark

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
_HEAD = regex.compile(r"\s*call:[^{}<>\s,:]+\{")
_NAME = re.compile(r"\s*call:([^{}<>\s,:]+)(?=\{)")
_BARE = re.compile(r"[^,}\]]*")  # a scalar: up to the next , } or ]
_KEY = re.compile(r"[^:{}\[\],]*")  # a bare key: up to its colon


class CallScan:
    """One call's text after `<|tool_call>`: `call:NAME{` first, then up to the `<tool_call|>` outside a
    string."""

    def __init__(self):
        self.pos, self.in_string, self.head_read = 0, False, False

    def advance(self, text: str) -> tuple[str, int]:
        if not self.head_read:
            m = _HEAD.match(text, partial=True)
            if m is None:
                return NOT, 0
            if m.partial:
                return MORE, 0
            self.head_read, self.pos = True, m.end()
        while True:
            if self.in_string:
                i = text.find(QUOTE, self.pos)
                if i < 0:
                    self.pos = max(self.pos, len(text) - len(QUOTE) + 1)
                    return MORE, 0
                self.pos, self.in_string = i + len(QUOTE), False
                continue
            q, c = text.find(QUOTE, self.pos), text.find(CLOSE, self.pos)
            if c >= 0 and (q < 0 or c < q):
                return CALL, c + len(CLOSE)
            if q < 0:
                self.pos = max(self.pos, len(text) - max(len(QUOTE), len(CLOSE)) + 1)
                return MORE, 0
            self.pos, self.in_string = q + len(QUOTE), True


class _Values:
    """Gemma 4's values read from `text` (recursive descent; ToolCallError where the text is none)."""

    def __init__(self, text: str):
        self.text = text

    def space(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in " \t\r\n":
            i += 1
        return i

    def expect(self, i: int, what: str) -> int:
        i = self.space(i)
        if not self.text.startswith(what, i):
            raise ToolCallError(f"gemma4: {what!r} expected at {self.text[i:i + 20]!r}")
        return i + len(what)

    def string(self, i: int) -> tuple[str, int]:
        j = self.text.find(QUOTE, i + len(QUOTE))
        if j < 0:
            raise ToolCallError("gemma4: a string without its closing mark")
        return self.text[i + len(QUOTE) : j], j + len(QUOTE)

    def value(self, i: int):
        i = self.space(i)
        if self.text.startswith(QUOTE, i):
            return self.string(i)
        if self.text.startswith("{", i):
            return self.obj(i)
        if self.text.startswith("[", i):
            return self.array(i)
        m = _BARE.match(self.text, i)
        return _scalar(m.group().strip()), m.end()

    def key(self, i: int) -> tuple[str, int]:
        i = self.space(i)
        if self.text.startswith(QUOTE, i):
            return self.string(i)
        m = _KEY.match(self.text, i)
        key = m.group().strip()
        if not key:
            raise ToolCallError(f"gemma4: a member without its key at {self.text[i:i + 20]!r}")
        return key, m.end()

    def obj(self, i: int) -> tuple[dict, int]:
        i, out = self.expect(i, "{"), {}
        if self.text.startswith("}", self.space(i)):
            return out, self.space(i) + 1
        while True:
            key, i = self.key(i)
            if key in out:
                raise ToolCallError(f"gemma4: the key {key!r} twice")
            out[key], i = self.value(self.expect(i, ":"))
            i = self.space(i)
            if self.text.startswith(",", i):
                i += 1
                continue
            return out, self.expect(i, "}")

    def array(self, i: int) -> tuple[list, int]:
        i, out = self.expect(i, "["), []
        if self.text.startswith("]", self.space(i)):
            return out, self.space(i) + 1
        while True:
            v, i = self.value(i)
            out.append(v)
            i = self.space(i)
            if self.text.startswith(",", i):
                i += 1
                continue
            return out, self.expect(i, "]")


def _scalar(text: str):
    """A bare value: JSON's number, true, false, null (Python's True / False / None too); other bare text is
    the string it says."""
    if not text:
        raise ToolCallError("gemma4: a member without its value")
    word = {"True": "true", "False": "false", "None": "null"}.get(text, text)
    try:
        value = json.loads(word)
    except json.JSONDecodeError:
        try:
            value = float(text)
        except ValueError:
            return text
    if isinstance(value, float) and not math.isfinite(value):
        return text
    return text if isinstance(value, (list, dict)) else value


def parse_gemma4(body: str, tools=None) -> list[Call]:
    """The text of one call (`call:NAME{...}`, its `<tool_call|>` there or not) -> the call."""
    body = body[: -len(CLOSE)] if body.endswith(CLOSE) else body
    m = _NAME.match(body)
    if m is None:
        raise ToolCallError("gemma4: no call:NAME{...}")
    values = _Values(body)
    args, end = values.obj(m.end())
    if body[end:].strip():
        raise ToolCallError("gemma4: text after the call's arguments")
    return [Call(m.group(1), json.dumps(args, ensure_ascii=False))]


class Gemma4Reader(MarkedReader):
    opener = OPEN
    marks = (ReasoningMark(CHANNEL, CHANNEL_END, head="thought"),)

    def scanner(self) -> CallScan:
        return CallScan()

    def parse(self, text: str) -> list[Call]:
        return parse_gemma4(text)


GEMMA4 = ToolFormat("gemma4", OPEN, CLOSE, True, parse_gemma4, markers=(QUOTE, CHANNEL, CHANNEL_END),
                    reader=Gemma4Reader)
