"""Pieces of Lark text shared by the call grammars: free text that stops at a marker, a separated list
whose optional members may be left out, JSON held to a schema, a boolean as JSON or Python writes it.

llguidance's lexer is greedy and never goes back, so "free text, then a marker" cannot be two lexemes when
the marker is text (the text lexeme would run on over it). Where the tokenizer holds the marker as one special
token, free text cannot write it and the two stay apart; otherwise they are one lexeme: text ending at the
marker's first appearance, built with the regex operators & and ~.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal
from ..grammar.spec import JSON_OPTIONS

BOOLEAN = '("true" | "false" | "True" | "False")'  # JSON's or Python's (a template's `| string` writes True)


def json_item(*schemas: dict) -> str:
    """A Lark item for JSON held to one of `schemas` (llguidance's %json, written with JSON_OPTIONS)."""
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": list(schemas)}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def regex_text(text: str) -> str:
    """`text` as a literal inside a Lark regex (Rust regex syntax, between slashes)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def text_until(terminal: str, marker: str, tokenizer: llguidance.LLTokenizer) -> tuple[str, str]:
    """(a Lark item for any text (maybe none) and then `marker`, the definition of `terminal` it uses)."""
    item = _literal(marker, tokenizer)
    if item.startswith("<["):
        return f"{terminal}? {item}", f"{terminal}: /(?s:.+)/\n"
    m = regex_text(marker)
    return terminal, f"{terminal}: /(?s:.*){m}/ & ~/(?s:.*){m}(?s:.+)/\n"


def text_without(terminal: str, marker: str, tokenizer: llguidance.LLTokenizer) -> str:
    """The definition of `terminal`: any non-empty text that does not hold `marker`."""
    if _literal(marker, tokenizer).startswith("<["):
        return f"{terminal}: /(?s:.+)/\n"
    return f"{terminal}: /(?s:.+)/ & ~/(?s:.*){regex_text(marker)}(?s:.*)/\n"


def separated(items: list[str], required: list[bool], separator: str) -> str:
    """A Lark item for `items` in this order, each optional one maybe left out, `separator` (a Lark item) only
    between those written: an object's members, a call's keyword arguments. Empty text when none is written
    (all optional, or no items)."""
    def after(i: int) -> str:  # items i.. once one was written: each with its separator
        if i == len(items):
            return ""
        one = f"{separator} {items[i]}"
        return (f"{one} " if required[i] else f"({one})? ") + after(i + 1)

    def first(i: int) -> str:  # items i.. with none written yet
        if i == len(items):
            return ""
        here = f"{items[i]} {after(i + 1)}".strip()
        if required[i]:
            return here
        rest = first(i + 1)
        return f"({here} | {rest})" if rest else f"({here})?"

    return first(0)
