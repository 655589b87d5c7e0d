"""An answer's text, as it streams, split the way agents read it: reasoning, content, tool calls.

The splitter takes text deltas (the markers' text included: `<think>`, `<tool_call>`, DeepSeek's
`<｜tool▁calls▁begin｜>`, whether the tokenizer has them as special tokens or not) and returns events:

    Text("reasoning" | "content", text)      CallStart(index, id, name)      CallArgs(index, text)

A marker is matched on the text, so one split over several deltas is found; a tail that may be the start
of a marker is held back until the next delta settles it. Reasoning is what comes before the reasoning end
marker when the answer opens inside it (the prompt opened it, or the answer starts with the start marker);
it never reaches content or the tool-call parser (a format may let a call open inside it: `calls_in_reasoning`).
The whitespace the chat template writes inside the reasoning markers (`<think>\n...\n</think>`) is not reasoning.

A call comes whole (CallStart, then all of its arguments in one CallArgs) once its end marker closes it, in
every format: canitoolcall's spec (and a client's safety) admit no call that the answer never finished, not
even one already streamed, so a call cannot be handed out before it is known to end. A JSON call's end marker
is the first one after its object closes (`</tool_call>` inside a JSON string is text). An answer cut at its
token limit (finish(truncated=True)) drops the call it left open: no call, and not its markup as content.
Content that is only whitespace beside calls is dropped. Text between markers that does not parse as a call
is content.
"""

from __future__ import annotations

from .formats import ToolCallError, ToolFormat, json_value_end, parse_json_call
from .reader import CallArgs, CallStart, Reader, Text, TrimmedReasoning, _held, call_id

__all__ = ["CallArgs", "CallStart", "Splitter", "Text", "_held", "call_id", "reader_for"]


def reader_for(fmt: ToolFormat | None, think: tuple[str, str] | None = None, reasoning: bool = False,
               tools: list | None = None):
    """The stream reader of an answer in this format: the format's own (Harmony's channels, DSML) or the
    marker splitter. Each has feed(text) -> events, finish(truncated) -> events and made_calls."""
    if fmt is not None and fmt.reader is not None:
        return fmt.reader(fmt, think, reasoning, tools)
    return Splitter(fmt, think, reasoning, tools)


