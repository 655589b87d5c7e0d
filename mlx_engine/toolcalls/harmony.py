"""gpt-oss's Harmony response format, read from the answer's text as it streams.

An answer (after the generation prompt `<|start|>assistant`) is a run of messages, each a header, `<|message|>`,
a body and an end marker, the next one opened by `<|start|>` and its role (openai/harmony docs/format.md, the
gpt-oss chat template):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary<|message|>PREAMBLE<|end|>
    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The recipient `to=functions.NAME` may stand in the role part of the header (the template's form) or after the
channel (what the model generates); either makes the message a call of NAME, on whatever channel, its body the
arguments' JSON. Without a recipient: analysis -> reasoning, commentary (a preamble) and final -> content.
A recipient outside `functions.` (the built-in `python`, `browser.search`) is a tool the server does not run:
its message is dropped, as is a message on a channel Harmony does not have or a header that never reaches
`<|message|>` (garbled or cut short). The content type (`<|constrain|>json`, a bare `json`) is not needed.

The tokenizer holds every marker as a special token (o200k_harmony); the server keeps them in the text
(HARMONY.markers). A call's body ends at `<|call|>` / `<|end|>` / `<|return|>` outside its JSON strings, so
marker text inside an argument stays in it; a text body ends at `<|end|>`, and `<|call|>` / `<|return|>` (the
stop tokens, always last) end it only at the end of the answer. A call is given whole when its message ends:
an answer cut at its token limit inside a call returns no call (openai-harmony's StreamableParser reads the
same messages from the tokens; this reader works on the text the server's TextStream makes).
"""

from __future__ import annotations

import json
import re

from .formats import Call, ToolCallError, ToolFormat
from .reader import Reader, Text, _held

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
FUNCTIONS = "functions."
TEXT_CHANNELS = {"analysis": "reasoning", "commentary": "content", "final": "content"}

_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")


def read_header(header: str) -> tuple[str | None, str | None]:
    """(the recipient, the channel) a message header names (None where absent); the last channel wins."""
    recipient = _RECIPIENT.search(header)
    channels = _CHANNEL.findall(header)
    return (recipient.group(1) if recipient else None), (channels[-1] if channels else None)


class _JsonScan:
    """Where a marker first stands outside the JSON strings of a body that grows (resumed where it stopped)."""

    def __init__(self):
        self.at, self.in_string, self.escaped = 0, False, False

    def find(self, body: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
        while self.at < len(body):
            c = body[self.at]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c == "<":
                for m in markers:
                    if body.startswith(m, self.at):
                        return self.at, m
                if any(m.startswith(body[self.at:]) for m in markers):
                    return None  # maybe a marker: decided when more text comes
            self.at += 1
        return None


def parse_harmony_call(body: str, tools=None) -> list[Call]:
    """A call message's body (the arguments' JSON object), as written."""
    text = body.strip()
    try:
        args = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"harmony: call arguments that are not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolCallError("harmony: call arguments that are not a JSON object")
    return [Call("", text)]


class HarmonyReader(Reader):
    """Splits a Harmony answer into reasoning, content and calls (feed / finish / made_calls, as Splitter)."""

    def __init__(self, fmt: ToolFormat | None = None, think=None, reasoning: bool = False, tools: list | None = None):
        super().__init__()
        self.tools = tools or []
        self.state = "header"  # header | text | call | drop
        self.kind = ""  # a text message's: "reasoning" | "content"
        self.name = ""  # a call message's function
        self.scan = _JsonScan()  # the current call body's JSON, read so far

    def finish(self, truncated: bool = False) -> list:
        """The answer ended: a text message's rest (its stop token dropped); a call whose message the stop token
        closed (truncated: cut at the token limit, so the call was never finished: no call)."""
        out: list = []
        rest = self.buf
        if not truncated:
            for stop in (CALL, RETURN):
                rest = rest[: -len(stop)] if rest.endswith(stop) else rest
        if self.state == "text" and rest:
            out.append(Text(self.kind, rest))
        elif self.state == "call" and not truncated:
            self._close_call(out, rest)
        self.buf, self.state, self.scan = "", "header", _JsonScan()
        return out

    # -- the states ---------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        if self.state == "header":
            return self._header_step()
        if self.state == "call":
            return self._call_step(out)
        return self._text_step(out)

    def _header_step(self) -> bool:
        """A header runs to `<|message|>`; one that meets an end marker or a new `<|start|>` first is dropped."""
        found = [(i, m) for m in (MESSAGE, START, END, CALL, RETURN) if (i := self.buf.find(m)) >= 0]
        if not found:
            return False
        i, m = min(found)
        header, self.buf = self.buf[:i], self.buf[i + len(m):]
        if m != MESSAGE:
            return True  # (a garbled or unfinished header: the next message's header starts)
        recipient, channel = read_header(header)
        if recipient is not None:
            self.state, self.name = ("call", recipient[len(FUNCTIONS):]) if recipient.startswith(FUNCTIONS) \
                else ("drop", "")  # a built-in tool's message
        elif channel is None or channel in TEXT_CHANNELS:
            self.state, self.kind = "text", TEXT_CHANNELS.get(channel, "content")
        else:
            self.state = "drop"  # a channel Harmony does not have
        return True

    def _text_step(self, out: list) -> bool:
        """A text message (or a dropped one) to its `<|end|>`; a stop token's text counts only at the very end."""
        i = self.buf.find(END)
        if i >= 0:
            if i and self.state == "text":
                out.append(Text(self.kind, self.buf[:i]))
            self.buf, self.state = self.buf[i + len(END):], "header"
            return True
        keep = max([_held(self.buf, [END, CALL, RETURN])] + [len(s) for s in (CALL, RETURN) if self.buf.endswith(s)])
        if len(self.buf) > keep:
            if self.state == "text":
                out.append(Text(self.kind, self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _call_step(self, out: list) -> bool:
        """A call's body to its end marker outside its JSON strings."""
        ends = (CALL, END, RETURN)
        if self.buf.lstrip()[:1] in ("{", "["):
            hit = self.scan.find(self.buf, ends)
        else:
            hits = [(i, m) for m in ends if (i := self.buf.find(m)) >= 0]
            hit = min(hits) if hits else None
        if hit is None:
            return False
        i, m = hit
        body, self.buf, self.scan = self.buf[:i], self.buf[i + len(m):], _JsonScan()
        self._close_call(out, body)
        self.state = "header"
        return True

    def _close_call(self, out: list, body: str) -> None:
        """A finished call message: the call, or (arguments that are not a JSON object) nothing."""
        try:
            call = parse_harmony_call(body, self.tools)[0]
        except ToolCallError:
            return
        if not self.name:
            return
        self._call(out, self.name, call.arguments)


def harmony_reader(fmt: ToolFormat, think=None, reasoning: bool = False, tools: list | None = None) -> HarmonyReader:
    return HarmonyReader(fmt, think, reasoning, tools)


HARMONY = ToolFormat("harmony", "", "", True, parse_harmony_call,
                     markers=(START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN), reader=harmony_reader)
