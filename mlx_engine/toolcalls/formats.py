"""How a model family writes tool calls: the text that opens and closes them, how the text between parses
into calls, and whether the model's own chat template renders tools and calls.

- `json`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Hermes,
  Qwen2.5/3, Qwen3-Next, MiMo, SmolLM3; mlx-lm's json_tools). Also the generic form, for a template with
  no tool section (the embedded SmolLM2): the server then describes the tools in the system message
  (grammar/requests.tools_system_text) and renders earlier calls and results itself.
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (DeepSeek-V3, R1), and V3.1's `<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- `llama3_json`: the whole answer one JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling).
- `function_gemma`: `<start_function_call>call:NAME{key:<escape>text<escape>,key:3}<end_function_call>` per call
  (FunctionGemma), read by `parse_function_gemma`.
- any of mlx-lm's own parsers (mlx_lm/tool_parsers: qwen3_coder, glm47, kimi_k2, mistral, pythonic,
  minimax_m2, gemma4, ...), by the name the checkpoint gives (tokenizer_config.json's `tool_parser_type`),
  else the one mlx-lm infers from the template, where they read their family right (detect.py picks the
  reader of our own for each family they misread: one module per family).

Arguments are kept as the text the model wrote (key order included): a history sent back with reordered
keys would not match the cached prefix.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from typing import Callable

from ..grammar.requests import definitions, local_ref
from ..grammar.spec import GrammarError

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PYTHON_TAG = "<|python_tag|>"
FG_CALL_START, FG_CALL_END, FG_ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"


class ToolCallError(ValueError):
    """Text between a format's markers that is not a call."""


class UnwritableCall(GrammarError):
    """A call of a tool that a family's format cannot write (LFM2's pythonic calls: a name that is no Python
    identifier): a forced call is refused; under tool_choice auto the answer is parsed, not constrained."""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the JSON text of the arguments, as written
    id: str | None = None  # the model's own id of the call (Kimi K2's `functions.NAME:N`), where it writes one


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text that opens a call (a block of calls); "" = the whole answer (llama3_json)
    end: str  # the text that closes it; "" = the end of the answer
    native: bool  # the model's chat template renders tools, calls and results
    parse: Callable[[str, list], list[Call]]  # the text between start and end -> its calls
    markers: tuple[str, ...] = ()  # every other text its parser reads (kept where the tokenizer has it special)
    reader: Callable | None = None  # its own stream reader (reader(fmt, think, reasoning, tools)), else Splitter


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _raw_value(text: str, key: str) -> str | None:
    """The JSON text of `key`'s value in the object `text`, as written (None when absent)."""
    m = re.search(r'"' + re.escape(key) + r'"\s*:\s*', text)
    if m is None:
        return None
    end = json_value_end(text, m.end())
    return text[m.end() : end] if end is not None else None


