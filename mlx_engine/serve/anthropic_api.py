"""Anthropic's Messages API: POST /v1/messages (streamed and not) and /v1/messages/count_tokens. A thin
adapter: the body (any query string, such as Claude Code's `?beta=true`, and `anthropic-*` headers ignored)
becomes a Turn (turn.py), runner.py runs it, and the job's events come back as Anthropic's content blocks:
`thinking` (the reasoning), `text`, `tool_use` (the input as the parsed arguments object), with Anthropic's
stop_reason (end_turn, max_tokens, stop_sequence, tool_use) and usage; streamed as Anthropic's named
server-sent events (message_start, content_block_start / content_block_delta / content_block_stop per
block, message_delta, message_stop).

The translation to OpenAI's chat shapes, which turn.py renders: `system` (a string or text blocks) and any
system message later in `messages` (an OpenAI-style role "system" / "developer") folded into one leading
system message; an assistant's `tool_use` blocks into its tool_calls (arguments: the input as JSON, its
key order kept); a user's `tool_result` blocks into role "tool" messages, before the user's text of the
same message; an assistant's `thinking` into its reasoning_content (`redacted_thinking` dropped); `tools`
with `input_schema` into function tools (server tools such as web_search skipped, said in the log);
tool_choice auto / any / tool / none into auto / required / a named function / none;
`disable_parallel_tool_use`; `stop_sequences`; `thinking` enabled / disabled into the template's
enable_thinking; `output_config.format` (json_schema) into a response_format. Images and documents are
refused (400 naming the block), as is any block type this server does not know.

Errors on these routes are in Anthropic's envelope, {"type": "error", "error": {"type", "message"}}, with
the status the OpenAI routes give the same failure."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import aclosing
from typing import Literal, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool

from ..sampling import SamplingConfig
from ..toolcalls.stream import CallArgs, CallStart, Text
from .errors import APIError, anthropic_error_body as error_body, anthropic_error_response as error_response, \
    invalid_request
from .intake import parse, read_body
from .jobs import Done
from .keepalive import KEEPALIVE
from .runner import SHUTTING_DOWN, ClientLeft, check_model, events, start
from .schemas import NullIsDefault, check_text
from .turn import Turn, prepare

log = logging.getLogger("mlx_engine.serve")

PATH = "/v1/messages"
REFUSED_BLOCKS = ("image", "document", "search_result", "container_upload")
# -- the request body --------------------------------------------------------------------------------------
class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant", "system", "developer"]  # system / developer: folded into the system
    content: Union[str, list[dict]]


class CountBody(NullIsDefault):
    """/v1/messages/count_tokens: the Messages body without max_tokens (and without sampling)."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None  # the structured-outputs beta's name for output_config.format


class MessagesBody(CountBody):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API (cut to the context left, as everywhere)
    stop_sequences: list[str] = Field(default_factory=list)
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)  # the server's default: greedy, as on OpenAI's routes
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        return [check_text(s, "a stop sequence") for s in v]


# -- body -> Turn ------------------------------------------------------------------------------------------
def _text_of(blocks, where: str) -> str:
    """A string, or text blocks joined (anything else refused)."""
    if isinstance(blocks, str):
        return check_text(blocks, where)
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks")
    texts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            _refuse(kind, f"{where}[{j}]", "only text blocks are taken here")
        texts.append(_block_text(b, f"{where}[{j}]"))
    return "\n\n".join(texts)


def _block_text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: a text block needs a 'text' string", param="messages")
    return check_text(block["text"], where)


