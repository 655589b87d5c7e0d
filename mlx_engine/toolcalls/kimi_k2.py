"""Kimi K2's tool calls (Kimi-K2-Instruct, K2-Thinking, K2.5 / K2.6), read as the model writes them.

The format (moonshotai/Kimi-K2.6 chat_template.jinja; vLLM's kimi_k2_tool_parser.py, which mlx-lm's
tool_parsers/kimi_k2.py copies):

    [reasoning</think>][content]<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
    <|tool_calls_section_end|>[content]

Every marker is a special token of Kimi's tokenizer (tokenizer_config.json added_tokens_decoder); the tool's
name lives in the call id `functions.NAME:N` (N: the conversation's running call index; an id without the
`functions.` prefix is read too). The thinking models open `<think>` in the generation prompt.

Where mlx-lm's parser is wrong, this reader is not: a call's arguments end where their JSON value ends, so a
`<|tool_call_end|>` (or any marker) inside a string stays in the string (mlx-lm cuts the call there); text
between the section's calls (noise) is dropped; content around a section is kept verbatim; a call the answer
never closed (cut at max_tokens) is never returned: its text is content.
"""

from __future__ import annotations

import json
import re

from .formats import Call, ToolCallError, ToolFormat, json_value_end
from .reader import Reader, _held

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL_ID = re.compile(r"\s*((?:functions\.)?(\S+?)(?::\d+)?)\s*", re.DOTALL)
_OWN_ID = re.compile(r"functions\.[^:\s]+:\d+")  # the id form Kimi's template renders back (render.KIMI_ID)
_NEED_MORE = object()


def read_call(text: str, final: bool = False):
    """One call's text after `<|tool_call_begin|>`: (Call, characters used up to and with `<|tool_call_end|>`),
    _NEED_MORE when the text may still become a call, or None when it is no call. final: no more text comes
    (a call closed by the end of the answer, not by its end marker, is still read when its JSON is whole)."""
    at = text.find(ARGS_BEGIN)
    if at < 0:
        stop = min((i for i in (text.find(CALL_END), text.find(CALL_BEGIN), text.find(SECTION_END)) if i >= 0),
                   default=-1)
        return None if final or stop >= 0 else _NEED_MORE
    m = _CALL_ID.fullmatch(text[:at])
    start = at + len(ARGS_BEGIN)
    body = text[start:].lstrip()
    if m is None or not body.startswith("{"):
        if body == "" and not final:
            return _NEED_MORE
        return _fallback(text, m, start, final)
    end = json_value_end(text, start)
    if end is None:
        return None if final else _NEED_MORE
    tail = text[end:].lstrip()
    if tail.startswith(CALL_END):
        used = len(text) - len(tail) + len(CALL_END)
    elif not final and CALL_END.startswith(tail):
        return _NEED_MORE
    elif final and tail == "":
        used = len(text)
    else:
        return _fallback(text, m, start, final)
    call = _call(m, text[start:end].strip())
    return (call, used) if call is not None else None


def _fallback(text: str, m, start: int, final: bool):
    """A call whose arguments are not one JSON value before its end marker: the text up to the first end
    marker, when that is a JSON object."""
    end = text.find(CALL_END, start)
    if end < 0:
        return None if final else _NEED_MORE
    call = _call(m, text[start:end].strip()) if m is not None else None
    return (call, end + len(CALL_END)) if call is not None else None


def _call(m, arguments: str) -> Call | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or m is None:
        return None
    return Call(m.group(2), arguments, m.group(1))


def parse_kimi_k2(body: str, tools=None) -> list[Call]:
    """The text of a whole section (between its begin and end markers) -> its calls."""
    calls, rest = [], body
    while True:
        i = rest.find(CALL_BEGIN)
        if i < 0:
            break
        got = read_call(rest[i + len(CALL_BEGIN):], final=True)
        if not isinstance(got, tuple):
            raise ToolCallError("kimi_k2: a call that does not read as ID<|tool_call_argument_begin|>{JSON}")
        calls.append(got[0])
        rest = rest[i + len(CALL_BEGIN) + got[1]:]
    if not calls:
        raise ToolCallError("kimi_k2: a tool-call section without calls")
    return calls


