"""Lark rules for Gemma 4's and FunctionGemma's calls, each argument held to its parameter's schema.

Gemma 4's template writes a call as `<|tool_call>call:NAME{key:VALUE,key:VALUE}<tool_call|>` (calls of one
answer back to back): keys bare and in sorted order (its `dictsort`), strings between `<|"|>` marks, numbers,
true / false / null as JSON writes them, arrays `[a,b]` and objects `{k:v}` of the same values, no spaces.
mlx-lm's gemma4 parser reads that back by quoting the keys and the marked strings into JSON. FunctionGemma
(Gemma 3 270M) writes the same values in `<start_function_call>call:NAME{...}<end_function_call>` with
strings between `<escape>` marks and the keys in the order given (its template loops over the arguments);
formats.parse_function_gemma reads it back the same way.

The value of a schema: an enum or const of strings as one of its strings (marked), a string as any text
between the marks (its pattern and length not held), integer / number / boolean / null as JSON (bounds held),
an array of its
items' values, an object of its declared properties (sorted, the required ones always, commas only between
members), anyOf / oneOf / a list of types as one of them, a local $ref as what it names (inside itself: any
value); anything else (an object without properties, no type at all) as any Gemma value.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal, definitions, local_ref, tool_parts
from ..grammar.spec import GrammarError
from .formats import FG_CALL_END, FG_CALL_START, FG_ESCAPE
from .lark_items import json_item, separated, text_until

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
TERMINALS = ('NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n'
             'ANY_KEY: /[A-Za-z_][A-Za-z0-9_]*/\n')


class _Writer:
    """Builds the Lark items of schemas' values, with the rules they need (`any` for any value)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, quote: str, sort: bool):
        self.defs: dict = {}  # the current tool's $defs / definitions
        self.expanding: set[str] = set()  # the $refs being written out (a schema may refer to itself)
        self.sort = sort  # keys in sorted order (Gemma 4), else as declared (FunctionGemma)
        self.quote = _literal(quote, tokenizer)
        closed, self.text_rule = text_until("MARKED_TEXT", quote, tokenizer)  # text, then the closing mark
        self.string = f"{self.quote} {closed}"

    def marked(self, text: str) -> str:
        return f"{self.quote} {json.dumps(text)} {self.quote}"

    def value(self, schema) -> str:
        if schema is True or schema == {}:
            return "any"
        if not isinstance(schema, dict):
            raise GrammarError(f"a parameter's schema must be an object, got {schema!r}")
        ref = schema.get("$ref")
        if isinstance(ref, str):
            named = local_ref(ref, self.defs)
            if named is None:
                raise GrammarError(f"a $ref the Gemma 4 call grammar cannot resolve: {ref!r}")
            if ref in self.expanding:  # a recursive schema: below its first level, any value
                return "any"
            self.expanding.add(ref)
            try:
                return self.value({**named, **{k: v for k, v in schema.items() if k != "$ref"}})
            finally:
                self.expanding.discard(ref)
        options = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if options is not None:
            return "(" + " | ".join(self.marked(o) if isinstance(o, str) else json.dumps(json.dumps(o))
                                    for o in options) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return "(" + " | ".join(self.value(s) for s in schema[key]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind == "string":
            return self.string
        if kind in ("integer", "number", "boolean", "null"):  # written as JSON writes them: its bounds held
            return json_item(schema)
        if kind == "array":
            item = self.value(schema.get("items", {}))
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object" and schema.get("properties"):
            return self.members(schema["properties"], set(schema.get("required") or []))
        return "any"

    def members(self, props: dict, required: set) -> str:
        """`{k:v,...}` of `props` (in sorted key order, or as declared), the required ones always, commas only
        between."""
        keys = sorted(props) if self.sort else list(props)
        items = [f"{json.dumps(k + ':')} {self.value(props[k])}" for k in keys]
        members = separated(items, [k in required for k in keys], '","')
        return f'"{{" {members} "}}"'

    def rules(self) -> str:
        any_member = 'ANY_KEY ":" any'
        return (f'any: {self.string} | NUMBER | "true" | "false" | "null" | "[" (any ("," any)*)? "]" '
                f'| "{{" ({any_member} ("," {any_member})*)? "}}"\n' + self.text_rule + TERMINALS)


def _calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool, marks: tuple[str, str, str],
           sort: bool) -> tuple[str, str]:
    """(the opener, Lark rules whose `rest` is everything after it to the end of the calls); marks: (the call's
    opener, its closer, the string mark)."""
    opener_text, closer_text, quote = marks
    alts, writer = [], _Writer(tokenizer, quote, sort)
    for tool in tools:
        name, params = tool_parts(tool)
        writer.defs = definitions(params)
        args = (writer.members(params["properties"], set(params.get("required") or []))
                if params.get("properties") else writer.value({"type": "object"}))
        args = args if args != "any" else f'"{{" (ANY_KEY ":" any ("," ANY_KEY ":" any)*)? "}}"'
        alts.append(f"{json.dumps('call:' + name)} {args}")
    opener, close = _literal(opener_text, tokenizer), _literal(closer_text, tokenizer)
    call = f"({' | '.join(f'({a})' for a in alts)}) {close}"
    more = f" ({opener} call)*" if parallel else ""
    return opener_text, f"rest: call{more}\ncall: {call}\n" + writer.rules()


def gemma4_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    return _calls(tools, tokenizer, parallel, (OPEN, CLOSE, QUOTE), sort=True)


def function_gemma_calls(tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str]:
    return _calls(tools, tokenizer, parallel, (FG_CALL_START, FG_CALL_END, FG_ESCAPE), sort=False)
