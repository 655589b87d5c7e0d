"""Mistral's tool calls, as the mistral-common tokenizer versions write them (mistral_common/tokens/
tokenizers/instruct.py, the encoders of an assistant message's tool calls; vLLM's and llama.cpp's Mistral
parsers read the same):

- v3 (Mistral-7B-Instruct-v0.3): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, one JSON list;
- v11 (Mistral-Small-3.2, Devstral): `[TOOL_CALLS]NAME[ARGS]{...}` per call, a history's call with
  `[CALL_ID]ID` between the name and `[ARGS]`;
- v13 (Magistral, Ministral 3, Devstral 2): the same compact form, reasoning in `[THINK]...[/THINK]` (control
  tokens; Magistral-Small-2506 wrote `<think>...</think>` as text at the start of its answer).

No marker ends a call: it ends where its JSON does, and the answer may go on with the next `[TOOL_CALLS]`.
mlx-lm's parser (mlx_lm/tool_parsers/mistral.py) takes `[CALL_ID]`'s id for the tool's name and leaves the
reasoning in the content (mlx-lm infers no think markers for Mistral's vocabulary): this reader reads the id
as the call's id and splits `[THINK]` reasoning itself.
"""

from __future__ import annotations

import json

import regex

from .formats import Call, ToolCallError, ToolFormat
from .marked_reader import CALL, MORE, NOT, MarkedReader, ReasoningMark

CALLS, ARGS, CALL_ID, THINK, THINK_END = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"
# NAME[ARGS] or NAME[CALL_ID]ID[ARGS], then the arguments' JSON object
_HEADER = regex.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([^\[\]\s]*))?\[ARGS\]\s*")


class JsonEnd:
    """Where a JSON object or list starting at `at` ends, found as the text grows (strings and escapes read,
    so a bracket or a marker inside a string is text)."""

    def __init__(self, at: int):
        self.pos, self.depth, self.in_string, self.escaped = at, 0, False, False

    def advance(self, text: str) -> int | None:
        for j in range(self.pos, len(text)):
            c = text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = j + 1
                    return j + 1
        self.pos = len(text)
        return None


class CallScan:
    """One call's text after `[TOOL_CALLS]`: the v3 list, or NAME([CALL_ID]ID)?[ARGS] and its object."""

    def __init__(self):
        self.json: JsonEnd | None = None

    def advance(self, text: str) -> tuple[str, int]:
        if self.json is None:
            body = text.lstrip()
            if not body:
                return MORE, 0
            if body[0] == "[":  # v3's list
                self.json = JsonEnd(len(text) - len(body))
            else:
                m = _HEADER.match(text, partial=True)
                if m is None:
                    return NOT, 0
                if m.partial or m.end() == len(text):
                    return MORE, 0
                if text[m.end()] != "{":  # the arguments are an object
                    return NOT, 0
                self.json = JsonEnd(m.end())
        end = self.json.advance(text)
        return (MORE, 0) if end is None else (CALL, end)


def _object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"mistral: arguments that are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ToolCallError("mistral: arguments that are not a JSON object")
    return value


def _listed(text: str) -> list[Call]:
    """v3's `[{"name": ..., "arguments": {...} or its JSON text, "id"?: ...}, ...]`."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"mistral: a call list that is not JSON: {e}") from None
    if not isinstance(items, list) or not items:
        raise ToolCallError("mistral: a call list that is not a list of calls")
    calls = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        args = item.get("arguments", {}) if isinstance(item, dict) else None
        args = _object(args) if isinstance(args, str) else args
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ToolCallError("mistral: a listed call without a name or an arguments object")
        calls.append(Call(name, json.dumps(args, ensure_ascii=False),
                          item["id"] if isinstance(item.get("id"), str) else None))
    return calls


def parse_call(text: str) -> list[Call]:
    """One call's text as CallScan delimits it (after `[TOOL_CALLS]`) -> its calls (v3: the list's)."""
    body = text.strip()
    if body.startswith("["):
        return _listed(body)
    m = _HEADER.match(text)
    if m is None:
        raise ToolCallError("mistral: no NAME[ARGS] before the arguments")
    args = text[m.end() :].strip()
    _object(args)
    return [Call(m.group(1), args, m.group(2) or None)]


def parse_mistral(body: str, tools=None) -> list[Call]:
    """Everything after the first `[TOOL_CALLS]` (toolcalls.stream.Splitter's view of a call with no end
    marker): each call in turn, `[TOOL_CALLS]` between them."""
    calls, rest = [], body
    while rest.strip():
        scan = CallScan()
        kind, n = scan.advance(rest)
        if kind != CALL:
            raise ToolCallError("mistral: text after [TOOL_CALLS] that is not a whole call")
        calls += parse_call(rest[:n])
        rest = rest[n:].lstrip()
        if rest and not rest.startswith(CALLS):
            raise ToolCallError("mistral: text after a call")
        rest = rest[len(CALLS) :] if rest else rest
    if not calls:
        raise ToolCallError("mistral: [TOOL_CALLS] without a call")
    return calls


class MistralReader(MarkedReader):
    opener = CALLS
    marks = (ReasoningMark(THINK, THINK_END, anywhere=True), ReasoningMark("<think>", "</think>"))

    def scanner(self) -> CallScan:
        return CallScan()

    def parse(self, text: str) -> list[Call]:
        return parse_call(text)


MISTRAL = ToolFormat("mistral", CALLS, "", True, parse_mistral,
                     markers=(ARGS, CALL_ID, THINK, THINK_END, "<think>", "</think>"), reader=MistralReader)
