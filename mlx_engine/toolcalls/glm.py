"""GLM-4.5 / 4.6 / 4.7 / 5.x tool calls, read exactly as the models write them.

The format (zai-org/GLM-4.5's and GLM-4.7's chat_template.jinja; vLLM's glm4_moe / glm47 parsers):

    <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>     (4.5 / 4.6)
    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>           (4.7, 5.x)

A string value is written raw (the template writes `v` itself, no escaping), every other value as JSON
(`v | tojson`): so a value is JSON-decoded unless its parameter's schema says it is a string, and a string value
keeps every character, its whitespace included (mlx-lm's glm47 parser strips it, and cuts a value at a
`</tool_call>` written inside it: the splitter's end marker).

What this module reads that mlx-lm's does not:
- `</tool_call>` inside an `<arg_value>` is text of the value unless the answer ends after it or another
  `<tool_call>` follows (a value whose `</arg_value>` the model left out, closed by the call's end);
- a value runs to the first `</arg_value>` that the next `<arg_key>` or the call's end follows, so
  `</arg_value>` inside a value stays in it; a last value without its `</arg_value>` ends at the call's end;
- a call cut by max_tokens is never a call (stream.Splitter's truncated finish: its text is content).
"""

from __future__ import annotations

import json
import re

from .formats import Call, ToolCallError, ToolFormat, _refs_resolved
from .stream import Splitter

START, END = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_KEY_THEN_VALUE = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.DOTALL)
_VALUE_END = re.compile(r"</arg_value>(?=\s*(?:<arg_key>|$))")


def call_end(text: str, final: bool) -> int | None:
    """Where the `</tool_call>` that closes the call `text` opens (text: what follows `<tool_call>`), or None
    while the text so far cannot say. final: the answer ends after `text`."""
    pos = 0
    while True:
        value = text.find(VALUE_OPEN, pos)
        end = text.find(END, pos)
        if end >= 0 and (value < 0 or end < value):
            return end
        if value < 0:
            return None
        inside = value + len(VALUE_OPEN)
        close = text.find(VALUE_CLOSE, inside)
        at = inside
        while True:  # each `</tool_call>` in the value before its `</arg_value>`: the call's end, or text?
            end = text.find(END, at)
            if end < 0 or (close >= 0 and end > close):
                break
            after = text[end + len(END):].lstrip()
            if after.startswith(START) or (not after and final):
                return end
            if not after or START.startswith(after):  # the next characters decide
                return None
            at = end + len(END)
        if close < 0:
            return None
        pos = close + len(VALUE_CLOSE)


def _types(schema) -> set[str]:
    """The JSON types a parameter's schema allows (its type, an enum's values', anyOf / oneOf members')."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    if "enum" in schema and isinstance(schema["enum"], list):
        out |= {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            out |= _types(member)
    return out


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def typed_value(text: str, schema) -> object:
    """A value as its parameter's schema reads it: raw text where it may only be a string, else the JSON the
    template wrote (a JSON value of a type the schema does not allow, beside a string type, stays text)."""
    allowed = _types(schema)
    if allowed == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    kind = _json_type(value)
    if "string" in allowed and kind not in allowed and not (kind == "integer" and "number" in allowed):
        return text
    return value


def _properties(name: str, tools) -> dict:
    for tool in _refs_resolved(tools or []):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def parse_glm(body: str, tools=None) -> list[Call]:
    """The text between `<tool_call>` and its `</tool_call>` -> the call (its arguments' JSON in the order
    written)."""
    first = body.find(KEY_OPEN)
    name = (body if first < 0 else body[:first]).strip()
    if not name or re.search(r"\s|<", name):
        raise ToolCallError(f"glm: no tool name in {body[:60]!r}")
    props, arguments, at = _properties(name, tools), {}, first if first >= 0 else len(body)
    while at < len(body):
        m = _KEY_THEN_VALUE.match(body, at)
        if m is None:
            if body[at:].strip():
                raise ToolCallError(f"glm: text that is no argument in the call of {name!r}: {body[at:at + 60]!r}")
            break
        key = m.group(1).strip()
        close = _VALUE_END.search(body, m.end())
        if close is None:  # the last value without its </arg_value>: it ends with the call
            text, at = body[m.end():], len(body)
        else:
            text, at = body[m.end():close.start()], close.end()
        arguments[key] = typed_value(text, props.get(key))
    return [Call(name, json.dumps(arguments, ensure_ascii=False))]


class GlmSplitter(Splitter):
    """The marker splitter with GLM's call end: a `</tool_call>` inside a value is text (`call_end`)."""

    final = False

    def _call_step(self, out: list) -> bool:
        text = self.body + self.buf
        end = call_end(text, self.final)
        if end is None:
            self.body, self.buf = text, ""
            return False
        self.body, self.buf = text[:end], text[end + len(END):]
        self._close_call(out, closed=True)
        self.state = "content"
        return True

    def finish(self, truncated: bool = False) -> list:
        out: list = []
        if not truncated and self.state == "call":  # the answer ended: a `</tool_call>` held open ends the call
            self.final = True
            if self._call_step(out):
                self._run(out)
        return out + super().finish(truncated)


def glm_reader(fmt, think=None, reasoning=False, tools=None) -> GlmSplitter:
    return GlmSplitter(fmt, think, reasoning, tools)


GLM = ToolFormat("glm47", START, END, True, parse_glm, markers=(KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE),
                 reader=glm_reader)
