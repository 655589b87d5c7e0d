"""Qwen's XML tool calls (Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5 / 3.6 / 3.8), read exactly as the models write
them.

The format (the checkpoints' chat_template.jinja; Qwen3-Coder's reference qwen3coder_tool_parser.py, which
mlx-lm's qwen3_coder parser copies):

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

A value is its raw text, one newline each side being the template's (the rest, whitespace included, is the
value); it is typed by its parameter's schema (`type`, a list of types, anyOf / oneOf, enum; Python's True /
False / None as the template renders them), a string kept as written.

What this module reads that mlx-lm's parser does not (it cuts a value at the first `</parameter>`, takes the
function at the first `</function>`, and the splitter's call at the first `</tool_call>`):
- a value ends at the `</parameter>` that the next `<parameter=`, `</function>` or `</tool_call>` follows, so
  closing tags written inside a value (`</parameter>`, `</function>`, `</tool_call>`) are text of it; a value
  whose `</parameter>` the model left out ends at a `<parameter=` line or at the `</function>` line that closes
  the call;
- the call ends at the `</tool_call>` after its `</function>`; a `<function=...>` block without its
  `<tool_call>` opener (Qwen3-Coder does write it) is a call too, where it looks like one;
- a `<tool_call>` inside the reasoning (Qwen3.5 calls without closing its `<think>`) is a call and ends the
  reasoning (llama.cpp reads it so);
- anyOf / type-list schemas ("5" under anyOf [integer, null] is 5), a string-only parameter's "null" is the
  string, a number past int64 stays a number.
"""

from __future__ import annotations

import ast
import json
import re

from ..grammar.requests import definitions, local_ref
from .formats import Call, ToolCallError, ToolFormat
from .stream import Splitter, _held

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_OPEN_TAG = re.compile(r"<(function|parameter)=([^<>\n]*)>")
_VALUE_END = re.compile(r"</parameter>|\n(?=<parameter=)|\n(?=</function>)")
_AFTER_VALUE = (PARAMETER, FUNCTION_END, END)
_BARE_CALL = re.compile(r"<function=[^<>\n]+>\s*(?:<parameter=|</function>)")

MORE, BAD = "more", "bad"  # scan results: the text so far cannot say / is no call


def _next_is(text: str, at: int, words, final: bool) -> bool | None:
    """Whether the text after `at` (past whitespace) begins with one of `words` (or ends, where `final`): True,
    False, or None while the text so far cannot say."""
    rest = text[at:].lstrip()
    if not rest:
        return True if final else None
    if any(rest.startswith(w) for w in words):
        return True
    if not final and any(w.startswith(rest) for w in words):
        return None
    return False


def _value_end(text: str, at: int, final: bool):
    """(where the value starting at `at` ends, where reading resumes), MORE, or BAD (it never ends)."""
    for m in _VALUE_END.finditer(text, at):
        end = m.start()
        if m.group() == PARAMETER_END:  # the value's close tag, if the next tag or the call's end follows
            ok = _next_is(text, m.end(), _AFTER_VALUE, final)
            resume = m.end()
            end -= 1 if end > at and text[end - 1] == "\n" else 0  # (the template's newline before it)
        elif text.startswith(PARAMETER, m.end()):  # its </parameter> left out: the next parameter's line
            tag = _OPEN_TAG.match(text, m.end())
            ok = True if tag else (None if not final and "\n" not in text[m.end():] and ">" not in text[m.end():]
                                   else False)
            resume = m.end()
        else:  # its </parameter> left out: the line of the </function> that closes the call
            ok = _next_is(text, m.end() + len(FUNCTION_END), (END, FUNCTION), final)
            resume = m.end()
        if ok is None:
            return MORE
        if ok:
            return end, resume
    return BAD if final else MORE


