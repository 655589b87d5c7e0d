"""Lark rules for calls in the XML-like formats, each argument held to its parameter's schema.

- `qwen3_coder` (Qwen3-Coder, Qwen3.5 / 3.6; their templates write):
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`,
  calls of one answer separated by "\\n".
- `minimax_m2` (MiniMax-M2): `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>
  \\n...</invoke>\\n</minimax:tool_call>`, one invoke per call; the newlines optional.
- `glm47` (GLM-4.5 ... 5): `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`;
  GLM-4.5 / 4.6's templates put a newline before each tag and GLM-4.7's none, so the grammar lets the model
  write either.

A value is written as the templates render it and as mlx-lm's parsers read it back: a string as its raw text
(any text up to the first closing tag: lark_items.text_until), an enum of strings or a string const as one of
its strings, a boolean as JSON's or Python's (Qwen's template renders `True`), anything else as JSON held to
its schema (the parsers json-load it). A string's pattern, format and length are not held. Parameters come in
the order the schema declares them, the required ones always, the others optional; a tool whose parameters
declare no properties takes any keys with text values.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import CALL_CLOSE, CALL_OPEN, _literal, definitions, tool_parts
from ..grammar.spec import GrammarError
from .lark_items import BOOLEAN, json_item, text_until

_COMPOSITE = ("anyOf", "oneOf", "allOf", "$ref", "properties", "items", "not")


def _is_text(schema: dict) -> bool:
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    return kind is None and not any(k in schema for k in _COMPOSITE + ("enum", "const"))


def _value(schema: dict, defs: dict, text: str, closer: str) -> str:
    """The Lark item of one argument's value and its closing tag (`text`: the item for free text + closer)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a parameter's schema must be an object, got {schema!r}")
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if options and all(isinstance(o, str) for o in options):
        return "(" + " | ".join(json.dumps(o) for o in options) + f") {closer}"
    if _is_text(schema):
        return text
    if schema.get("type") == "boolean":  # JSON's, or Python's as a template's `| string` renders it
        return f"{BOOLEAN} {closer}"
    return f"{json_item({**defs, **schema})} {closer}"  # (the parameters' definitions, for its $refs)


def _parameters(tool: dict) -> tuple[str, dict, dict, set]:
    """(name, declared properties, definitions, required names) of a tool's parameters."""
    name, params = tool_parts(tool)
    return name, params.get("properties") or {}, definitions(params), set(params.get("required") or [])


def _arguments(rule: str, tool: dict, item, text: str, closer: str) -> str:
    """`rule: ...` for `tool`'s arguments in declared order; `item(key_item, value_item)` writes one."""
    _, props, defs, required = _parameters(tool)
    if not props:
        return f"{rule}: ({item('ANY_KEY', text)})*\n"
    parts = []
    for key, schema in props.items():
        one = f"({item(json.dumps(key), _value(schema, defs, text, closer))})"
        parts.append(one if key in required else one + "?")
    return f"{rule}: {' '.join(parts)}\n"


def _per_tool(tools: list[dict], head, item, text: str, closer: str) -> tuple[str, str]:
    """(one alternative per tool: `head(name)` then its arguments; the rules of their arguments)."""
    alts, rules = [], []
    for i, tool in enumerate(tools):
        rules.append(_arguments(f"args{i}", tool, item, text, closer))
        alts.append(f"{head(_parameters(tool)[0])} args{i}")
    return "(" + " | ".join(alts) + ")", "".join(rules)


def qwen3_coder_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    """(the opener, Lark rules whose `rest` is everything after it to the end of the calls)."""
    text, terminal = text_until("PARAM_TEXT", "\n</parameter>", tokenizer)

    def item(key, value):
        return f'"<parameter=" {key} ">\\n" {value} "\\n"'

    names, args = _per_tool(tools, lambda name: json.dumps(f"\n<function={name}>\n"), item, text,
                            '"\\n</parameter>"')
    opener, close = _literal(CALL_OPEN, tokenizer), _literal(CALL_CLOSE, tokenizer)
    more = f' ("\\n" {opener} call)*' if parallel else ""
    return CALL_OPEN, (f'rest: call{more}\ncall: {names} "</function>\\n" {close}\n' + args + terminal
                       + "ANY_KEY: /[^\\s<>=]+/\n")


def glm47_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    """(the opener, Lark rules whose `rest` is everything after it to the end of the calls)."""
    lit = {t: _literal(t, tokenizer) for t in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")}
    text, terminal = text_until("ARG_TEXT", "</arg_value>", tokenizer)

    def item(key, value):
        return f'"\\n"? {lit["<arg_key>"]} {key} {lit["</arg_key>"]} "\\n"? {lit["<arg_value>"]} {value}'

    names, args = _per_tool(tools, json.dumps, item, text, lit["</arg_value>"])
    opener, close = _literal(CALL_OPEN, tokenizer), _literal(CALL_CLOSE, tokenizer)
    more = f' ("\\n"? {opener} call)*' if parallel else ""
    return CALL_OPEN, (f'rest: call{more}\ncall: {names} "\\n"? {close}\n' + args + terminal
                       + "ANY_KEY: /[^\\s<>]+/\n")


MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"


def minimax_m2_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    """(the opener, Lark rules whose `rest` is everything after it to the end of the calls)."""
    text, terminal = text_until("INVOKE_TEXT", "</parameter>", tokenizer)

    def item(key, value):
        return f'"<parameter name=\\"" {key} "\\">" {value} "\\n"?'

    names, args = _per_tool(tools, lambda name: f'{json.dumps(f"<invoke name={json.dumps(name)}>")} "\\n"?', item,
                            text, '"</parameter>"')
    many = "invoke+" if parallel else "invoke"
    return MINIMAX_OPEN, (f'rest: "\\n"? {many} {_literal(MINIMAX_CLOSE, tokenizer)}\n'
                          f'invoke: {names} "</invoke>" "\\n"?\n' + args + terminal + 'ANY_KEY: /[^\\s<>"]+/\n')
