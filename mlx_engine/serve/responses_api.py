"""OpenAI's Responses API, `POST /v1/responses` (the one API Codex CLI speaks): a request body into a Turn
(turn.py), and the job's events (runner.py) back into a Response object, whole or as the API's server-sent
events. A thin adapter: no generation of its own; the chat completions adapter (openai_api.py) is its twin.

Taken: `input` as a string or items (messages with role user / assistant / system / developer and text
content or `input_text` / `output_text` parts; `function_call` items -> the assistant's `tool_calls`;
`function_call_output` items -> `tool` messages; `reasoning` items -> the next assistant message's
`reasoning_content`), `instructions` (a leading system message), function `tools` (other tool types are
skipped, with a line in the server's log: this server runs no web search, file search or computer),
`tool_choice` (none / auto / required / a function / allowed_tools), `parallel_tool_calls`,
`max_output_tokens`, `temperature`, `top_p`, `reasoning.effort` (the template's `reasoning_effort`),
`text.format` (json_schema, json_object: held by the grammar). Accepted and ignored: `include`, `store`,
`metadata`, `prompt_cache_key`, `user`, `truncation`, `service_tier` and the other fields that do not
change the answer. Refused (400): `previous_response_id`, `conversation`, `prompt` and `item_reference`
items (this server is stateless: it keeps no responses, so the whole conversation comes in `input`),
`background`, and image / file / audio parts (a text model).

The answer's output items: a `reasoning` item (content `reasoning_text`) where the model reasoned, a
`message` item (`output_text`) where it wrote content, a `function_call` item per call; status
`incomplete` (incomplete_details.reason `max_output_tokens`) when the answer was cut at the limit.
Streamed, the same items are built by the same code (`Output` below), each event with its
`sequence_number`: response.created, response.in_progress, then per item output_item.added,
(content_part.added, output_text.delta | reasoning_text.delta ..., *.done, content_part.done) or
function_call_arguments.delta ... .done, output_item.done; then response.completed (or
response.incomplete; response.failed when the job failed)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Union

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, field_validator

from ..sampling import SamplingConfig
from ..toolcalls.stream import CallArgs, CallStart, Text
from .errors import APIError, error_body, error_response
from .intake import parse, read_body
from .jobs import Done
from .keepalive import KEEPALIVE, SSE_COMMENT
from .runner import SHUTTING_DOWN, ClientLeft, events, start
from .schemas import StopSeedDraft, Unsupported, check_text
from .turn import Turn

log = logging.getLogger("mlx_engine.serve")

STATELESS = ("this server is stateless: it stores no responses or conversations, so send the whole "
             "conversation in `input` (the earlier turns' output items included)")
TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# -- the request ------------------------------------------------------------------------------------

class ResponsesRequest(StopSeedDraft):
    model: str | None = None
    input: Union[str, list[dict]]
    instructions: str | None = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    reasoning: dict | None = None
    text: dict | None = None
    stream: bool = False
    # extensions, as on chat completions
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    chat_template_kwargs: dict = Field(default_factory=dict)
    # state this server does not keep: refused
    previous_response_id: str | None = None
    conversation: Union[str, dict, None] = None
    prompt: dict | None = None
    background: bool | None = None
    # accepted, echoed in the response, no effect on the answer
    metadata: dict | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # include, store, truncation, service_tier, safety_identifier, stream_options, ...: ignored (extra)

    @field_validator("previous_response_id")
    @classmethod
    def _no_previous(cls, v):
        raise Unsupported(f"previous_response_id is not supported: {STATELESS}")

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_stored(cls, v, info):
        raise Unsupported(f"{info.field_name} (a stored {info.field_name}) is not supported: {STATELESS}")

    @field_validator("background")
    @classmethod
    def _no_background(cls, v):
        if v:
            raise Unsupported("background is not supported: this server keeps no responses to poll; send the "
                              "request with stream true or wait for its answer")
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        if isinstance(v, str):
            check_text(v, "input")
        if not v:
            raise ValueError("input is empty: send the conversation as a string or a list of items")
        return v


    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty)

    @property
    def effort(self) -> str | None:
        return (self.reasoning or {}).get("effort")


def _bad(message: str, param: str = "input", unsupported: bool = False) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter" if unsupported else None)


def _checked(text, where: str) -> str:
    if not isinstance(text, str):
        raise _bad(f"{where} must be a string")
    try:
        return check_text(text, where)
    except ValueError as e:
        raise _bad(str(e)) from None


def _content_text(content, where: str) -> str:
    """A message's content (a string or parts) as text; a part that is not text is refused, named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _checked(content, f"{where}.content")
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            out.append(_checked(part.get("text"), f"{where}.content[{j}].text"))
        elif kind == "refusal":
            out.append(_checked(part.get("refusal"), f"{where}.content[{j}].refusal"))
        else:
            raise _bad(f"{where}.content[{j}] is of type {kind!r}: only text parts (input_text, output_text) are "
                       f"supported; this server serves a text model", unsupported=True)
    return "".join(out)