class Splitter(TrimmedReasoning, Reader):
    calls_in_reasoning = False  # a call opener inside the reasoning opens a call (and ends the reasoning)

    def __init__(self, fmt: ToolFormat | None, think: tuple[str, str] | None = None, reasoning: bool = False,
                 tools: list | None = None):
        """fmt: the model's tool-call format (None: no tools offered, nothing is parsed as a call); think: the
        reasoning (start, end) markers, or None; reasoning: the answer opens inside the reasoning."""
        super().__init__()
        self.fmt, self.tools = fmt, tools or []
        self.think = think if think and think[0] and think[1] else None
        self.state = "reasoning" if reasoning and self.think else "content"
        self.body = ""  # the current call's text so far
        self.opener = ""  # the marker text that opened the current call ("" where the call's own text opens it)
        self.in_reasoning = False  # the current call opened inside the reasoning
        self.scan_at = 0  # where the next search for the current call's end marker starts in `body`
        self.reasoning_sent = False  # any reasoning text handed out
        self.reasoning_space = ""  # whitespace at the reasoning's end so far, held until more reasoning follows
        self.started = False  # any content or call seen (a start marker opens reasoning only before)
        self.whole_answer = fmt is not None and fmt.start == ""  # llama3_json: the whole answer may be a call
        self.after_reasoning = False  # the reasoning just ended: leading whitespace is not content
        self.space_before = ""  # whitespace held before the current call (content again if it is no call)

    # -- the public side (feed, made_calls: Reader's) --------------------------------------------------
    def _finish(self, out: list, truncated: bool) -> None:
        """The end of the answer: what is held back, and a call its end marker never closed. truncated: the answer
        was cut at its token limit, so an open call was never finished: it is content, never a call."""
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "call" and truncated and self.opener:
            pass  # a call the answer never finished: no call, and its markup is not content either
        elif (self.state == "call" or self.whole_answer) and truncated:
            self._content(out, self.space_before + self.body + self.buf)
        elif self.state == "call" or self.whole_answer:
            self.body += self.buf
            self._close_call(out, at_end=True)
        elif self.buf:
            self._content(out, self.buf)

    # -- the states ---------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        """Consume what can be decided of `buf`; True while progress is made."""
        if self.state == "reasoning":
            end = self.think[1]
            i = self.buf.find(end)
            if self.calls_in_reasoning and self.fmt is not None and self.fmt.start:
                j = self.buf.find(self.fmt.start, 0, i if i >= 0 else len(self.buf))
                if j >= 0:
                    self._reasoning(out, self.buf[:j])
                    self.buf = self.buf[j + len(self.fmt.start) :]
                    self._open_call(self.fmt.start, in_reasoning=True)
                    return True
            if not self._reasoning_to(out, end, [self.fmt.start] if self.calls_in_reasoning and self.fmt else []):
                return False
            self.reasoning_space = ""  # (the template's newline before the end marker)
            self.state, self.after_reasoning = "content", True
            return True
        if self.state == "call":
            return self._call_step(out)
        # content
        if not self.started and self.think and self._enters_reasoning(self.think[0]):
            return True
        if self.whole_answer:
            stripped = self.buf.lstrip()
            if not self.started and stripped and stripped[0] in "{<":  # may be a call: decided at the end
                return False
            self.whole_answer = False
        found = self._find_start(self.buf) if self.fmt is not None else None
        if found is not None:
            i, j = found
            if i:
                self._content(out, self.buf[:i])
            opener, self.buf = self.buf[i:j], self.buf[j:]
            self._open_call(opener)
            return True
        markers = [self.think[0]] if not self.started and self.think else []
        keep = max(_held(self.buf, markers), self._start_held(self.buf) if self.fmt is not None else 0)
        if not self.started and self.think and self.think[0].startswith(self.buf.lstrip()):
            keep = len(self.buf)  # may still be the reasoning start marker
        self._content_to(out, keep)
        return False

    def _content(self, out: list, text: str) -> None:
        """Content text out, its trailing whitespace held: dropped when a call follows, else sent with the
        next content (or at the end of an answer with no calls)."""
        text = self.space + text
        if self.after_reasoning:  # the blank lines between the reasoning and the answer
            text = text.lstrip()
            self.after_reasoning = not text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            self.started = True
            out.append(Text("content", body))

    # -- where calls open and close (a format's reader overrides these) ------------------------------
    def _find_start(self, text: str) -> tuple[int, int] | None:
        """(where a call opens in `text`, where its body begins), or None: the format's start marker."""
        start = self.fmt.start
        i = text.find(start) if start else -1
        return (i, i + len(start)) if i >= 0 else None

    def _start_held(self, text: str) -> int:
        """Length of the tail of `text` that may still become a call's opening."""
        return _held(text, [self.fmt.start]) if self.fmt.start else 0

    def _call_end(self, text: str) -> int | None:
        """Where the end marker that closes the call `text` (what follows its opener) begins, or None while the
        text so far does not hold it. A JSON body's end marker is the first one after its object closes."""
        end = self.fmt.end
        if not end:
            return None
        i = text.find(end, self.scan_at)
        while i >= 0:
            if self.fmt.parse is not parse_json_call or _json_closed(text, i):
                return i
            i = text.find(end, i + 1)
        self.scan_at = max(self.scan_at, len(text) - len(end) + 1)
        return None

    def _open_call(self, opener: str = "", in_reasoning: bool = False) -> None:
        self.state, self.body, self.opener, self.in_reasoning, self.scan_at = "call", "", opener, in_reasoning, 0
        self.started = True
        self.space_before, self.space = self.space, ""  # whitespace before a call is not content

    def _call_step(self, out: list) -> bool:
        text = self.body + self.buf
        i = self._call_end(text)
        if i is None:
            self.body, self.buf = text, ""
            return False
        self.body, self.buf = text[:i], text[i + len(self.fmt.end) :]
        self._close_call(out, closed=True)
        return True

    def _not_a_call(self, out: list, text: str) -> None:
        """A call's text that did not parse: content again (reasoning again where the call opened in it)."""
        if self.in_reasoning:
            self.state = "reasoning"
            self._reasoning(out, text)
        else:
            self._content(out, text)

    def _close_call(self, out: list, at_end: bool = False, closed: bool = False) -> None:
        """The call's text is complete: its calls, or (not a call) its text as content."""
        body = self.body
        self.body, self.state = "", "content"
        if self.fmt is None:
            self._content(out, body)
            return
        try:
            calls = self.fmt.parse(body, self.tools)
        except ToolCallError:  # not a call: its text, markers included, is content
            self._not_a_call(out, ("" if self.in_reasoning else self.space_before) + self.opener + body
                             + (self.fmt.end if closed else ""))
            return
        if self.in_reasoning:  # a call inside the reasoning ended it
            self.after_reasoning, self.in_reasoning = True, False
        for c in calls:
            self._call(out, c.name, c.arguments, c.id)


def _json_closed(text: str, at: int) -> bool:
    """Whether the call body `text[:at]` is done as far as JSON can tell: it is no JSON object (any end marker
    ends it), or its object closes before `at` (an end marker inside one of its strings is text)."""
    head = text[:at]
    i = len(head) - len(head.lstrip())
    return i == len(head) or head[i] != "{" or json_value_end(head, i) is not None
