"""Grammars from what users send: an OpenAI `response_format`, the CLI's `--grammar`. Each compiles against
the model's tokenizer or raises GrammarError naming what is wrong.

And the pieces of the generic tool-call form a template without a tool section gets (docs/tool-calls.md):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (its markers, one call's schema,
the system text that shows the tools); a call's grammar in each family's format is toolcalls/grammars.py's.
Where the tokenizer holds a marker as one special token (Qwen's `<tool_call>`), `_literal` names that token,
so the model writes it as it was trained to, not spelled out in pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance

from .spec import Grammar, GrammarError, json_object, json_schema, lark, regex

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def from_response_format(fmt: dict | None, tokenizer: llguidance.LLTokenizer) -> Grammar | None:
    """OpenAI's response_format: text (None), json_object, json_schema {name, schema, strict}; and two
    extensions, {"type": "regex", "regex": ...} and {"type": "lark", "lark": ...}."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(tokenizer)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError("response_format json_schema needs a 'json_schema' object with a 'schema'")
        return json_schema(spec["schema"], tokenizer, spec.get("name"))
    if kind in ("regex", "lark"):
        text = fmt.get(kind)
        if not isinstance(text, str) or not text:
            raise GrammarError(f"response_format {kind} needs a '{kind}' string")
        return regex(text, tokenizer) if kind == "regex" else lark(text, tokenizer)
    raise GrammarError(f"response_format type {kind!r} is not supported: text, json_object, json_schema, regex, lark")


def from_flag(value: str, tokenizer: llguidance.LLTokenizer) -> Grammar:
    """The CLI's --grammar: `json` (any object), `json:FILE` (a JSON schema), `regex:PATTERN`, `lark:FILE`."""
    kind, _, rest = value.partition(":")
    if kind == "json" and not rest:
        return json_object(tokenizer)
    if kind == "regex" and rest:
        return regex(rest, tokenizer)
    if kind in ("json", "lark") and rest:
        path = Path(rest).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise GrammarError(f"--grammar {kind}: cannot read {path}: {e.strerror}") from None
        return json_schema(text, tokenizer, path.name) if kind == "json" else lark(text, tokenizer)
    raise GrammarError(f"--grammar {value!r}: expected json, json:SCHEMA_FILE, regex:PATTERN or lark:FILE")


def tools_system_text(tools: list[dict]) -> str:
    """The generic form's tool section, for a system message: each tool's name, description and parameters,
    and how to call one."""
    lines = ["You can call these tools. Each is given as JSON: its name, what it does, and the JSON schema of "
             "its arguments."]
    for t in tools:
        fn = t.get("function", t)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}))
    lines.append(f'To call a tool, answer with {CALL_OPEN}\n{{"name": <the tool\'s name>, "arguments": '
                 f'<its arguments as JSON>}}\n{CALL_CLOSE}')
    return "\n".join(lines)


def _literal(text: str, tokenizer: llguidance.LLTokenizer) -> str:
    """A Lark item for `text`: the special token when the tokenizer has it as one, else the string."""
    ids = tokenizer.tokenize_str(text)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_parts(tool: dict) -> tuple[str, dict]:
    """(an OpenAI function tool's name, its parameters' schema), checked."""
    fn = tool.get("function", tool)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("a tool has no function name")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise GrammarError(f"tool {name!r}: parameters must be a JSON schema object")
    return name, params


def definitions(params: dict) -> dict:
    """A parameters schema's named definitions, under the key(s) it keeps them: {"$defs": ..., "definitions": ...}."""
    return {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}


def local_ref(ref, defs: dict) -> dict | None:
    """The schema a local $ref ("#/$defs/X", "#/definitions/X") names in `defs` (definitions()), or None."""
    parts = ref.split("/") if isinstance(ref, str) else []
    named = defs.get(parts[1], {}).get(parts[2]) if len(parts) == 3 and parts[0] == "#" else None
    return named if isinstance(named, dict) else None
