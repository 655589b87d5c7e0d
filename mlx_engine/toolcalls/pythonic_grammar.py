"""Lark rules for pythonic calls (LFM2 / LFM2.5, mlx-lm's `pythonic` parser; Llama 4, llama.py), each argument
held to its parameter's schema.

Llama 4 writes the same list of calls as its whole answer, without LFM2's markers (`llama4_answer`).

LFM2's models write `<|tool_call_start|>[NAME(key=VALUE, key=VALUE), NAME(...)]<|tool_call_end|>`: a Python
list of calls with keyword arguments (their model cards; text may follow the closing token). mlx-lm's parser
reads it with Python's `ast`, JSON's true / false / null taken as Python's, so a value is written as JSON held
to its parameter's schema (a JSON value is a Python literal there: strings double-quoted, bounds, lengths and
enums held by llguidance), a boolean as Python's True / False or JSON's. Arguments come in the order the schema
declares them, the required ones always, "," (and a space, as the models write) only between those written; a
tool whose parameters declare no properties takes any identifier keys with JSON values. A tool's name and its
parameters' names must be Python identifiers (not keywords; a name may be dotted): nothing else parses back,
so any other is refused (formats.UnwritableCall: a forced call is a 400, auto goes unconstrained).
"""

from __future__ import annotations

import json
import keyword

import llguidance

from ..grammar.requests import _literal, definitions, tool_parts
from ..grammar.spec import GrammarError
from .formats import UnwritableCall
from .lark_items import BOOLEAN, json_item, separated

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
COMMA = '"," " "?'


def _identifier(name: str, dotted: bool = False) -> bool:
    parts = name.split(".") if dotted else [name]
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)


def _value(schema, defs: dict) -> str:
    """The Lark item of one keyword argument's value."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a parameter's schema must be an object, got {schema!r}")
    if schema.get("type") == "boolean":  # Python's, or JSON's (the parser takes both)
        return BOOLEAN
    return json_item({**defs, **schema})


def _arguments(name: str, params: dict) -> str:
    props, defs = params.get("properties") or {}, definitions(params)
    if not props:  # any keyword arguments
        one = f'ANY_KEY "=" {json_item({})}'
        return f"({one} ({COMMA} {one})*)?"
    for key in props:
        if not _identifier(key):
            raise UnwritableCall(f"tool {name!r}: parameter {key!r} is not a Python identifier, which a pythonic "
                                 "call cannot write")
    required = set(params.get("required") or [])
    items = [f"{json.dumps(key + '=')} {_value(schema, defs)}" for key, schema in props.items()]
    return separated(items, [key in required for key in props], COMMA)


def pythonic_list(tools: list[dict], parallel: bool) -> str:
    """Lark rules whose `calls` is the list `[NAME(key=VALUE, ...), ...]` (one call unless parallel)."""
    alts = []
    for tool in tools:
        name, params = tool_parts(tool)
        if not _identifier(name, dotted=True):
            raise UnwritableCall(f"tool {name!r}: a pythonic call names a Python identifier, not {name!r}")
        alts.append(f'{json.dumps(name + "(")} {_arguments(name, params)} ")"')
    more = f" ({COMMA} call)*" if parallel else ""
    return (f'calls: "[" call{more} "]"\n'
            f"call: {' | '.join(f'({a})' for a in alts)}\n"
            "ANY_KEY: /[A-Za-z_][A-Za-z0-9_]*/\n")


def pythonic_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    """LFM2's: (the opener, Lark rules whose `rest` is everything after it to the end of the calls)."""
    return OPEN, f"rest: calls {_literal(CLOSE, tokenizer)}\n" + pythonic_list(tools, parallel)


def llama4_answer(tools: list[dict], parallel: bool, optional: bool) -> str:
    """Llama 4's answer as Lark rules from `start` (llama.py's format: no opener, the calls are the answer):
    the list of calls; optional (tool_choice auto): or text that does not begin with `[`, where its reader
    would read a call."""
    start = "start: FREE | calls\nFREE: /\\s*[^\\s\\[](?s:.*)/\n" if optional else "start: calls\n"
    return start + pythonic_list(tools, parallel)
