"""gpt-oss's forced tool call (tool_choice required / named) as a grammar in Harmony, each call held to its
tool's schema. After the generation prompt `<|start|>assistant`, the answer may first hold one analysis message
(the reasoning gpt-oss writes before it acts), then the call in the form gpt-oss's chat template writes one (the
recipient in the role header, openai/gpt-oss-20b chat_template.jinja; openai/harmony docs/format.md):

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant
     to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{ARGUMENTS}

then the answer ends (its stop token, `<|call|>`, is the model's end of turn). One call: a Harmony answer ends at
each call, the next one comes after the tool's result. Read back by harmony.HarmonyReader.
tool_choice auto with strict tools has no grammar here: Harmony's free text is messages whose markers are
special tokens, so the answer is parsed, not constrained.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal
from .harmony import CHANNEL, CONSTRAIN, END, MESSAGE, START
from .json_grammars import _alternatives, _named
from .lark_items import text_until


def harmony_forced(tools: list[dict], tokenizer: llguidance.LLTokenizer) -> str:
    """The Lark grammar of an answer that is (maybe after its reasoning) one call of one of `tools`."""
    start, message, channel, constrain = (_literal(m, tokenizer) for m in (START, MESSAGE, CHANNEL, CONSTRAIN))
    reasoning, reasoning_def = text_until("REASONING", END, tokenizer)  # the reasoning, then <|end|>
    calls = [f'{json.dumps(" to=functions." + name, ensure_ascii=False)} {channel} "commentary " {constrain} "json" '
             f"{message} {args}" for name, args in _named(tools)]
    return (f"start: analysis? call\n"
            f'analysis: {channel} "analysis" {message} {reasoning} {start} "assistant"\n'
            f"call: {_alternatives(calls)}\n{reasoning_def}")
