"""An answer's text, as it streams, split the way agents read it: reasoning, content, tool calls.

The splitter takes text deltas (the markers' text included: `<think>`, `<tool_call>`, DeepSeek's
`<｜tool▁calls▁begin｜>`, whether the tokenizer has them as special tokens or not) and returns events:

    Text("reasoning" | "content", text)      CallStart(index, id, name)      CallArgs(index, text)

A marker is matched on the text, so one split over several deltas is found; a tail that may be the start
of a marker is held back until the next delta settles it. Reasoning is what comes before the reasoning end
marker when the answer opens inside it (the prompt opened it, or the answer starts with the start marker);
it never reaches content or the tool-call parser. A JSON call's arguments stream in pieces as they arrive
(its name once it is read); other formats' calls come whole when their end marker does. Content that is
only whitespace beside calls is dropped. Text between markers that does not parse as a call is content.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from .formats import ToolCallError, ToolFormat, json_value_end

_NAME_THEN_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class Text:
    kind: str  # "reasoning" | "content"
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _held(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    hold = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), hold, -1):
            if text.endswith(m[:n]):
                hold = n
                break
    return hold


def reader_for(fmt: ToolFormat | None, think: tuple[str, str] | None = None, reasoning: bool = False,
               tools: list | None = None):
    """The stream reader of an answer in this format: the format's own (Harmony's channels, DSML) or the
    marker splitter. Each has feed(text) -> events, finish(truncated) -> events and made_calls."""
    if fmt is not None and fmt.reader is not None:
        return fmt.reader(fmt, think, reasoning, tools)
    return Splitter(fmt, think, reasoning, tools)


class Splitter:
    def __init__(self, fmt: ToolFormat | None, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        """fmt: the model's tool-call format (None: no tools offered, nothing is parsed as a call); think: the
        reasoning (start, end) markers, or None; reasoning: the answer opens inside the reasoning."""
        self.fmt, self.tools = fmt, tools or []
        self.think = think if think and think[0] and think[1] else None
        self.state = "reasoning" if reasoning and self.think else "content"
        self.buf = ""
        self.body = ""  # the current call's text so far
        self.calls: list[str] = []  # ids of the calls begun
        self.args_sent = 0  # characters of the current call's arguments handed out
        self.args_at: int | None = None  # where its arguments begin in `body` (a streaming JSON call)
        self.started = False  # any content or call seen (a start marker opens reasoning only before)
        self.pending_space = ""  # whitespace-only content, held until non-space content settles it
        self.whole_answer = fmt is not None and fmt.start == ""  # llama3_json: the whole answer may be a call
        self.after_reasoning = False  # the reasoning just ended: leading whitespace is not content
        self.space_before = ""  # whitespace held before the current call (content again if it is no call)

    # -- the public side ----------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while self._step(out):
            pass
        return out

    def finish(self, truncated: bool = False) -> list:
        """The end of the answer: what is held back, and a call its end marker never closed. truncated: the answer
        was cut at its token limit, so an open call was never finished: it is content, never a call."""
        out: list = []
        if self.state == "reasoning":
            if self.buf:
                out.append(Text("reasoning", self.buf))
        elif (self.state == "call" or self.whole_answer) and truncated and self.args_at is None:
            self._content(out, self.space_before + (self.fmt.start if self.state == "call" else "") + self.body
                          + self.buf)
        elif self.state == "call" or self.whole_answer:
            self.body += self.buf
            self._close_call(out, at_end=True)
        elif self.buf:
            self._content(out, self.buf)
        self.buf = ""
        if self.pending_space and not self.calls:
            out.append(Text("content", self.pending_space))
        self.pending_space = ""
        return out

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    # -- the states ---------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        """Consume what can be decided of `buf`; True while progress is made."""
        if not self.buf:
            return False
        if self.state == "reasoning":
            end = self.think[1]
            i = self.buf.find(end)
            if i < 0:
                keep = _held(self.buf, [end])
                if len(self.buf) > keep:
                    out.append(Text("reasoning", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                return False
            if i:
                out.append(Text("reasoning", self.buf[:i]))
            self.buf = self.buf[i + len(end) :]
            self.state, self.after_reasoning = "content", True
            return True
        if self.state == "call":
            return self._call_step(out)
        # content
        if not self.started and self.think and self.buf.lstrip().startswith(self.think[0]):
            self.buf = self.buf.lstrip()[len(self.think[0]) :]
            self.state = "reasoning"
            return True
        if self.whole_answer:
            stripped = self.buf.lstrip()
            if not self.started and stripped and stripped[0] in "{<":  # may be a call: decided at the end
                return False
            self.whole_answer = False
        start = self.fmt.start if self.fmt is not None else ""
        i = self.buf.find(start) if start else -1
        if i >= 0:
            if i:
                self._content(out, self.buf[:i])
            self.buf = self.buf[i + len(start) :]
            self._open_call()
            return True
        markers = ([start] if start else []) + ([self.think[0]] if not self.started and self.think else [])
        keep = _held(self.buf, markers)
        if not self.started and self.think and self.think[0].startswith(self.buf.lstrip()):
            keep = len(self.buf)  # may still be the reasoning start marker
        if len(self.buf) > keep:
            self._content(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _content(self, out: list, text: str) -> None:
        """Content text out, its trailing whitespace held: dropped when a call follows, else sent with the
        next content (or at the end of an answer with no calls)."""
        text = self.pending_space + text
        if self.after_reasoning:  # the blank lines between the reasoning and the answer
            text = text.lstrip()
            self.after_reasoning = not text
        body = text.rstrip()
        self.pending_space = text[len(body):]
        if body:
            self.started = True
            out.append(Text("content", body))

    def _open_call(self) -> None:
        self.state, self.body, self.args_sent, self.args_at = "call", "", 0, None
        self.started = True
        self.space_before, self.pending_space = self.pending_space, ""  # whitespace before a call is not content

    def _call_step(self, out: list) -> bool:
        end = self.fmt.end
        i = self.buf.find(end) if end else -1
        if i >= 0:
            self.body += self.buf[:i]
            self.buf = self.buf[i + len(end) :]
            self._close_call(out, closed=True)
            self.state = "content"
            return True
        keep = _held(self.buf, [end]) if end else 0
        self.body += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        if self.fmt.streams_arguments:
            self._stream_arguments(out)
        return False

    def _stream_arguments(self, out: list) -> None:
        """A JSON call: its name once read, then its arguments' text as far as it has come."""
        if self.args_at is None:
            m = _NAME_THEN_ARGS.match(self.body)
            if m is None:
                return
            self.args_at = m.end()
            self.calls.append(call_id())
            out.append(CallStart(len(self.calls) - 1, self.calls[-1], m.group(1)))
        end = json_value_end(self.body, self.args_at)
        upto = end if end is not None else len(self.body)
        text = self.body[self.args_at : upto]
        if self.args_sent == 0:
            text = text.lstrip()
            self.args_at = upto - len(text)
        if len(text) > self.args_sent:
            out.append(CallArgs(len(self.calls) - 1, text[self.args_sent :]))
            self.args_sent = len(text)

    def _close_call(self, out: list, at_end: bool = False, closed: bool = False) -> None:
        """The call's text is complete: its calls, or (not a call) its text as content."""
        body = self.body
        self.body, self.state = "", "content"
        if self.fmt is None:
            self._content(out, body)
            return
        if self.args_at is not None:  # streamed: the rest of its arguments
            self.body = body
            self._stream_arguments(out)
            self.body, self.args_at = "", None
            return
        try:
            calls = self.fmt.parse(body, self.tools)
        except ToolCallError:  # not a call: its text, markers included, is content
            self._content(out, self.space_before + self.fmt.start + body + (self.fmt.end if closed else ""))
            return
        for c in calls:  # the model's own id where it wrote one (its template renders it back), unless repeated
            self.calls.append(c.id if c.id and c.id not in self.calls else call_id())
            out.append(CallStart(len(self.calls) - 1, self.calls[-1], c.name))
            out.append(CallArgs(len(self.calls) - 1, c.arguments))
