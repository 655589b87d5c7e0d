"""A conversation with tools, as the model reads it: through its own chat template when the template has a
tool section, else in the generic form (the tools described in the system message, earlier calls written
as `<tool_call>` blocks in the assistant's text, results as `<tool_response>` blocks in a user message).
A family whose template renders an assistant's content only, never its `tool_calls` (LFM2's: its calls
are text the model wrote), gets its earlier calls written into the content as the model writes them
(`CALL_WRITERS`), or its history would show turns that called nothing.

Messages are OpenAI's chat shapes as dicts: {"role", "content", "tool_calls": [{"id", "function":
{"name", "arguments"}}], "tool_call_id", "name", "reasoning_content"}. A call's arguments reach the template
as the object the model wrote, its key order kept (json.loads keeps it), so the history renders as it was
generated and the prefix cache still matches.
"""

from __future__ import annotations

import json
import re

from ..grammar.requests import CALL_CLOSE, CALL_OPEN, tools_system_text
from .formats import ToolFormat

RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
KIMI_ID = re.compile(r"functions\.[^:\s]+:\d+")  # Kimi K2's own call ids: functions.NAME:N


def _arguments(text):
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # the client's own text: passed as it is


def _kimi_ids(messages: list[dict]) -> list[dict]:
    """Kimi K2's template writes each call's id into the prompt, in the call and in `## Return of ID` before
    its result; the model writes `functions.NAME:N` (N: the conversation's running call index), the id the
    client gets back. An id of another form (a client's `call_...`, Anthropic's `toolu_...`, a history from
    another model) is rewritten in that form, the same in the call and in the results that name it; the
    model's own ids are kept (the rewrite depends on the history alone, so the prefix cache still matches)."""
    renamed, n, out = {}, 0, []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                cid = c.get("id")
                if not (isinstance(cid, str) and KIMI_ID.fullmatch(cid)):
                    new = f"functions.{c['function']['name']}:{n}"
                    if isinstance(cid, str):
                        renamed.setdefault(cid, new)
                    c = {**c, "id": new}
                calls.append(c)
                n += 1
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:
            m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
        out.append(m)
    return out


def _python_literal(value) -> str:
    """A JSON value as a Python literal (strings double-quoted, as LFM2's models write them)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def pythonic_text(fmt: ToolFormat, calls: list[dict]) -> str:
    """Calls as LFM2's models write them: `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`."""
    out = []
    for c in calls:
        args = _arguments(c["function"].get("arguments") or "{}")
        body = (", ".join(f"{k}={_python_literal(v)}" for k, v in args.items()) if isinstance(args, dict)
                else str(args))  # (the client's own text: as it is)
        out.append(f"{c['function']['name']}({body})")
    return f"{fmt.start}[{', '.join(out)}]{fmt.end}"


CALL_WRITERS = {"pythonic": pythonic_text}  # format -> its calls as text, for a template that renders content only


def _calls_into_content(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """Each assistant message's calls written before its content, as the model writes them (its model card's
    turns open with the call)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = CALL_WRITERS[fmt.name](fmt, m["tool_calls"]) + (m.get("content") or "")
            m = {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": text}
        out.append(m)
    return out


def _native(messages: list[dict], as_text: bool) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": (c["function"].get("arguments") or "{}") if as_text
                                             else _arguments(c["function"].get("arguments", "{}"))}}
                               for c in m["tool_calls"]]
            m.setdefault("content", "")
        out.append(m)
    return out


def _generic(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            text = f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"
            if out and out[-1]["role"] == "user" and out[-1]["content"].endswith(RESULT_CLOSE):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}  # results of one turn
            else:
                out.append({"role": "user", "content": text})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [f'{CALL_OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                     f'{c["function"].get("arguments") or "{}"}}}\n{CALL_CLOSE}' for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    if tools:
        section = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def template_input(messages: list[dict], fmt: ToolFormat, tools: list[dict] | None,
                   arguments_as_text: bool = False, template: str | None = None) -> tuple[list[dict], dict]:
    """(the messages for the chat template, its extra arguments): `tools` for a native template; none given
    (tool_choice "none") renders the calls and results of the history all the same. A call's arguments go
    to the template as an object (transformers' convention, Qwen's and Llama's templates) or, when
    `arguments_as_text`, as the JSON text (DeepSeek-V3's template concatenates them as a string).
    `template`: the chat template's text; one that never reads `tool_calls` gets the calls in the content
    (CALL_WRITERS)."""
    if fmt.native and fmt.name in CALL_WRITERS and isinstance(template, str) and "tool_calls" not in template:
        messages = _calls_into_content(messages, fmt)
    if fmt.native:
        native = _native(messages, arguments_as_text)
        return (_kimi_ids(native) if fmt.name == "kimi_k2" else native), ({"tools": tools} if tools else {})
    return _generic(messages, tools), {}