def _refuse(kind, where: str, why: str):
    if kind in REFUSED_BLOCKS:
        raise APIError(400, f"{where}: {kind} blocks are not supported: this server's model reads text only",
                       param="messages")
    raise APIError(400, f"{where}: content block type {kind!r} is not supported ({why})", param="messages")


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{where}: a tool_result block needs a 'tool_use_id' string", param="messages")
    content = block.get("content", "")
    text = _text_of(content, f"{where}.content") if content is not None else ""
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise APIError(400, f"{where}: a tool_use block needs 'id' and 'name' strings", param="messages")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}: a tool_use block's 'input' must be an object", param="messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def chat_messages(body: CountBody) -> list[dict]:
    """Anthropic's system and messages -> OpenAI's chat message dicts (turn.py's shape)."""
    system = [_text_of(body.system, "system")] if body.system else []
    out: list[dict] = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if m.role in ("system", "developer"):  # not leading, or not Anthropic's: folded into the system text
            system.append(_text_of(m.content, where))
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": check_text(m.content, where)})
            continue
        texts, calls, results, thinking = [], [], [], []
        for j, b in enumerate(m.content):
            at = f"{where}[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_block_text(b, at))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_tool_use(b, at))
            elif kind == "tool_result" and m.role == "user":
                results.append(_tool_result(b, at))
            elif kind == "thinking" and m.role == "assistant":
                if isinstance(b.get("thinking"), str) and b["thinking"]:
                    thinking.append(b["thinking"])
            elif kind == "redacted_thinking":
                continue  # encrypted by another server: nothing this model can read
            else:
                _refuse(kind, at, f"a {m.role} message takes text" +
                        (", tool_use and thinking blocks" if m.role == "assistant" else " and tool_result blocks"))
        out += results  # a turn's tool results come before its user text
        if m.role == "assistant":
            message = {"role": "assistant", "content": "\n\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            if thinking:
                message["reasoning_content"] = "\n\n".join(thinking)
            out.append(message)
        elif texts or not results:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    system = [s for s in system if s]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def function_tools(tools: list[dict]) -> list[dict]:
    """Anthropic's custom tools -> OpenAI function tools; server tools (web_search, bash, ...) skipped."""
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind not in (None, "custom"):
            log.info("anthropic: tools[%d] (%s %r) is a server tool, which this server does not run: skipped",
                     i, kind, t.get("name"))
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"tools[{i}] needs a 'name'", param="tools")
        if not isinstance(t.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}] ({t['name']!r}) needs an 'input_schema' object", param="tools")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("strict") is True:  # strict tool use: the call held to input_schema, also under auto
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice: dict | None, tools: list[dict]) -> tuple[str | dict, bool]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    choice = choice or {"type": "auto"}
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, f"tool_choice type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    if kind in ("any", "tool") and not tools:
        raise APIError(400, f"tool_choice {kind} forces a call but no tools are given", param="tool_choice")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice of type tool needs the tool's 'name'", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if not tools:
        return "none", parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def response_format(body: CountBody) -> dict | None:
    fmt = (body.output_config or {}).get("format") or body.output_format
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def template_kwargs(thinking: dict | None) -> dict:
    if not isinstance(thinking, dict) or "type" not in thinking:
        return {}
    return {"enable_thinking": thinking["type"] != "disabled"}  # enabled, adaptive: on


