"""A forced call (tool_choice required / named) in Kimi K3's XTML, each argument held to its parameter's schema.

The answer the grammar allows (moonshotai/Kimi-K3 encoding_k3.py renders an assistant's calls so; kimi_k3.py
reads it back): the response channel closed (opened first when the prompt opened the think channel, whose end
the grammar starts after), then

    <|open|>tools<|sep|><|open|>call tool="NAME" index="N"<|sep|>
      <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|> ...
    <|close|>call<|sep|> ...<|close|>tools<|sep|> (<|close|>message<|sep|>)

A string is its raw text (no control token inside), an enum of strings one of its strings, anything else JSON
held to its schema under the type its JSON value has; attribute values escape `&` and `"`. Parameters come in
declared order, the required ones always; a tool without declared properties takes any keys with string
values. Under tool_choice auto K3's calls are parsed, not constrained (its free text would have to write the
channel markers, control tokens a free-text lexeme cannot).
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal, definitions, tool_parts
from .kimi_k3 import CLOSE, OPEN, SEP
from .lark_items import json_item, regex_text

_JSON_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "array": "array",
               "object": "object"}


def _escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;")


def _tags(tokenizer: llguidance.LLTokenizer) -> tuple[str, str, str]:
    return tuple(_literal(t, tokenizer) for t in (OPEN, CLOSE, SEP))


def _text_then_close(tokenizer: llguidance.LLTokenizer) -> tuple[str, str]:
    """(a Lark item for a string value and the argument's close, the terminal it defines)."""
    op, cl, sep = _tags(tokenizer)
    close = f'{cl} "argument" {sep}'
    if cl.startswith("<["):  # a control token: free text cannot write it
        return f"ARG_TEXT? {close}", "ARG_TEXT: /(?s:.+)/\n"
    m = regex_text(CLOSE + "argument" + SEP)
    return "ARG_TEXT", f"ARG_TEXT: /(?s:.*){m}/ & ~/(?s:.*){m}(?s:.+)/\n"


def _argument(key: str, schema: dict, defs: dict, tags: tuple, text: str) -> str:
    op, cl, sep = tags
    head = json.dumps(f'argument key="{_escaped(key)}" type="')
    close = f'{cl} "argument" {sep}'
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    kind = schema.get("type")
    if options and all(isinstance(o, str) for o in options):
        return f'{op} {head} "string\\"" {sep} (' + " | ".join(json.dumps(o) for o in options) + f") {close}"
    if kind == "string" or (kind is None and not options and not any(
            k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items"))):
        return f'{op} {head} "string\\"" {sep} {text}'
    types = [_JSON_TYPES[kind]] if isinstance(kind, str) and kind in _JSON_TYPES else sorted(set(_JSON_TYPES.values()))
    alts = " | ".join(json.dumps(t + '"') for t in types)
    return f"{op} {head} ({alts}) {sep} {json_item({**defs, **schema})} {close}"


def kimi_k3_answer(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> str:
    """The Lark grammar (`start` ...) of an answer that is a call of one of `tools` in K3's XTML."""
    tags = _tags(tokenizer)
    op, cl, sep = tags
    text, terminal = _text_then_close(tokenizer)
    alts, rules = [], []
    for i, tool in enumerate(tools):
        name, params = tool_parts(tool)
        props, defs, required = params.get("properties") or {}, definitions(params), set(params.get("required") or [])
        if props:
            items = [f"({_argument(k, s, defs, tags, text)})" + ("" if k in required else "?")
                     for k, s in props.items()]
            rules.append(f"args{i}: {' '.join(items)}\n")
        else:
            rules.append(f'args{i}: ({op} "argument key=\\"" ANY_KEY "\\" type=\\"string\\"" {sep} {text})*\n')
        head = json.dumps(f'call tool="{_escaped(name)}" index="')
        alts.append(f'{op} {head} INDEX "\\"" {sep} args{i} {cl} "call" {sep}')
    calls = "call+" if parallel else "call"
    response = f'({op} "response" {sep})? {cl} "response" {sep}'
    return (f'start: {response} {op} "tools" {sep} {calls} {cl} "tools" {sep} ({cl} "message" {sep})?\n'
            f"call: {' | '.join(f'({a})' for a in alts)}\n" + "".join(rules) + terminal
            + 'INDEX: /[1-9][0-9]*/\nANY_KEY: /[^"&<>]+/\n')
