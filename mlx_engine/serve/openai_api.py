"""OpenAI's /v1/chat/completions and /v1/completions: request bodies (schemas.py) into Turns, and the job's
events back into OpenAI's shapes, whole or as server-sent events ending in `data: [DONE]`.

A chat answer is split: `reasoning_content` (a reasoning model's thinking, never in `content`), `content`,
and `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}], finish_reason
"tool_calls"). Streamed, a call comes as OpenAI's `delta.tool_calls`: its index, id and name first, then
its arguments in pieces as the model writes them."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse

from ..toolcalls.stream import CallArgs, CallStart, Text
from .errors import APIError, error_body, error_response
from .intake import parse, read_body
from .jobs import Done, Logprobs
from .keepalive import KEEPALIVE, SSE_COMMENT
from .runner import SHUTTING_DOWN, ClientLeft, events, start
from .schemas import ChatRequest, CompletionRequest
from .turn import Turn


def chat_turn(body: ChatRequest) -> Turn:
    return Turn(body.model, messages=[m.as_dict() for m in body.messages], tools=body.tools,
                tool_choice=body.tool_choice if body.tools else "none", parallel_tool_calls=body.parallel_tool_calls,
                response_format=body.response_format, template_kwargs=body.template_kwargs(),
                sampling=body.sampling(), max_tokens=body.limit(None), stop=body.stop, seed=body.seed,
                num_draft=body.num_draft, logprobs=body.logprob_count, stream=body.stream,
                named=frozenset(body.model_fields_set))


def completion_turn(body: CompletionRequest, vocab_size: int) -> Turn:
    prompt = body.prompt
    if isinstance(prompt, list) and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    return Turn(body.model, prompt=prompt, response_format=body.response_format, sampling=body.sampling(),
                max_tokens=body.limit(None), stop=body.stop, seed=body.seed, num_draft=body.num_draft,
                logprobs=body.logprobs, stream=body.stream, named=frozenset(body.model_fields_set))


def legacy_logprobs(entries: list[dict], top: int) -> dict:
    """Completions' older shape of the same figures: tokens, token_logprobs, top_logprobs as {token: lp}."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"][:top]} for e in entries],
            "text_offset": []}


def logprobs_field(entries: list[dict] | None, chat: bool, top: int | None):
    if entries is None:
        return None
    return {"content": entries} if chat else legacy_logprobs(entries, top or 0)


def usage(done: Done) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the engine reused (its prefix
    cache, the previous turn's cache) instead of prefilling them."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def finish_reason(done: Done) -> str:
    return done.finish_reason if done.finish_reason in ("stop", "tool_calls") else "length"


async def respond(http, service, chat: bool, arrived: float):
    from starlette.concurrency import run_in_threadpool

    raw = await read_body(http, service.max_body_bytes)
    body = await run_in_threadpool(parse, raw, ChatRequest if chat else CompletionRequest)
    try:
        turn = chat_turn(body) if chat else completion_turn(body, service.vocab_size)
    except ValueError as e:  # a sampling setting out of range
        raise APIError(400, str(e)) from None
    job, _ = await start(turn, service, "chatcmpl-" if chat else "cmpl-", arrived, http)
    envelope = {"id": job.name, "created": int(time.time()), "model": service.model_id}
    if turn.stream:
        return StreamingResponse(stream(job, envelope, chat, body.include_usage, http, service),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await complete(job, envelope, chat, http, service)


async def complete(job, envelope: dict, chat: bool, http, service):
    parts = {"content": [], "reasoning": []}
    calls: list[dict] = []
    top = job.request.logprobs
    logprobs = [] if top is not None else None
    try:
        async with aclosing(events(job, http, service.worker.cancel)) as evs:
            async for event in evs:
                if isinstance(event, Text):
                    parts[event.kind].append(event.text)
                elif isinstance(event, CallStart):
                    calls.append({"id": event.id, "type": "function",
                                  "function": {"name": event.name, "arguments": ""}})
                elif isinstance(event, CallArgs):
                    calls[event.index]["function"]["arguments"] += event.text
                elif isinstance(event, Logprobs):
                    logprobs += event.entries
                elif isinstance(event, Done):
                    done = event
    except ClientLeft:
        return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
    except asyncio.CancelledError:  # the server is shutting down past --shutdown-timeout: say so
        return error_response(SHUTTING_DOWN)
    text = "".join(parts["content"])
    out = {**envelope, "object": "chat.completion" if chat else "text_completion"}
    if chat:
        message = {"role": "assistant", "content": text if text or not calls else None}
        if parts["reasoning"]:
            message["reasoning_content"] = "".join(parts["reasoning"])
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": logprobs_field(logprobs, True, top),
                  "finish_reason": finish_reason(done)}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs_field(logprobs, False, top),
                  "finish_reason": finish_reason(done)}
    out.update(choices=[choice], usage=usage(done), speculation=done.speculation)
    return out


def sse(out) -> str:
    return f"data: {json.dumps(out)}\n\n"


async def stream(job, envelope: dict, chat: bool, include_usage: bool, http, service):
    obj = "chat.completion.chunk" if chat else "text_completion"
    top = job.request.logprobs

    def chunk(delta: dict | None, reason: str | None = None, text: str | None = None, logprobs=None) -> dict:
        out = {**envelope, "object": obj}
        lp = logprobs_field(logprobs, chat, top)
        if chat:
            out["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": lp, "finish_reason": reason}]
        else:
            out["choices"] = [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": reason}]
        return out

    try:
        if chat:
            yield sse(chunk({"role": "assistant", "content": ""}))
        async with aclosing(events(job, http, service.worker.cancel, getattr(service, "keepalive", None))) as evs:
            async for event in evs:
                if event is KEEPALIVE:  # nothing from the engine for a while (queued, prefilling): a comment line
                    yield SSE_COMMENT
                elif isinstance(event, Text):
                    if chat:
                        yield sse(chunk({"content" if event.kind == "content" else "reasoning_content": event.text}))
                    else:
                        yield sse(chunk(None, text=event.text))
                elif isinstance(event, CallStart):
                    yield sse(chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                                     "function": {"name": event.name, "arguments": ""}}]}))
                elif isinstance(event, CallArgs):
                    yield sse(chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}))
                elif isinstance(event, Logprobs):  # the tokens' logprobs in a chunk of their own
                    yield sse(chunk({}, logprobs=event.entries))
                elif isinstance(event, Done):
                    last = chunk({}, finish_reason(event))
                    last["usage"] = usage(event)  # usage and speculation ride on the last chunk
                    last["speculation"] = event.speculation
                    yield sse(last)
                    if include_usage:  # OpenAI's own form as well: one more chunk with no choices
                        yield sse({**envelope, "object": obj, "choices": [], "usage": usage(event),
                                   "speculation": event.speculation})
        yield "data: [DONE]\n\n"
    except ClientLeft:
        return
    except APIError as e:  # the job failed: an error event, then the end of the stream
        yield sse(error_body(e.message, e.type, code=e.code))
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:  # shutting down past --shutdown-timeout: say so
        yield sse(error_body(SHUTTING_DOWN.message, SHUTTING_DOWN.type, code=SHUTTING_DOWN.code))
    finally:  # the client went away (the generator is closed) or the stream ended: stop the job
        service.worker.cancel(job)