class KimiK2Reader(Reader):
    """An answer as it streams -> reasoning, content and calls (stream.Text / CallStart / CallArgs). A call
    comes whole when its end marker does."""

    def __init__(self, fmt: ToolFormat, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        super().__init__()
        self.think = think if think and think[0] and think[1] else None
        self.state = "reasoning" if reasoning and self.think else "content"
        self.opened = False  # the reasoning ended or a section opened (a think start marker opens reasoning only
        # before that, and before any content)
        self.unsent = ""  # the open section's text since its last call (content if the answer is cut in a call)

    def _finish(self, out: list, truncated: bool) -> None:
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "content":
            self._content(out, self.buf)
        elif self.state == "call":
            got = None if truncated else read_call(self.buf, final=True)
            if isinstance(got, tuple):
                self._emit(out, got[0])
            else:  # never closed (or no call): its text is content, never a call
                self._content(out, self.unsent + self.buf)

    # -- the states ---------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        if self.state == "reasoning":
            return self._reasoning_step(out)
        if self.state == "content":
            return self._content_step(out)
        if self.state == "section":
            return self._section(out)
        got = read_call(self.buf)
        if got is _NEED_MORE:
            return False
        if got is None:  # no call: its text up to the next marker is dropped as noise
            stops = [i for i in (self.buf.find(CALL_BEGIN), self.buf.find(SECTION_END)) if i >= 0]
            cut = min(stops) if stops else len(self.buf)
            self.unsent += self.buf[:cut]
            self.buf, self.state = self.buf[cut:], "section"
            return True
        self._emit(out, got[0])
        self.buf, self.state, self.unsent = self.buf[got[1]:], "section", ""
        return True

    def _reasoning_step(self, out: list) -> bool:
        if not self._reasoning_to(out, self.think[1]):
            return False
        self.state, self.drop_lead, self.opened = "content", True, True
        return True

    def _content_step(self, out: list) -> bool:
        if not self.opened and not self.content_seen and self.think:
            if self._enters_reasoning(self.think[0]):
                return True
            if self.think[0].startswith(self.buf.lstrip()):
                return False  # may still be the reasoning start marker
        i = self.buf.find(SECTION_BEGIN)
        if i >= 0:
            self._content(out, self.buf[:i])
            self.buf, self.state, self.unsent = self.buf[i + len(SECTION_BEGIN):], "section", SECTION_BEGIN
            self.opened = True
            return True
        keep = _held(self.buf, [SECTION_BEGIN])
        self._content_to(out, keep)
        return False

    def _section(self, out: list) -> bool:
        stops = [(i, m) for m in (CALL_BEGIN, SECTION_END) if (i := self.buf.find(m)) >= 0]
        if not stops:
            keep = _held(self.buf, [CALL_BEGIN, SECTION_END])
            self.unsent += self.buf[: len(self.buf) - keep]  # noise between calls
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        i, marker = min(stops)
        self.unsent += self.buf[: i + len(marker)]
        self.buf = self.buf[i + len(marker):]
        self.state = "call" if marker == CALL_BEGIN else "content"
        return True

    def _emit(self, out: list, call: Call) -> None:
        """The call out (with the model's id where it has the form the template renders back); whitespace held
        before it is dropped, and so is the whitespace after it before any content."""
        self._call(out, call.name, call.arguments, call.id if call.id and _OWN_ID.fullmatch(call.id) else None)
        self.space = ""
        self.drop_lead = self.drop_lead or not self.content_seen


KIMI_K2 = ToolFormat("kimi_k2", SECTION_BEGIN, SECTION_END, True, parse_kimi_k2,
                     markers=(CALL_BEGIN, ARGS_BEGIN, CALL_END), reader=KimiK2Reader)