def _reasoning_text(item: dict) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def conversation(body: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as OpenAI chat messages (turn.py's shape)."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": _checked(body.instructions, "instructions")})
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    reasoning = ""  # a reasoning item's text, for the assistant message that follows it

    def assistant() -> dict:
        """The assistant message a function call joins: the last message when it is the assistant's."""
        nonlocal reasoning
        if messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        messages.append({"role": "assistant", "content": ""})
        if reasoning:
            messages[-1]["reasoning_content"], reasoning = reasoning, ""
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object (a message or an item)")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            text = _content_text(item.get("content"), where)
            if role == "assistant":
                messages.append({"role": "assistant", "content": text})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name:
                raise _bad(f"{where} (a function_call) needs a 'name'")
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where} (a function_call) needs a 'call_id'")
            if not isinstance(args, str):
                args = json.dumps(args)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": _checked(args, f"{where}.arguments")}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where} (a function_call_output) needs a 'call_id'")
            output = item.get("output")
            text = _checked(output, f"{where}.output") if isinstance(output, str) else \
                _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                reasoning = f"{reasoning}\n{text}" if reasoning else text
        elif kind == "item_reference":
            raise _bad(f"{where} is an item_reference, which is not supported: {STATELESS}", unsupported=True)
        else:
            raise _bad(f"{where} is of type {kind!r}, which is not supported: items are messages, function_call, "
                       f"function_call_output and reasoning", unsupported=True)
    # a leading system message per instruction, developer message, ...: one (templates take one, first)
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    if lead > 1:
        joined = "\n\n".join(m["content"] for m in messages[:lead] if m["content"])
        messages[:lead] = [{"role": "system", "content": joined}]
    if not any(m["role"] != "system" for m in messages):
        raise _bad("input holds no user message: nothing to answer")
    return messages


def function_tools(tools: list[dict]) -> list[dict]:
    """Function tools in chat completions' shape; every other tool type is skipped, with a log line."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            log.warning("responses: tools[%d] of type %r skipped: this server serves function tools only",
                        i, kind)
            continue
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}] (a function) needs a 'name'", param="tools")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].parameters must be a JSON schema object", param="tools")
        fn = {"name": name}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if params is not None:
            fn["parameters"] = params
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice, tools: list[dict]) -> tuple[str | dict, list[dict]]:
    """(tool_choice in chat completions' shape, the tools it leaves)."""
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            if not isinstance(choice.get("name"), str):
                raise _bad("tool_choice names a function as {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif kind == "allowed_tools":
            names = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)
                     and t.get("type") == "function"}
            tools = [t for t in tools if t["function"]["name"] in names]
            choice = choice.get("mode", "auto")
        else:
            raise _bad(f"tool_choice of type {kind!r} is not supported: this server serves function tools only",
                       param="tool_choice", unsupported=True)
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be none, auto, required or a function, got {choice!r}", param="tool_choice")
    if not tools:
        if choice not in ("none", "auto"):
            raise _bad("tool_choice forces a call but no function tools are given", param="tool_choice")
        return "none", []
    return choice, tools


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format json_schema needs a 'schema' object", param="text")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format of type {kind!r} is not supported: text, json_schema or json_object", param="text",
               unsupported=True)


def responses_turn(body: ResponsesRequest, model: str) -> Turn:
    tools = function_tools(body.tools)
    choice, tools = chat_tool_choice(body.tool_choice, tools)
    kwargs = dict(body.chat_template_kwargs)
    if body.effort is not None:
        kwargs.setdefault("reasoning_effort", body.effort)
    try:
        sampling = body.sampling()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return Turn(body.model or model, messages=conversation(body), tools=tools, tool_choice=choice,
                parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(body.text),
                template_kwargs=kwargs, sampling=sampling, max_tokens=body.max_output_tokens, stop=body.stop,
                seed=body.seed, num_draft=body.num_draft, stream=body.stream, named=frozenset(body.model_fields_set))


# -- the answer -------------------------------------------------------------------------------------

