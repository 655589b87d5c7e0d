"""Lark rules for calls whose arguments are JSON, each held to its tool's parameters' schema. Each builder
returns (the text that opens the calls, rules whose `rest` is everything after it to the end of the calls).

- json / generic: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls separated by "\\n".
- deepseek_v3: `<｜tool▁calls▁begin｜>` then per call V3's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
  \\n{...}\\n```<｜tool▁call▁end｜>` or V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (the model
  writes its own; V3 puts a newline between calls), then `<｜tool▁calls▁end｜>`.
- kimi_k2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>
  {...}<|tool_call_end|>`, then `<|tool_calls_section_end|>` (N: the model's running call index).
- mistral: `[TOOL_CALLS]NAME[ARGS]{...}` per call (Ministral 3, Devstral, Mistral Small 3.2), or the older
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`; the calls end the answer.
- llama3_json (no opener): `{"name": ..., "parameters": {...}}`, as `llama3_call`.

A call's arguments are always their own %json document (the JSON around them, `{"name": "NAME", "arguments": `
and `}`, is literal text per tool), so a parameters schema's local $refs ("#/$defs/X") resolve against it, as
its author wrote them: nested inside a call's schema they would resolve against the call's.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import CALL_CLOSE, CALL_OPEN, _literal, tool_parts
from .formats import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from .lark_items import json_item

KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _named(tools: list[dict]) -> list[tuple[str, str]]:
    """(name, the Lark item of its arguments) per tool."""
    return [(name, json_item(params)) for name, params in map(tool_parts, tools)]


def _alternatives(items: list[str]) -> str:
    return " | ".join(f"({a})" for a in items)


def _objects(tools: list[dict], key: str = "arguments") -> str:
    """One of `{"name": "NAME", "<key>": ARGUMENTS}` per tool, as JSON_OPTIONS writes it."""
    heads = [(json.dumps(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": ', ensure_ascii=False), args)
             for name, args in _named(tools)]
    return "(" + _alternatives([f'{head} {args} "}}"' for head, args in heads]) + ")"


def json_block_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    one = f'"\\n" {_objects(tools)} "\\n" {_literal(CALL_CLOSE, tokenizer)}'
    more = f' ("\\n" {_literal(CALL_OPEN, tokenizer)} {one})*' if parallel else ""
    return CALL_OPEN, f"rest: {one}{more}\n"


def deepseek_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    begin, sep, end = (_literal(t, tokenizer) for t in (DS_CALL_BEGIN, DS_SEP, DS_CALL_END))
    alts = []
    for name, args in _named(tools):
        v3 = f'"function" {sep} {json.dumps(name + chr(10) + "```json" + chr(10))} {args} "\\n```"'
        v31 = f"{json.dumps(name)} {sep} {args}"
        alts += [v3, v31]
    many = 'call ("\\n"? call)*' if parallel else "call"  # (V3's template puts a newline between calls)
    return DS_CALLS_BEGIN, (f"rest: {many} {_literal(DS_CALLS_END, tokenizer)}\n"
                            f"call: {begin} ({_alternatives(alts)}) {end}\n")


def kimi_k2_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    begin, args_begin, end = (_literal(t, tokenizer) for t in KIMI_CALL)
    alts = [f'{json.dumps("functions." + name + ":")} CALL_INDEX {args_begin} {args}' for name, args in _named(tools)]
    many = "call+" if parallel else "call"
    return KIMI_SECTION[0], (f"rest: {many} {_literal(KIMI_SECTION[1], tokenizer)}\n"
                             f"call: {begin} ({_alternatives(alts)}) {end}\nCALL_INDEX: /[0-9]+/\n")


def mistral_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    opener, args_tag = _literal(MISTRAL_CALLS, tokenizer), _literal(MISTRAL_ARGS, tokenizer)
    header = "(" + _alternatives([f"{json.dumps(name)} {args_tag} {args}" for name, args in _named(tools)]) + ")"
    listed = f'"[" object (", " object)* "]"' if parallel else '"[" object "]"'  # the older list form
    more = f" ({opener} {header})*" if parallel else ""
    return MISTRAL_CALLS, f"rest: {header}{more} | {listed}\nobject: {_objects(tools)}\n"


def llama3_call(tools: list[dict]) -> str:
    """Llama 3's call: the JSON {"name": ..., "parameters": {...}} of one of `tools`."""
    return _objects(tools, "parameters")