def json_value_end(text: str, at: int) -> int | None:
    """Where the JSON value starting at `at` (after whitespace) ends, or None if `text` ends first."""
    i = at
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text):
        return None
    depth, in_string, escaped = 0, False, False
    first = text[i]
    if first not in "{[\"":  # a number, true, false, null
        m = re.compile(r"[^,}\]\s]*").match(text, i)
        return m.end() if m.end() < len(text) else None
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def parse_json_call(body: str, tools=None) -> list[Call]:
    """`{"name": ..., "arguments": {...}}` (or "parameters"), the arguments' text kept as written."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"a tool call that is not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError("a tool call without a name")
    key = "arguments" if "arguments" in obj else "parameters"
    raw = _raw_value(body, key)
    args = obj.get(key, {})
    if isinstance(args, str):  # arguments sent as a JSON string
        return [Call(obj["name"], args)]
    return [Call(obj["name"], raw if raw is not None else _json_text(args))]


def parse_deepseek(block: str, tools=None) -> list[Call]:
    """DeepSeek V3 / R1's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>` and
    V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` per call (their chat templates; vLLM's
    deepseekv3 / deepseekv31 tool parsers), read in order: each call's arguments to the end of their JSON
    object, so marker text inside a string value is part of the value, never the call's end."""
    calls, pos = [], 0
    while (pos := _skip_space(block, pos)) < len(block):
        if not block.startswith(DS_CALL_BEGIN, pos):
            raise ToolCallError("a DeepSeek tool-call block with text that is no call")
        sep = block.find(DS_SEP, pos)
        if sep < 0:
            raise ToolCallError("a DeepSeek tool call without its separator")
        head, pos = block[pos + len(DS_CALL_BEGIN) : sep], sep + len(DS_SEP)
        if head.strip() == "function":  # V3 / R1: function<sep>NAME\n```json\n{...}\n```
            line = block.find("\n", pos)
            name, pos = (block[pos:line], line) if line >= 0 else (block[pos:], len(block))
            pos = _DS_FENCE_OPEN.match(block, pos).end()
        else:  # V3.1: NAME<sep>{...}
            name = head
        end = json_value_end(block, pos)
        body = block[pos:end].strip() if end is not None else ""
        try:
            args = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"DeepSeek tool call arguments that are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise ToolCallError("DeepSeek tool call arguments that are no JSON object")
        pos = _DS_FENCE_CLOSE.match(block, end).end() if head.strip() == "function" else end
        pos = _skip_space(block, pos)
        if not block.startswith(DS_CALL_END, pos):
            raise ToolCallError("a DeepSeek tool call not closed after its arguments")
        pos += len(DS_CALL_END)
        calls.append(Call(name.strip(), body))
    if not calls:
        raise ToolCallError("a DeepSeek tool-call block without calls")
    return calls


_DS_FENCE_OPEN, _DS_FENCE_CLOSE = re.compile(r"\s*```(?:json)?\s*"), re.compile(r"\s*```")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def parse_llama3(text: str, tools=None) -> list[Call]:
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    calls = []
    for piece in [p for p in re.split(r";\s*(?=\{)", text) if p.strip()]:  # several calls: "; "-separated
        calls += parse_json_call(piece, tools)
    return calls


def parse_function_gemma(body: str, tools=None) -> list[Call]:
    """FunctionGemma's `call:NAME{key:VALUE,...}`: strings between `<escape>` marks, keys bare, the other values
    (numbers, true / false / null, `[...]`, `{k:v}`) as JSON writes them; read by quoting keys and strings into
    JSON (mlx-lm's own parser reads scalars only and cuts a string at its first `}`)."""
    m = re.fullmatch(r"\s*call:([\w.-]+)(\{.*\})\s*", body, re.DOTALL)
    if m is None:
        raise ToolCallError("function_gemma: no call:NAME{...}")
    parts = m.group(2).split(FG_ESCAPE)
    if len(parts) % 2 == 0:
        raise ToolCallError("function_gemma: a string without its closing <escape>")
    text = "".join(json.dumps(p) if i % 2 else re.sub(r"(?<=[{,])\s*([A-Za-z_]\w*)\s*:", r'"\1":', p)
                   for i, p in enumerate(parts))
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"function_gemma: arguments that do not read as values: {e}") from None
    return [Call(m.group(1), _json_text(arguments))]


JSON = ToolFormat("json", "<tool_call>", "</tool_call>", True, parse_json_call)
GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", False, parse_json_call)
DEEPSEEK = ToolFormat("deepseek_v3", DS_CALLS_BEGIN, DS_CALLS_END, True, parse_deepseek)


FUNCTION_GEMMA = ToolFormat("function_gemma", FG_CALL_START, FG_CALL_END, True, parse_function_gemma)


def mlx_lm_format(module_name: str) -> ToolFormat:
    """One of mlx-lm's tool parsers (mlx_lm/tool_parsers/NAME.py), as a format."""
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")

    def parse(body: str, tools=None) -> list[Call]:
        try:
            out = mod.parse_tool_call(body, _refs_resolved(tools) if tools else tools)
        except Exception as e:  # each parser raises its own errors on text that is not a call
            raise ToolCallError(f"{module_name}: {e}") from None
        out = out if isinstance(out, list) else [out]
        return [Call(c["name"], _json_text(c.get("arguments", {})), c["id"] if isinstance(c.get("id"), str) else None)
                for c in out]

    return ToolFormat(module_name, mod.tool_call_start, mod.tool_call_end, True, parse)


def _refs_resolved(tools: list) -> list:
    """`tools` with each parameter that is a local $ref ("#/$defs/X", "#/definitions/X") replaced by the schema
    it names: mlx-lm's parsers read a parameter's type to convert its text, and some read no $ref (MiniMax's
    would keep a referenced object as a string)."""
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if not isinstance(params, dict) or not isinstance(params.get("properties"), dict):
            out.append(tool)
            continue
        props, defs = {}, definitions(params)
        for key, schema in params["properties"].items():
            named = local_ref(schema.get("$ref"), defs) if isinstance(schema, dict) else None
            if named is not None:
                schema = {**named, **{k: v for k, v in schema.items() if k != "$ref"}}
            props[key] = schema
        out.append({**tool, "function": {**fn, "parameters": {**params, "properties": props}}})
    return out
