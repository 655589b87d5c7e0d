"""Llama 3.x and Llama 4 tool calls: the call is the end of the answer, in one of two syntaxes.

- Llama 3.1 / 3.2 / 3.3 (meta-llama/Llama-3.3-70B-Instruct's chat template, JSON tool calling; vLLM's
  llama3_json parser): `{"name": NAME, "parameters": {...}}` (or "arguments"), the whole answer, or after
  `<|python_tag|>` with text before it; several calls `; `-separated (formats.parse_llama3).
- Llama 4 (vLLM's llama4_pythonic parser and its tool_chat_template_llama4_pythonic.jinja; Meta's Llama 4
  prompt format): `[NAME(key=VALUE, ...), NAME(...)]`, the whole answer, optionally between `<|python_start|>`
  and `<|python_end|>`. Read with Python's `ast` (never evaluated): keyword arguments of literals only, JSON's
  true / false / null taken as Python's (what a grammar or a JSON-minded model writes).

`EndCallReader` streams the text before a call as content and holds back what may be a call (an answer that
begins like one, or everything after the opening tag) until the answer ends: text that does not parse as calls
is content, a call cut by max_tokens is never returned.
"""

from __future__ import annotations

import ast
import json

from .formats import PYTHON_TAG, Call, ToolCallError, ToolFormat, parse_llama3
from .reader import Reader, _held

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# Llama 3's header tokens: text of a JSON string value when a call writes them (kept through the text stream)
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr):
    """A Python literal (JSON's true / false / null as names too); anything else is no argument."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ToolCallError("pythonic: a ** in a dict argument")
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ToolCallError(f"pythonic: an argument that is no literal: {ast.dump(node)[:60]}") from None
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise ToolCallError(f"pythonic: an argument JSON cannot hold: {value!r:.60}")
    return value


def _key(node: ast.expr) -> str:
    key = _literal(node)
    if not isinstance(key, str):
        raise ToolCallError("pythonic: a dict key that is not a string")
    return key


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    raise ToolCallError("pythonic: a call of something that is no name")


def parse_pythonic(text: str, tools=None) -> list[Call]:
    """`[f(a=1, b='x'), g()]` -> its calls, the arguments as JSON in the order written."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ToolCallError(f"pythonic: not a list of calls: {e}") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ToolCallError("pythonic: not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ToolCallError("pythonic: a call must take keyword arguments only")
        args = {k.arg: _literal(k.value) for k in node.keywords}
        calls.append(Call(_name(node.func), json.dumps(args, ensure_ascii=False)))
    return calls


class EndCallReader(Reader):
    """An answer whose calls, if any, are its end: reader(fmt, think, reasoning, tools)'s object (feed, finish,
    made_calls). lead: the characters that make a whole answer a call candidate; tag / close: the text that opens
    (closes) a call block after other text; parse: that block -> its calls."""

    def __init__(self, fmt, think, reasoning, tools, lead: str, tag: str, close: str, parse):
        super().__init__()
        self.fmt, self.tools = fmt, list(tools or [])
        self.lead, self.tag, self.close, self.parse = lead, tag, close, parse
        self.think = think if think and think[0] and think[1] else None
        self.state = "reasoning" if reasoning and self.think else "start"  # start | content | call | after
        self.body = ""  # the call block's text (after `tag`, or the whole answer)
        self.tagged = False  # the block opened with `tag`

    def _step(self, out: list) -> bool:
        if self.state == "reasoning":
            if not self._reasoning_to(out, self.think[1]):
                return False
            self.buf, self.state = self.buf.lstrip(), "start"
            return True
        if self.state == "start":  # nothing of the answer decided: may it be a call, or the reasoning?
            head = self.buf.lstrip()
            if not head:
                return False
            if self.think and self._enters_reasoning(self.think[0]):
                return True
            if self.think and self.think[0].startswith(head):
                return False
            if head[0] in self.lead:  # the whole answer may be the call: decided at its end
                self.body, self.buf, self.state = head, "", "call"
                return False
            self.state = "content"
            return True
        if self.state == "content":
            i = self.buf.find(self.tag)
            if i >= 0:
                self._content(out, self.buf[:i])
                self.buf, self.state, self.tagged = self.buf[i + len(self.tag):], "call", True
                return True
            keep = _held(self.buf, [self.tag])
            self._content_to(out, keep)
            return False
        if self.state == "call":
            self.body += self.buf
            self.buf = ""
            return False
        self._content(out, self.buf)  # after the block's closing tag
        self.buf = ""
        return False

    def _finish(self, out: list, truncated: bool) -> None:
        """The answer's end: the held block parsed into calls (never when cut at max_tokens: then it is
        content), or, not calls, its text as content."""
        if self.state == "reasoning":
            self._reasoning(out, self.buf)
        elif self.state == "call":
            block = self.body + self.buf
            written = (self.tag if self.tagged else "") + block
            if self.close and self.close in block:
                block, rest = block.split(self.close, 1)
            else:
                rest = ""
            calls = None
            if not truncated:
                try:
                    calls = self.parse(block, self.tools)
                except ToolCallError:
                    calls = None
            if calls:
                for c in calls:
                    self._call(out, c.name, c.arguments)
                self._content(out, rest.strip())
            else:
                self._content(out, written)
        elif self.state != "start" or self.buf.strip():
            self._content(out, self.buf)


def llama3_reader(fmt, think=None, reasoning=False, tools=None) -> EndCallReader:
    return EndCallReader(fmt, think, reasoning, tools, lead="{", tag=PYTHON_TAG, close="", parse=parse_llama3)


def llama4_reader(fmt, think=None, reasoning=False, tools=None) -> EndCallReader:
    return EndCallReader(fmt, think, reasoning, tools, lead="[", tag=PYTHON_START, close=PYTHON_END,
                         parse=parse_pythonic)


# the header tokens are text a call's JSON string may hold (kept through the text stream where special)
LLAMA3 = ToolFormat("llama3_json", "", "", True, parse_llama3, markers=("<|start_header_id|>", "<|end_header_id|>"),
                    reader=llama3_reader)
LLAMA4 = ToolFormat("llama4_pythonic", "", "", True, parse_pythonic, markers=(PYTHON_START, PYTHON_END),
                    reader=llama4_reader)
