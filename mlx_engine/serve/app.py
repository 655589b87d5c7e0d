"""The HTTP side: FastAPI routes in OpenAI's shapes, server-sent events ending in `data: [DONE]`, errors
as {"error": {"message", "type", "param", "code"}} with the right status (errors.py). No MLX here:
requests pass intake.py (key, size, schema, tokens), are queued to the engine thread (worker.py), and
its events are turned into responses. A client that leaves is noticed at once, streamed or not (its
ASGI `receive()` says `http.disconnect`), and its job is cancelled."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError, error_body, error_response, install_error_handlers
from .intake import DEFAULT_MAX_BODY_BYTES, RequireAPIKey, encode_chat, take_request  # noqa: F401 (encode_chat)
from .jobs import GONE, Delta, Done, Failed, Job, Request
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

RETRY_AFTER_SECONDS = 1  # a 503's Retry-After: a place frees as soon as one request ends
SHUTTING_DOWN = APIError(503, "the server is shutting down: this request was cancelled (--shutdown-timeout "
                              "passed)", type_="server_error", code="shutting_down")


@dataclass
class Service:
    model_id: str
    tokenizer: object
    context_length: int
    vocab_size: int
    worker: object  # WorkerBase
    default_max_tokens: int = 512
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    memory: object = None  # core.memory.MemoryBudget: a request whose KV cache can never fit is refused here


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mlx-engine", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if service.api_key:
        app.add_middleware(RequireAPIKey, key=service.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_id, **service.worker.status()}

    @app.get("/metrics")
    async def metrics():
        return Response(service.worker.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                            "owned_by": "mlx-engine"}]}

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        return await respond(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await respond(http, chat=False)

    async def respond(http: HTTPRequest, chat: bool):
        arrived = time.perf_counter()
        body, prompt, grammar = await take_request(http, chat, service.tokenizer, service.vocab_size,
                                                   service.max_body_bytes)
        if body.model != service.model_id:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{service.model_id}'",
                           param="model", code="model_not_found")
        where = "messages" if chat else "prompt"
        if not prompt:
            raise APIError(400, "the prompt is empty", param=where)
        if len(prompt) >= service.context_length:
            raise APIError(400, f"this model's maximum context length is {service.context_length} tokens; the "
                                f"prompt has {len(prompt)}", param=where, code="context_length_exceeded")
        max_tokens = body.limit(min(service.default_max_tokens, service.context_length - len(prompt)))
        if len(prompt) + max_tokens > service.context_length:
            raise APIError(400, f"this model's maximum context length is {service.context_length} tokens; the prompt "
                                f"has {len(prompt)} and max_tokens asks for {max_tokens} more",
                           param="max_tokens", code="context_length_exceeded")
        if service.memory is not None:
            try:
                service.memory.check_sequence(len(prompt) + max_tokens)
            except ValueError as e:
                raise APIError(400, str(e), param="max_tokens", code="memory_budget_exceeded") from None
        try:
            sampling = body.sampling()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        job = Job(Request(prompt, max_tokens, sampling, seed, body.stop, body.num_draft, grammar), arrived=arrived)
        job.name = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if not service.worker.try_submit(job):
            raise APIError(503, f"the server is at capacity ({service.worker.max_queue} requests in); retry later",
                           type_="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        envelope = {"id": job.name, "created": int(time.time()), "model": service.model_id}  # one `created` per request
        if body.stream:
            return StreamingResponse(stream(job, envelope, chat, body.include_usage, http),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(job, envelope, chat, http)

    async def complete(job: Job, envelope: dict, chat: bool, http: HTTPRequest):
        parts = []
        watcher = asyncio.create_task(watch_disconnect(http, job, service.worker.cancel))
        try:
            while True:
                event = await job.events.get()
                if event is GONE or getattr(event, "finish_reason", None) == "cancelled":  # nobody reads this
                    return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
                if isinstance(event, Delta):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    raise APIError(500, event.message, type_="server_error")
                elif isinstance(event, Done):
                    break
        except asyncio.CancelledError:  # the server is shutting down past --shutdown-timeout: say so
            service.worker.cancel(job)
            return error_response(SHUTTING_DOWN)
        finally:
            watcher.cancel()
        text = "".join(parts)
        out = {**envelope, "object": "chat.completion" if chat else "text_completion"}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason(event)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(event)}
        out.update(choices=[choice], usage=usage(event), speculation=event.speculation)
        return out

    async def stream(job: Job, envelope: dict, chat: bool, include_usage: bool, http: HTTPRequest):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(out) -> str:
            return f"data: {json.dumps(out)}\n\n"

        def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
            out = {**envelope, "object": obj}
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            else:
                out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
            return out

        watcher = asyncio.create_task(watch_disconnect(http, job, service.worker.cancel))
        try:
            if chat:
                yield sse(chunk("", None, first=True))
            while True:
                event = await job.events.get()
                if event is GONE or getattr(event, "finish_reason", None) == "cancelled":  # the client left
                    return
                if isinstance(event, Delta):
                    yield sse(chunk(event.text, None))
                elif isinstance(event, Failed):
                    yield sse(error_body(event.message, "server_error"))
                    break
                elif isinstance(event, Done):
                    last = chunk(None, finish_reason(event))
                    last["usage"] = usage(event)  # usage and speculation ride on the last chunk
                    last["speculation"] = event.speculation
                    yield sse(last)
                    if include_usage:  # OpenAI's own form as well: one more chunk with no choices
                        yield sse({**envelope, "object": obj, "choices": [], "usage": usage(event),
                                   "speculation": event.speculation})
                    break
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # shutting down past --shutdown-timeout (or the client left): say so
            service.worker.cancel(job)
            yield sse(error_body(SHUTTING_DOWN.message, SHUTTING_DOWN.type, code=SHUTTING_DOWN.code))
        finally:  # the client went away (the generator is closed) or the stream ended: stop the job
            watcher.cancel()
            service.worker.cancel(job)

    return app


async def watch_disconnect(http: HTTPRequest, job: Job, cancel) -> None:
    """Wait on the request's ASGI receive(): its body is read, so the next message is `http.disconnect`,
    sent the moment the client closes its connection. Then cancel the job and wake whoever waits on it."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            cancel(job)
            job.events.put_nowait(GONE)
            return


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def finish_reason(done: Done) -> str:
    return "stop" if done.finish_reason == "stop" else "length"
