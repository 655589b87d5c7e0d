"""Tool calls as grammars in the model's own format, each call held to its tool's schema.

- `forced_call`: tool_choice "required" or a named function: the answer is the call(s) and nothing else.
- `optional_calls`: tool_choice "auto" with strict tools: free text, then, if the model opens a call, the
  call(s) to the end of the answer. Free text may be anything but the text that opens a call; once the
  model writes it, what follows is a call of one of the tools, its arguments held to the schema of a
  strict tool (a tool not marked strict: any JSON object). Where the tokenizer holds the opener as one
  special token (Qwen's `<tool_call>`), free text cannot write it and the grammar names that token; where
  the opener is text, it is one lexeme with the free text before it (`OPENING`: text ending at the first
  opener), so the lexer never has to decide between "more free text" and "the opener starts here".

The formats: JSON bodies (json, generic), DeepSeek's calls block, Llama 3's bare JSON, and the XML-like
qwen3_coder and glm47 (xml_grammars.py). mlx-lm's other parsers (pythonic, kimi_k2, mistral, gemma4, ...)
have none: their calls are parsed, not constrained (README says which). Llama 3's calls have no opener (the
answer is the call's JSON): under auto its text may not begin with `{` (nor `<` where `<|python_tag|>` is
text), which is where its parser would read a call.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import CALL_CLOSE, CALL_OPEN, _literal, tool_call_schema
from ..grammar.spec import JSON_OPTIONS, Grammar, GrammarError, _checked
from .formats import (DEEPSEEK, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP, GENERIC, JSON, LLAMA3,
                      PYTHON_TAG)
from .lark_items import text_until, text_without
from .xml_grammars import glm47_calls, qwen3_coder_calls


def _one_of(schemas: list[dict]) -> str:
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _names(tools: list[dict]) -> str:
    return ", ".join(repr(t.get("function", t).get("name")) for t in tools)


def _calls(fmt, tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str] | None:
    """(the text that opens the calls, Lark rules whose `rest` is everything after it to the end of the
    calls), or None for a format without an opener."""
    if fmt in (JSON, GENERIC) or fmt.name in ("json", "generic"):
        one = f'"\\n" %json {_one_of([tool_call_schema(t) for t in tools])} "\\n" {_literal(CALL_CLOSE, tokenizer)}'
        more = f' ("\\n" {_literal(CALL_OPEN, tokenizer)} {one})*' if parallel else ""
        return CALL_OPEN, f"rest: {one}{more}\n"
    if fmt is DEEPSEEK:  # V3's form: function<sep>NAME\n```json\n{args}\n```
        alts = []
        for t in tools:
            s = tool_call_schema(t)
            name = s["properties"]["name"]["const"]
            args = json.dumps({**s["properties"]["arguments"], "x-guidance": JSON_OPTIONS})
            alts.append(f'{_literal(DS_CALL_BEGIN, tokenizer)} "function" {_literal(DS_SEP, tokenizer)} '
                        f'{json.dumps(name + chr(10) + "```json" + chr(10))} %json {args} '
                        f'"\\n```" {_literal(DS_CALL_END, tokenizer)}')
        many = "call+" if parallel else "call"
        call = " | ".join(f"({a})" for a in alts)
        return DS_CALLS_BEGIN, f"rest: {many} {_literal(DS_CALLS_END, tokenizer)}\ncall: {call}\n"
    if fmt.name == "qwen3_coder":
        return qwen3_coder_calls(tools, tokenizer, parallel)
    if fmt.name == "glm47":
        return glm47_calls(tools, tokenizer, parallel)
    return None


def _llama3_call(tools: list[dict]) -> str:
    """Llama 3's call: the JSON {"name": ..., "parameters": {...}} of one of `tools`."""
    schemas = [{"type": "object", "properties": {"name": {"const": s["properties"]["name"]["const"]},
                                                 "parameters": s["properties"]["arguments"]},
                "required": ["name", "parameters"], "additionalProperties": False}
               for s in map(tool_call_schema, tools)]
    return f"%json {_one_of(schemas)}"


def _compiled(lark: str, tokenizer: llguidance.LLTokenizer, tools: list[dict]) -> Grammar:
    names = _names(tools)
    try:
        source = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(f"the tool call of {names} cannot be compiled: {e}") from None
    return _checked(source, tokenizer, f"a call of {names}")


def forced_call(fmt, tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool = True) -> Grammar | None:
    """The grammar of a call of one of `tools` in `fmt` and nothing else (None: this format has none)."""
    if not tools:
        raise GrammarError("tool_choice forces a call but no tools are given")
    if fmt is LLAMA3:
        return _compiled(f"start: {_llama3_call(tools)}\n", tokenizer, tools)
    spec = _calls(fmt, tools, tokenizer, parallel)
    if spec is None:
        return None
    opener, rules = spec
    return _compiled(f"start: {_literal(opener, tokenizer)} rest\n{rules}", tokenizer, tools)


def optional_calls(fmt, tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool = True) -> Grammar | None:
    """The grammar of an answer that may call one of `tools` (tool_choice "auto"): free text, then optionally
    the call(s) in `fmt`, each held to its tool's schema (`strict_view` first for tools not marked strict).
    Llama 3 (no opener): the answer is text that does not begin like a call, or it is one call.
    None: a format without a call grammar."""
    if not tools:
        return None
    if fmt is LLAMA3:  # no opener: the answer is text, or it is the call (maybe after <|python_tag|>)
        tag = _literal(PYTHON_TAG, tokenizer)
        lead = "{" if tag.startswith("<[") else "{<"  # text may not begin like a call
        return _compiled(f"start: FREE | {tag}? {_llama3_call(tools)}\nFREE: /\\s*[^\\s{lead}](?s:.*)/\n",
                         tokenizer, tools)
    spec = _calls(fmt, tools, tokenizer, parallel)
    if spec is None:
        return None
    opener, rules = spec
    opening, opening_def = text_until("OPENING", opener, tokenizer)  # text ending at the first opener
    head = f"start: FREE | {opening} rest\n" + text_without("FREE", opener, tokenizer) + opening_def
    return _compiled(head + rules, tokenizer, tools)


def strict_view(tools: list[dict]) -> list[dict]:
    """`tools` as optional_calls holds them: a tool marked strict keeps its parameters' schema, any other
    takes any JSON object as its arguments (its name is still one of the tools')."""
    out = []
    for t in tools:
        fn = t.get("function", t)
        if fn.get("strict") is True:
            out.append(t)
        else:
            out.append({"type": "function", "function": {"name": fn.get("name"), "parameters": {"type": "object"}}})
    return out

