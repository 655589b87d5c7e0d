"""A stream reader for formats whose calls open at a marker and close where the call's own syntax says
(Mistral's: the JSON value after `[ARGS]`, no end marker; Gemma 4's: `<tool_call|>` outside a `<|"|>` string),
with reasoning between start and end markers (`[THINK]...[/THINK]`, `<|channel>thought\\n...<channel|>`).

What a client gets (the rules of canitoolcall's spec, fixtures/spec/README.md, "Expected results"):
- content: the text around calls as written, the pieces before, between and after calls concatenated with
  nothing inserted or removed; only an answer whose content is nothing but whitespace beside its calls gets
  none, and the whitespace right after the reasoning is not content;
- reasoning: the text of each reasoning block, without the whitespace at its two ends (nor a channel's name);
- calls: each one whole once its text closes, never while it is open: a marker inside a string of the
  arguments is the argument's text. An answer cut at its token limit (finish(truncated=True)) returns no call
  it had not closed; an unclosed call at the end of a finished answer is content, and so is text after the
  opener that cannot be a call (the format's scanner says so as early as it can, then it is read as content).

A format gives its opener, its reasoning marks, a scanner per call (`scanner()`: advance(text) -> (MORE | CALL
| NOT, where the call's text ends)) and `parse(text) -> [Call]` (ToolCallError: the text is content).
"""

from __future__ import annotations

from .formats import Call, ToolCallError, ToolFormat
from .reader import Reader, TrimmedReasoning, _held

MORE, CALL, NOT = "more", "call", "not"  # what a call scanner says of the text after the opener


class ReasoningMark:
    """One reasoning block's markers: `head` is a channel name dropped right after `start` (Gemma 4's
    `thought`); `anywhere`: `start` opens reasoning after content too (a control token, never text)."""

    def __init__(self, start: str, end: str, head: str = "", anywhere: bool = False):
        self.start, self.end, self.head, self.anywhere = start, end, head, anywhere


class MarkedReader(TrimmedReasoning, Reader):
    opener: str = ""
    marks: tuple[ReasoningMark, ...] = ()

    def scanner(self):  # a fresh scanner of one call's text (the text after the opener)
        raise NotImplementedError

    def parse(self, text: str) -> list[Call]:  # one call's text (as the scanner delimited it) -> its calls
        raise NotImplementedError

    def __init__(self, fmt: ToolFormat, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        """think: the reasoning markers mlx-lm infers (used where the format's own do not cover them);
        reasoning: the prompt left the answer inside a reasoning block."""
        super().__init__()
        self.fmt, self.tools = fmt, tools or []
        marks = list(self.marks)
        if think and think[0] and think[1] and not any(
                m.start.startswith(think[0]) or think[0].startswith(m.start) for m in marks):
            marks.append(ReasoningMark(think[0], think[1]))
        self.all_marks = marks  # (state: "content" | "reasoning" | "call")
        self.mark: ReasoningMark | None = None  # the open reasoning block's
        self.head = ""  # a channel name still to drop at the start of the block
        if reasoning and marks:
            end = think[1] if think and think[1] else marks[0].end
            self._open_reasoning(next((m for m in marks if m.end == end), marks[0]), head=False)
        self.scan = None
        self.reasoning_sent = False  # this block's text began (its leading whitespace dropped)
        self.reasoning_space = ""  # the block's trailing whitespace so far (dropped at its end)

    # -- the public side (feed, made_calls: Reader's) --------------------------------------------------
    def _finish(self, out: list, truncated: bool) -> None:
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "call":
            if not truncated and self.buf.strip():  # a finished answer's unclosed call: its text is content
                self._content(out, self.opener + self.buf)
        elif self.buf:
            self._content(out, self.buf)

    # -- the states ---------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        if self.state == "reasoning":
            return self._reasoning_step(out)
        if self.state == "call":
            return self._call_step(out)
        return self._content_step(out)

    def _content_step(self, out: list) -> bool:
        fresh = not self.content_seen and not self.calls
        opens = [(self.opener, None)] + [(m.start, m) for m in self.all_marks if m.anywhere or fresh]
        found = [(self.buf.find(text), text, m) for text, m in opens if text]
        found = [f for f in found if f[0] >= 0]
        if not found:
            keep = _held(self.buf, [t for t, _ in opens])
            self._content_to(out, keep)
            return False
        at, text, mark = min(found, key=lambda f: (f[0], -len(f[1])))
        if at:
            self._content(out, self.buf[:at])
        self.buf = self.buf[at + len(text) :]
        if mark is None:
            self.state, self.scan = "call", self.scanner()
        else:
            self._open_reasoning(mark)
        return True

    def _open_reasoning(self, mark: ReasoningMark, head: bool = True) -> None:
        self.state, self.mark, self.head = "reasoning", mark, mark.head if head else ""
        self.reasoning_sent, self.reasoning_space = False, ""

    def _reasoning_step(self, out: list) -> bool:
        if self.head:
            if self.buf.startswith(self.head):
                self.buf, self.head = self.buf[len(self.head) :], ""
            elif self.head.startswith(self.buf):
                return False  # may still be the channel's name
            else:
                self.head = ""
        if not self._reasoning_to(out, self.mark.end):
            return False
        self.state, self.mark, self.drop_lead = "content", None, True
        return True

    def _call_step(self, out: list) -> bool:
        kind, n = self.scan.advance(self.buf)
        if kind == MORE:
            return False
        self.state, self.scan = "content", None
        if kind == NOT:  # the opener begins no call: it is content, and what follows is read as content
            self._content(out, self.opener)
            return True
        text, self.buf = self.buf[:n], self.buf[n:]
        try:
            calls = self.parse(text)
        except ToolCallError:
            self._content(out, self.opener + text)
            return True
        for c in calls:
            self._call(out, c.name, c.arguments, c.id)
        return True