class Output:
    """The response's output items as the job's events build them, and the stream events that say so (the
    answer whole is the same items: one path for both)."""

    def __init__(self):
        self.items: list[dict] = []
        self.calls: dict[int, dict] = {}  # a call's index (toolcalls.stream) -> its item
        self.open: dict | None = None  # the item being written
        self.seq = 0

    def event(self, type_: str, **fields) -> dict:
        out = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def feed(self, ev) -> list[dict]:
        out: list[dict] = []
        if isinstance(ev, Text):
            kind = "reasoning" if ev.kind == "reasoning" else "message"
            if self.open is None or self.open["type"] != kind:
                out += self._close()
                out += self._open_text(kind)
            item = self.open
            item["content"][0]["text"] += ev.text
            where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            if kind == "message":
                out.append(self.event("response.output_text.delta", **where, delta=ev.text, logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.delta", **where, delta=ev.text))
        elif isinstance(ev, CallStart):
            out += self._close()
            item = {"type": "function_call", "id": _new_id("fc_"), "call_id": ev.id, "name": ev.name,
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            self.calls[ev.index], self.open = item, item
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        elif isinstance(ev, CallArgs):
            item = self.calls[ev.index]
            item["arguments"] += ev.text
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self._index(item), delta=ev.text))
        return out

    def _open_text(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"type": "message", "id": _new_id("msg_"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item))),
               self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                          part=dict(part))]
        item["content"].append(part)
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, out = self._index(item), []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", **where, text=part["text"], logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
            out.append(self.event("response.content_part.done", **where, part=dict(part)))
        out.append(self.event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))
        return out

    def finish(self, done: Done) -> list[dict]:
        """The last item closed: `incomplete` when the answer was cut at max_output_tokens."""
        return self._close("incomplete" if cut(done) else "completed")

    def text(self, kind: str = "message") -> str:
        return "".join(p["text"] for it in self.items if it["type"] == kind for p in it["content"])


def cut(done: Done) -> bool:
    return done.finish_reason not in ("stop", "tool_calls")


class Reply:
    """The Response object around the output: the request's settings echoed, the status, the usage."""

    def __init__(self, job, body: ResponsesRequest, service):
        self.service = service
        self.base = {
            "id": job.name, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": service.model_id, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": body.effort, "summary": None}, "service_tier": "default", "store": False,
            "temperature": body.temperature, "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice, "tools": [t for t in body.tools if t.get("type") == "function"],
            "top_p": body.top_p, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {},
        }

    def snapshot(self) -> dict:
        return dict(self.base)

    def final(self, output: Output, done: Done) -> dict:
        out = dict(self.base)
        reasoning = output.text("reasoning")
        reasoning_tokens = min(len(self.service.tokenizer.encode(reasoning, add_special_tokens=False)),
                               done.completion_tokens) if reasoning else 0
        out.update(status="incomplete" if cut(done) else "completed", completed_at=int(time.time()),
                   output=output.items, output_text=output.text(),
                   incomplete_details={"reason": "max_output_tokens"} if cut(done) else None,
                   usage={"input_tokens": done.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": done.cached_tokens, "cache_write_tokens": 0},
                          "output_tokens": done.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                          "total_tokens": done.prompt_tokens + done.completion_tokens},
                   speculation=done.speculation)
        return out

    def failed(self, output: Output, e: APIError) -> dict:
        out = dict(self.base)
        out.update(status="failed", output=output.items, error={"code": e.code or "server_error", "message": e.message})
        return out


async def respond(http, service, arrived: float):
    from starlette.concurrency import run_in_threadpool

    raw = await read_body(http, service.max_body_bytes)
    body = await run_in_threadpool(parse, raw, ResponsesRequest)
    turn = responses_turn(body, service.model_id)
    job, _ = await start(turn, service, "resp_", arrived, http)
    reply = Reply(job, body, service)
    if turn.stream:
        return StreamingResponse(stream(job, reply, http, service), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await complete(job, reply, http, service)


async def complete(job, reply: Reply, http, service):
    output = Output()
    try:
        async with aclosing(events(job, http, service.worker.cancel)) as evs:
            async for event in evs:
                if isinstance(event, Done):
                    output.finish(event)
                    return reply.final(output, event)
                output.feed(event)
    except ClientLeft:
        return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
    except asyncio.CancelledError:  # the server is shutting down past --shutdown-timeout: say so
        return error_response(SHUTTING_DOWN)


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def stream(job, reply: Reply, http, service):
    output = Output()
    try:
        yield sse(output.event("response.created", response=reply.snapshot()))
        yield sse(output.event("response.in_progress", response=reply.snapshot()))
        async with aclosing(events(job, http, service.worker.cancel, getattr(service, "keepalive", None))) as evs:
            async for event in evs:
                if event is KEEPALIVE:  # nothing from the engine for a while (queued, prefilling): a comment line
                    yield SSE_COMMENT
                    continue
                if isinstance(event, Done):
                    for e in output.finish(event):
                        yield sse(e)
                    final = reply.final(output, event)
                    kind = "response.incomplete" if cut(event) else "response.completed"
                    yield sse(output.event(kind, response=final))
                    return
                for e in output.feed(event):
                    yield sse(e)
    except ClientLeft:
        return
    except APIError as e:  # the job failed: response.failed, then the end of the stream
        yield sse(output.event("response.failed", response=reply.failed(output, e)))
    except asyncio.CancelledError:  # shutting down past --shutdown-timeout: say so
        yield sse(output.event("response.failed", response=reply.failed(output, SHUTTING_DOWN)))
    finally:  # the client went away (the generator is closed) or the stream ended: stop the job
        service.worker.cancel(job)


def install(app, service) -> None:
    @app.post("/v1/responses")
    async def responses(http: HTTPRequest):
        return await respond(http, service, arrived=time.perf_counter())
