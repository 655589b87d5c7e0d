"""Tool calls as grammars in the model's own format, each call held to its tool's schema.

- `forced_call`: tool_choice "required" or a named function: the answer is the call(s) and nothing else.
- `optional_calls`: tool_choice "auto" with strict tools: free text, then, if the model opens a call, the
  call(s) to the end of the answer. Free text may be anything but the text that opens a call; once the
  model writes it, what follows is a call of one of the tools, its arguments held to the schema of a
  strict tool (a tool not marked strict: any JSON object). Where the tokenizer holds the opener as one
  special token (Qwen's `<tool_call>`), free text cannot write it and the grammar names that token; where
  the opener is text, it is one lexeme with the free text before it (`OPENING`: text ending at the first
  opener), so the lexer never has to decide between "more free text" and "the opener starts here".

The formats: with JSON arguments (json_grammars.py) json, generic, deepseek_v3 (V3 and V3.1), kimi_k2,
mistral and Llama 3's bare JSON; the XML-like qwen3_coder, glm47 (laguna's too) and minimax_m2
(xml_grammars.py); Gemma 4's and FunctionGemma's (gemma4_grammar.py); LFM2's pythonic calls and Llama 4's
(the same list as the whole answer, no markers) (pythonic_grammar.py). Kimi K3's XTML when a call is forced
(kimi_k3_grammar.py; under auto its calls are parsed). mlx-lm's other parsers (longcat, minicpm5, muse_spark)
have none: their calls are parsed, not constrained (README says which).
Llama 3's calls have no opener (the answer is the call's JSON): under auto its text may not begin with `{`
(nor `<` where `<|python_tag|>` is text), which is where its parser would read a call.
"""

from __future__ import annotations

import llguidance

from ..grammar.requests import _literal
from ..grammar.spec import Grammar, GrammarError, _checked
from .formats import PYTHON_TAG
from .dsml_grammar import dsml_builders
from .gemma4_grammar import function_gemma_calls, gemma4_calls
from .json_grammars import deepseek_calls, json_block_calls, kimi_k2_calls, llama3_call, mistral_calls
from .llama import LLAMA3
from .lark_items import text_until, text_without
from .pythonic_grammar import llama4_answer, pythonic_calls
from .xml_grammars import glm47_calls, minimax_m2_calls, qwen3_coder_calls


def _names(tools: list[dict]) -> str:
    return ", ".join(repr(t.get("function", t).get("name")) for t in tools)


# format name -> its call rules (json_grammars.py, xml_grammars.py, gemma4_grammar.py, pythonic_grammar.py)
BUILDERS = {"json": json_block_calls, "generic": json_block_calls, "deepseek_v3": deepseek_calls,
            "kimi_k2": kimi_k2_calls, "mistral": mistral_calls, "qwen3_coder": qwen3_coder_calls,
            "glm47": glm47_calls, "laguna": glm47_calls, "minimax_m2": minimax_m2_calls, "gemma4": gemma4_calls,
            "pythonic": pythonic_calls, "function_gemma": function_gemma_calls}
BUILDERS.update(dsml_builders())  # DeepSeek V3.2 / V4 / V4.1's DSML (dsml_grammar.py)


def _calls(fmt, tools: list[dict], tokenizer: llguidance.LLTokenizer, parallel: bool) -> tuple[str, str] | None:
    """(the text that opens the calls, Lark rules whose `rest` is everything after it to the end of the
    calls), or None for a format without call rules (or without an opener: Llama 3)."""
    build = BUILDERS.get(fmt.name)
    return build(tools, tokenizer, parallel) if build is not None else None


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
        return _compiled(f"start: {llama3_call(tools)}\n", tokenizer, tools)
    if fmt.name == "llama4_pythonic":  # no opener: the answer is the list of calls
        return _compiled(llama4_answer(tools, parallel, optional=False), tokenizer, tools)
    if fmt.name == "kimi_k3":  # XTML's channels around the calls (kimi_k3_grammar.py); under auto: parsed
        from .kimi_k3_grammar import kimi_k3_answer

        return _compiled(kimi_k3_answer(tools, tokenizer, parallel), tokenizer, tools)
    if fmt.name == "harmony":  # gpt-oss: its analysis, then one call (harmony_grammar.py); under auto: parsed
        from .harmony_grammar import harmony_forced

        return _compiled(harmony_forced(tools, tokenizer), tokenizer, tools)
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
        return _compiled(f"start: FREE | {tag}? {llama3_call(tools)}\nFREE: /\\s*[^\\s{lead}](?s:.*)/\n",
                         tokenizer, tools)
    if fmt.name == "llama4_pythonic":  # no opener: text that does not begin like a call, or the calls
        return _compiled(llama4_answer(tools, parallel, optional=True), tokenizer, tools)
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