def messages_turn(body: CountBody) -> Turn:
    tools = function_tools(body.tools)
    choice, parallel = tool_choice(body.tool_choice, tools)
    turn = Turn(body.model, messages=chat_messages(body), tools=tools, tool_choice=choice,
                parallel_tool_calls=parallel, response_format=response_format(body),
                template_kwargs=template_kwargs(body.thinking))
    if isinstance(body, MessagesBody):
        try:
            turn.sampling = SamplingConfig(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        turn.max_tokens, turn.stop, turn.stream = body.max_tokens, body.stop_sequences, body.stream
        turn.named = frozenset(body.model_fields_set)
    return turn


# -- events -> Anthropic's shapes --------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    """The splitter's call id (call_<hex>) as Anthropic's (toolu_<hex>), the same hex; a model's own id
    (Kimi K2's functions.NAME:N) with the characters Anthropic's ids do not take as "_"."""
    return "toolu_" + re.sub(r"[^A-Za-z0-9_-]", "_", call_id.removeprefix("call_"))


def stop_reason(done: Done) -> tuple[str, str | None]:
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "stop":
        stop = getattr(done, "stop_sequence", None)
        return ("stop_sequence", stop) if stop else ("end_turn", None)
    return "max_tokens", None


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:  # cut off by max_tokens: the text streamed as it came, whole here it is none
        return {}
    return value if isinstance(value, dict) else {}


async def in_shape(http, work):
    """`await work()`, its errors answered in Anthropic's envelope (a bug logged with its traceback)."""
    try:
        return await work()
    except APIError as e:
        return error_response(e)
    except ValidationError as e:
        return error_response(invalid_request(e))
    except Exception as e:
        log.exception("anthropic: %s %s", http.method, http.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))


async def respond(http, service, arrived: float):
    async def queue():
        raw = await read_body(http, service.max_body_bytes)
        body = await run_in_threadpool(parse, raw, MessagesBody)
        turn = messages_turn(body)
        return turn, *await start(turn, service, "msg_", arrived, http)

    queued = await in_shape(http, queue)
    if not isinstance(queued, tuple):  # an error, answered
        return queued
    turn, job, prepared = queued
    message = {"id": job.name, "type": "message", "role": "assistant", "model": service.model_id}
    if turn.stream:
        return StreamingResponse(stream(job, message, len(prepared.prompt), http, service),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await complete(job, message, http, service)


async def complete(job, message: dict, http, service):
    content: list[dict] = []
    args: dict[int, str] = {}  # a call's index -> its arguments' text so far
    blocks: dict[int, dict] = {}  # a call's index -> its tool_use block
    try:
        async with aclosing(events(job, http, service.worker.cancel)) as evs:
            async for event in evs:
                if isinstance(event, Text):
                    kind, key = ("thinking", "thinking") if event.kind == "reasoning" else ("text", "text")
                    if not content or content[-1]["type"] != kind:
                        content.append({"type": kind, key: ""} | ({"signature": ""} if kind == "thinking" else {}))
                    content[-1][key] += event.text
                elif isinstance(event, CallStart):
                    blocks[event.index] = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name,
                                           "input": {}}
                    args[event.index] = ""
                    content.append(blocks[event.index])
                elif isinstance(event, CallArgs):
                    args[event.index] += event.text
                elif isinstance(event, Done):
                    done = event
    except ClientLeft:
        return error_response(APIError(499, "client disconnected"))
    except asyncio.CancelledError:  # the server is shutting down past --shutdown-timeout: say so
        return error_response(SHUTTING_DOWN)
    except APIError as e:
        return error_response(e)
    for index, block in blocks.items():
        block["input"] = tool_input(args[index])
    reason, stop = stop_reason(done)
    return {**message, "content": content, "stop_reason": reason, "stop_sequence": stop,
            "usage": usage(done), "speculation": done.speculation}


def usage(done: Done) -> dict:
    """Anthropic's usage: its three input counts add up to the prompt, as its clients sum them (Claude Code sizes
    its context by input_tokens + cache_creation_input_tokens + cache_read_input_tokens): `cache_read_input_tokens`
    the prompt tokens the engine reused (prefix cache, previous turn), `input_tokens` the ones it prefilled.
    `cache_creation_input_tokens` stays 0: reporting the prefilled tokens there as well would count them twice."""
    return {"input_tokens": done.prompt_tokens - done.cached_tokens, "output_tokens": done.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": done.cached_tokens}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def stream(job, message: dict, prompt_tokens: int, http, service):
    open_block: tuple[str, int] | None = None  # (kind, call index or -1) of the block being written
    index = -1  # the open block's index in the message's content

    def close() -> list[str]:
        nonlocal open_block
        if open_block is None:
            return []
        open_block = None
        return [sse({"type": "content_block_stop", "index": index})]

    def begin(block: dict, key: tuple[str, int]) -> list[str]:
        nonlocal open_block, index
        out = close()
        index += 1
        open_block = key
        return out + [sse({"type": "content_block_start", "index": index, "content_block": block})]

    try:
        yield sse({"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
        yield sse({"type": "ping"})
        async with aclosing(events(job, http, service.worker.cancel, getattr(service, "keepalive", None))) as evs:
            async for event in evs:
                out: list[str] = []
                if event is KEEPALIVE:  # nothing from the engine for a while (queued, prefilling): the API's ping
                    out.append(sse({"type": "ping"}))
                elif isinstance(event, Text):
                    if event.kind == "reasoning":
                        if open_block != ("thinking", -1):
                            out += begin({"type": "thinking", "thinking": "", "signature": ""}, ("thinking", -1))
                        out.append(sse({"type": "content_block_delta", "index": index,
                                        "delta": {"type": "thinking_delta", "thinking": event.text}}))
                    else:
                        if open_block != ("text", -1):
                            out += begin({"type": "text", "text": ""}, ("text", -1))
                        out.append(sse({"type": "content_block_delta", "index": index,
                                        "delta": {"type": "text_delta", "text": event.text}}))
                elif isinstance(event, CallStart):
                    out += begin({"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}},
                                 ("tool_use", event.index))
                elif isinstance(event, CallArgs):
                    if open_block == ("tool_use", event.index) and event.text:
                        out.append(sse({"type": "content_block_delta", "index": index,
                                        "delta": {"type": "input_json_delta", "partial_json": event.text}}))
                elif isinstance(event, Done):
                    out += close()
                    reason, stop = stop_reason(event)
                    out.append(sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                                    "usage": usage(event),  # cumulative: the cache's share known now
                                    "speculation": event.speculation}))
                    out.append(sse({"type": "message_stop"}))
                for line in out:
                    yield line
    except ClientLeft:
        return
    except APIError as e:  # the job failed: an error event ends the stream
        yield sse(error_body(e.status, e.message))
    except asyncio.CancelledError:  # shutting down past --shutdown-timeout: say so
        yield sse(error_body(SHUTTING_DOWN.status, SHUTTING_DOWN.message))
    finally:  # the client went away (the generator is closed) or the stream ended: stop the job
        service.worker.cancel(job)


async def count_tokens(http, service):
    """The prompt's length as the engine would see it, through the same translation and template; nothing
    is generated (a forced tool call's grammar is not compiled: the prompt does not depend on it)."""
    async def count():
        raw = await read_body(http, service.max_body_bytes)
        body = await run_in_threadpool(parse, raw, CountBody)
        turn = messages_turn(body)
        check_model(turn.model, service)
        if turn.tool_choice != "none":
            turn.tool_choice = "auto"
        turn.response_format = None
        prepared = await run_in_threadpool(prepare, turn, service.tokenizer, service.vocab_size)
        return {"input_tokens": len(prepared.prompt)}

    return await in_shape(http, count)


def install(app, service) -> None:
    """The Messages API's routes on the app (a query string, such as `?beta=true`, is ignored)."""

    @app.post(PATH)
    async def messages(http: HTTPRequest):
        return await respond(http, service, arrived=time.perf_counter())

    @app.post(PATH + "/count_tokens")
    async def messages_count_tokens(http: HTTPRequest):
        return await count_tokens(http, service)
