"""A forced tool call (tool_choice "required" or a named function) as a grammar in the model's own format:
the whole call is held to the tool's schema. Formats whose calls are not JSON (mlx-lm's XML-like and
pythonic ones) have none: their calls are parsed, not constrained (README says which)."""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal, tool_call_schema, tool_calls
from ..grammar.spec import JSON_OPTIONS, Grammar, GrammarError, _checked
from .formats import DEEPSEEK, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP, GENERIC, JSON, LLAMA3


def _one_of(schemas: list[dict]) -> str:
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def forced_call(fmt, tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool = True) -> Grammar | None:
    """The grammar of a call of one of `tools` in `fmt` (None: this format has none)."""
    if fmt in (JSON, GENERIC) or fmt.name in ("json", "generic"):
        return tool_calls(tools, tokenizer, parallel)
    if not tools:
        raise GrammarError("tool_choice forces a call but no tools are given")
    names = ", ".join(repr(t.get("function", t).get("name")) for t in tools)
    if fmt is LLAMA3:
        schemas = [{"type": "object", "properties": {"name": {"const": s["properties"]["name"]["const"]},
                                                     "parameters": s["properties"]["arguments"]},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for s in map(tool_call_schema, tools)]
        lark = f"start: %json {_one_of(schemas)}\n"
    elif fmt is DEEPSEEK:  # V3's form: function<sep>NAME\n```json\n{args}\n```
        alts = []
        for t in tools:
            s = tool_call_schema(t)
            name = s["properties"]["name"]["const"]
            args = json.dumps({**s["properties"]["arguments"], "x-guidance": JSON_OPTIONS})
            alts.append(f'{_literal(DS_CALL_BEGIN, tokenizer)} "function" {_literal(DS_SEP, tokenizer)} '
                        f'{json.dumps(name + chr(10) + "```json" + chr(10))} %json {args} '
                        f'"\\n```" {_literal(DS_CALL_END, tokenizer)}')
        call = " | ".join(f"({a})" for a in alts)
        many = "call+" if parallel else "call"
        lark = (f"start: {_literal(DS_CALLS_BEGIN, tokenizer)} {many} {_literal(DS_CALLS_END, tokenizer)}\n"
                f"call: {call}\n")
    else:
        return None
    try:
        source = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(f"the tool call of {names} cannot be compiled: {e}") from None
    return _checked(source, tokenizer, f"a call of {names}")
