"""What every tool-call stream reader shares: the events it hands out, feeding text through its states, the
calls it made, the reasoning up to its end marker, the content's held whitespace, a call handed out whole.

A reader (stream.Splitter, and each format's own: dsml, harmony, kimi_k2, kimi_k3, llama, marked_reader, ...)
takes text deltas with feed(text) -> events and ends with finish(truncated) -> events; made_calls says whether
any call came out. Its events:

    Text("reasoning" | "content", text)      CallStart(index, id, name)      CallArgs(index, text)

A subclass keeps its own states (`_step(out)`: consume what can be decided of `buf`, True while progress is
made) and its own finish(); what a format decides differently (a reasoning block's whitespace, the content's
trailing whitespace beside calls) it overrides.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


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


def _held(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    hold = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), hold, -1):
            if text.endswith(m[:n]):
                hold = n
                break
    return hold


class Reader:
    def __init__(self):
        self.buf = ""  # text not yet decided
        self.state = "content"
        self.calls: list[str] = []  # ids of the calls handed out
        self.space = ""  # whitespace-only content, held until content or the end settles it
        self.content_seen = False  # content other than whitespace handed out
        self.drop_lead = False  # the next content's leading whitespace is not content (after the reasoning)

    # -- the public side ----------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        self._run(out)
        return out

    def finish(self, truncated: bool = False) -> list:
        """The end of the answer (truncated: cut at its token limit): what the open state still holds (`_finish`),
        then the whitespace held before any content, which is content only in an answer without calls."""
        out: list = []
        self._finish(out, truncated)
        self.buf = ""
        if self.space and not self.calls:
            out.append(Text("content", self.space))
        self.space = ""
        return out

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def _run(self, out: list) -> None:
        while self.buf and self._step(out):
            pass

    def _step(self, out: list) -> bool:
        raise NotImplementedError

    def _finish(self, out: list, truncated: bool) -> None:
        raise NotImplementedError

    # -- calls --------------------------------------------------------------------------------------
    def _call(self, out: list, name: str, arguments: str, own_id: str | None = None) -> None:
        """One call out whole: the model's own id where it wrote one (its template renders it back), unless
        repeated, else a fresh one."""
        self.calls.append(own_id if own_id and own_id not in self.calls else call_id())
        out.append(CallStart(len(self.calls) - 1, self.calls[-1], name))
        out.append(CallArgs(len(self.calls) - 1, arguments))

    # -- reasoning ----------------------------------------------------------------------------------
    def _enters_reasoning(self, start: str) -> bool:
        """The answer so far (past its whitespace) opens with the reasoning start marker: `buf` moves past it."""
        head = self.buf.lstrip()
        if not head.startswith(start):
            return False
        self.buf, self.state = head[len(start) :], "reasoning"
        return True

    def _reasoning_to(self, out: list, end: str, held=()) -> bool:
        """Reasoning text up to the marker `end`: True when `end` came (`buf` is then what follows it), else
        False with `buf` the tail that may still become `end` (or one of `held`)."""
        i = self.buf.find(end)
        if i < 0:
            keep = _held(self.buf, [end, *held])
            self._reasoning(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._reasoning(out, self.buf[:i])
        self.buf = self.buf[i + len(end) :]
        return True

    def _reasoning(self, out: list, text: str) -> None:
        if text:
            out.append(Text("reasoning", text))

    # -- content ------------------------------------------------------------------------------------
    def _content_to(self, out: list, keep: int) -> None:
        """`buf` out as content but its last `keep` characters, the tail that may still become a marker."""
        if len(self.buf) > keep:
            self._content(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]

    def _content(self, out: list, text: str) -> None:
        """Content as written; whitespace before any content waits (sent with the first content, dropped beside
        calls: finish), and the leading whitespace after the reasoning is not content."""
        if self.drop_lead:
            text = text.lstrip()
            if not text:
                return
            self.drop_lead = False
        if self.content_seen:
            if text:
                out.append(Text("content", text))
            return
        self.space += text
        if self.space.strip():
            out.append(Text("content", self.space))
            self.space, self.content_seen = "", True


class TrimmedReasoning:
    """A reader's reasoning without the whitespace the template writes inside its markers (`<think>\n...\n</think>`):
    leading whitespace before any of the block's text and trailing whitespace are held, sent only when more
    reasoning follows them. The reader sets reasoning_sent / reasoning_space (False, "") where a block opens."""

    reasoning_sent: bool  # any of the block's reasoning text handed out
    reasoning_space: str  # whitespace at the block's end so far, held until more reasoning follows

    def _reasoning(self, out: list, text: str) -> None:
        text = self.reasoning_space + text
        if not self.reasoning_sent:
            text = text.lstrip()
        body = text.rstrip()
        self.reasoning_space = text[len(body):]
        if body:
            self.reasoning_sent = True
            out.append(Text("reasoning", body))
