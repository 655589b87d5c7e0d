"""A compiled grammar: llguidance's grammar text, the tokenizer it runs over, and where it starts.

Grammars come from JSON schemas (response_format json_schema, a tool's parameters), any JSON object
(json_object), a regular expression or a Lark grammar (llguidance's dialect: `%json {...}` embeds a
schema, `<[id]>` names a special token). Each is checked once here, against the model's tokenizer, so a
request the engine cannot serve is refused before any work, with llguidance's own message.

JSON is written with the separators most models write inline, `", "` and `": "`, and no other
whitespace: the text of keys and punctuation is then fully determined, which is what the grammar drafts
(grammar/drafter.py), and a model cannot loop on whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import llguidance

from .matcher import Matcher

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (schema, regex, Lark text) the engine cannot compile; the message names which and why."""


@dataclass(frozen=True)
class Grammar:
    source: str  # llguidance's grammar (its JSON form)
    tokenizer: llguidance.LLTokenizer
    what: str  # what it came from, for messages ("json_schema 'person'")
    reasoning_end: tuple[int, ...] | None = None  # a reasoning model's end marker: the grammar starts after it

    def matcher(self, reasoning: bool = False) -> Matcher:
        """A fresh matcher for one sequence; `reasoning`: its answer opens inside the model's reasoning."""
        return Matcher(self, reasoning)

    def after_reasoning(self, marker: list[int] | tuple[int, ...] | None) -> "Grammar":
        """The same grammar, starting after `marker` (the token ids of `</think>`) when a matcher is made
        with reasoning=True."""
        return replace(self, reasoning_end=tuple(marker) if marker else None)


def _checked(source: str, tokenizer: llguidance.LLTokenizer, what: str) -> Grammar:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
    if is_error:
        raise GrammarError(f"{what} cannot be compiled: {messages[0] if messages else 'unknown error'}")
    return Grammar(source, tokenizer, what)


def json_schema(schema: dict | str, tokenizer: llguidance.LLTokenizer, name: str | None = None) -> Grammar:
    """JSON text valid against `schema` (a dict or its JSON text)."""
    what = f"json_schema {name!r}" if name else "json_schema"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{what} cannot be compiled: {e}") from None
    return _checked(source, tokenizer, what)


def json_object(tokenizer: llguidance.LLTokenizer) -> Grammar:
    """Any JSON object (response_format json_object)."""
    return replace(json_schema({"type": "object"}, tokenizer), what="json_object")


def regex(pattern: str, tokenizer: llguidance.LLTokenizer) -> Grammar:
    """Text matching the regular expression `pattern` (whole)."""
    return _checked(llguidance.LLMatcher.grammar_from_regex(pattern), tokenizer, f"regex {pattern!r}")


def lark(text: str, tokenizer: llguidance.LLTokenizer) -> Grammar:
    """Text of llguidance's Lark dialect (`start` is the answer)."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(text), tokenizer, "lark grammar")