def scan_function(text: str, at: int, final: bool):
    """The function call written at `at` (`<function=NAME>...</function>`): (name, [(key, raw value)], end), or
    MORE / BAD."""
    tag = _OPEN_TAG.match(text, at)
    if tag is None or tag.group(1) != "function":
        rest = text[at:]
        return MORE if not final and "\n" not in rest and (FUNCTION.startswith(rest) or re.fullmatch(
            r"<function=[^<>\n]*", rest)) else BAD
    name, pos, params = tag.group(2).strip(), tag.end(), []
    if not name:
        return BAD
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(FUNCTION_END, pos):
            return name, params, pos + len(FUNCTION_END)
        tag = _OPEN_TAG.match(text, pos)
        if tag is not None and tag.group(1) == "parameter":
            start = tag.end() + (1 if text.startswith("\n", tag.end()) else 0)
            end = _value_end(text, start, final)
            if end in (MORE, BAD):
                return end
            params.append((tag.group(2).strip(), text[start : end[0]]))
            pos = end[1]
            continue
        rest = text[pos:]
        if not final and (any(w.startswith(rest) for w in (FUNCTION_END, PARAMETER))
                          or re.fullmatch(r"<parameter=[^<>\n]*", rest)):
            return MORE
        return BAD


def scan_block(text: str, final: bool):
    """The calls of `text` (what follows `<tool_call>`, or a bare `<function=`): ([(name, params)], where the
    calls' text ends, where the answer resumes after the closing `</tool_call>`), or MORE / BAD."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(FUNCTION, pos) or (not final and FUNCTION.startswith(text[pos:]) and pos < len(text)):
            got = scan_function(text, pos, final)
            if got in (MORE, BAD):
                return got
            calls.append(got[:2])
            pos = got[2]
            continue
        if not calls:
            return MORE if pos == len(text) and not final else BAD
        if text.startswith(END, pos):
            return calls, pos, pos + len(END)
        if pos == len(text) or (END.startswith(text[pos:]) and not final):
            return (calls, pos, pos) if final else MORE
        return calls, pos, pos  # no </tool_call>: the text after the calls is the answer's again


# -- values typed by the parameter's schema -------------------------------------------------------------------

def _types(schema, defs: dict) -> list[str]:
    """The JSON types `schema` allows, in the order it names them (type, type lists, anyOf / oneOf, enum)."""
    if not isinstance(schema, dict):
        return []
    named = local_ref(schema.get("$ref"), defs)
    if named is not None:
        return _types(named, defs)
    kind, out = schema.get("type"), []
    out += [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            out += _types(member, defs)
    if not out and isinstance(schema.get("enum"), list):
        out += [_json_type(v) for v in schema["enum"]]
    return list(dict.fromkeys(out))


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "string")


def _literal(text: str):
    """The value `text` writes as JSON, else as a Python literal (the template renders True / None); raises
    ValueError when it is neither."""
    try:
        return json.loads(text, strict=False)
    except json.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(text) from None
    if isinstance(value, tuple):
        value = list(value)
    json.dumps(value)  # (a set, bytes, complex: TypeError, not a JSON value)
    return value


def typed_value(raw: str, schema, defs: dict):
    """A parameter's raw text as the value its schema asks for; a value that fits none of its types is kept
    as the model wrote it (as JSON where it reads as JSON, else the text)."""
    types, text = _types(schema, defs), raw.strip()
    if "null" in types or not types:
        if text in ("null", "None"):
            return None
    if not types:  # a parameter the tool does not declare: objects and arrays read, the rest is text
        try:
            value = _literal(text)
        except (ValueError, TypeError):
            return raw
        return value if isinstance(value, (dict, list)) else raw
    for kind in types:
        if kind == "string":
            return raw
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number") and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if kind in ("integer", "number") and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
            value = float(text)
            if kind == "number" or value.is_integer():
                return value if kind == "number" else int(value)
        if kind in ("object", "array"):
            try:
                value = _literal(text)
            except (ValueError, TypeError):
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    try:
        return _literal(text)
    except (ValueError, TypeError):
        return raw


def _parameters(name: str, tools) -> tuple[dict, dict]:
    """(the properties of tool `name`'s parameters, the definitions their $refs name)."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties")
            return (props if isinstance(props, dict) else {}), definitions(params)
    return {}, {}


def parse_qwen3_xml(body: str, tools=None) -> list[Call]:
    """The text of a call block (what follows `<tool_call>` up to its `</tool_call>`) -> its calls."""
    got = scan_block(body, final=True)
    if got in (MORE, BAD) or body[got[1]:].strip():
        raise ToolCallError(f"qwen3 xml: no <function=NAME>...</function> call in {body[:60]!r}")
    calls = []
    for name, params in got[0]:
        props, defs = _parameters(name, tools)
        arguments = {key: typed_value(raw, props.get(key), defs) for key, raw in params}
        calls.append(Call(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


# -- the stream reader ------------------------------------------------------------------------------------------

def _may_open_bare(tail: str) -> bool:
    """Whether `tail` (from a `<function=`) may still become a bare call's opening: `<function=NAME>` then a
    parameter or the function's end."""
    m = re.match(r"<function=[^<>\n]*(>?)(\s*)(.*)", tail, re.DOTALL)
    if m is None:
        return False
    if not m.group(1):
        return m.end(0) == len(tail) and not m.group(2) and not m.group(3)
    rest = m.group(3)
    return any(w.startswith(rest) for w in (PARAMETER, FUNCTION_END))

class Qwen3XmlSplitter(Splitter):
    """The marker splitter with this format's call boundaries (`scan_block`): a call opens at `<tool_call>` (in
    the reasoning too) or at a bare `<function=NAME>` followed by a parameter or its end, and closes at the
    `</tool_call>` after its `</function>`."""

    calls_in_reasoning = True
    final = False

    def _find_start(self, text: str):
        i = text.find(START)
        bare = _BARE_CALL.search(text, 0, i if i >= 0 else len(text))
        if bare is not None:
            return bare.start(), bare.start()  # (the function's own text is the call's)
        return (i, i + len(START)) if i >= 0 else None

    def _start_held(self, text: str) -> int:
        hold = _held(text, [START, FUNCTION])
        at = text.rfind(FUNCTION)
        if at >= 0 and _may_open_bare(text[at:]):
            hold = max(hold, len(text) - at)
        return hold

    def _call_step(self, out: list) -> bool:
        text = self.body + self.buf
        got = scan_block(text, self.final)
        if got == MORE:
            self.body, self.buf = text, ""
            return False
        if got == BAD:
            if not self.opener:  # a bare `<function=` that is no call: text again
                self.state, self.body, self.buf = "content", "", text[len(FUNCTION):]
                self._not_a_call(out, self.space_before + FUNCTION)
                return True
            i = text.find(END)  # no call: its text to the first end marker goes back as text
            if i < 0 and not self.final:
                self.body, self.buf = text, ""
                return False
            i = len(text) if i < 0 else i
            self.body, self.buf = text[:i], text[i + len(END):]
            self._close_call(out, closed=i < len(text))
            return True
        _, end, resume = got
        self.body, self.buf = text[:end], text[resume:]
        self._close_call(out, closed=False)
        return True

    def finish(self, truncated: bool = False) -> list:
        out: list = []
        if not truncated:  # the answer ended: what the text held open is decided now
            self.final = True
            self._run(out)
        return out + super().finish(truncated)


def qwen3_xml_reader(fmt, think=None, reasoning=False, tools=None) -> Qwen3XmlSplitter:
    return Qwen3XmlSplitter(fmt, think, reasoning, tools)


# named as mlx-lm names the parser (grammars.BUILDERS: xml_grammars.qwen3_coder_calls writes its forced calls)
QWEN3_XML = ToolFormat("qwen3_coder", START, END, True, parse_qwen3_xml,
                       markers=(FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END), reader=qwen3_xml_reader)
