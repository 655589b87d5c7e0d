"""Lark rules for a DeepSeek DSML call (V3.2, V4, V4.1; the format: dsml.py), each argument held to its
parameter's schema: tool_choice required / named (grammars.forced_call) and strict tools under auto.

Written as DeepSeek's encoder writes an assistant turn (encoding_dsv32.py; mlx_lm/chat_templates/deepseek_v32.py):

    <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="KEY" string="true">VALUE
    </｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n</｜DSML｜function_calls>

in the checkpoint's dialect (V4: tool_calls; V4.1: `<｜DSML｜ calls>` and every tag's prefix `｜DSML｜ `). A string
parameter (or an enum of strings) is string="true" with its raw text (any text up to the first closing
parameter tag); every other value is string="false" with JSON held to its schema, as the encoder renders it
and dsml.read_invokes reads it back. Parameters come in the order the schema declares them, the required ones
always; a tool whose parameters declare no properties takes any keys with text values.
"""

from __future__ import annotations

import json

import llguidance

from ..grammar.requests import _literal, definitions, tool_parts
from .dsml import DIALECTS
from .lark_items import json_item, text_until
from .xml_grammars import _is_text


def _param(prefix: str, key_item: str, schema: dict, defs: dict, text: str, closer: str) -> str:
    """One parameter's Lark item: its opening tag, value and closing tag."""
    head = f'"<{prefix}parameter name=\\"" {key_item} "\\" string='
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if options and all(isinstance(o, str) for o in options):
        return head + '\\"true\\">" (' + " | ".join(json.dumps(o) for o in options) + f") {closer}"
    if _is_text(schema):
        return head + f'\\"true\\">" {text}'
    return head + f'\\"false\\">" {json_item({**defs, **schema})} {closer}'


def _arguments(rule: str, prefix: str, params: dict, text: str, closer: str) -> str:
    props, defs, required = params.get("properties") or {}, definitions(params), set(params.get("required") or [])
    if not props:
        return f'{rule}: ({_param(prefix, "ANY_KEY", {"type": "string"}, {}, text, closer)} "\\n")*\n'
    parts = []
    for key, schema in props.items():
        if not isinstance(schema, dict):
            schema = {}
        one = f'({_param(prefix, json.dumps(key), schema, defs, text, closer)} "\\n")'
        parts.append(one if key in required else one + "?")
    return f"{rule}: {' '.join(parts)}\n"


def dsml_calls(fmt_name: str, tools: list[dict], tokenizer: llguidance.LLTokenizer,
               parallel: bool) -> tuple[str, str]:
    """(the block's opening tag, Lark rules whose `rest` is everything after it to the end of the block)."""
    prefix, block = DIALECTS[fmt_name]
    closer = json.dumps(f"</{prefix}parameter>")
    text, terminal = text_until("PARAM_TEXT", f"</{prefix}parameter>", tokenizer)
    alts, rules = [], []
    for i, tool in enumerate(tools):
        name, params = tool_parts(tool)
        rules.append(_arguments(f"args{i}", prefix, params, text, closer))
        alts.append(f'{json.dumps(f"<{prefix}invoke name={json.dumps(name)}>")} "\\n" args{i} "\\n"? '
                    f'{json.dumps(f"</{prefix}invoke>")}')
    calls = 'invoke ("\\n" invoke)*' if parallel else "invoke"
    return (f"<{prefix}{block}>",
            f'rest: "\\n" {calls} "\\n" {_literal(f"</{prefix}{block}>", tokenizer)}\n'
            f"invoke: {' | '.join(f'({a})' for a in alts)}\n" + "".join(rules) + terminal
            + 'ANY_KEY: /[^\\s<>"]+/\n')


def dsml_builders() -> dict:
    """format name -> its call rules' builder (grammars.BUILDERS)."""
    return {name: (lambda tools, tokenizer, parallel, name=name: dsml_calls(name, tools, tokenizer, parallel))
            for name in DIALECTS}
