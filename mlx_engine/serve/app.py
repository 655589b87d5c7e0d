"""The HTTP side: FastAPI routes in OpenAI's shapes, server-sent events ending in `data: [DONE]`, errors
as {"error": {"message", "type", "param", "code"}} with the right status. No MLX here: requests are
tokenized, queued to the engine thread (worker.py), and its events turned into responses."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from .jobs import Delta, Done, Failed, Job, Request
from .schemas import ChatRequest, CompletionRequest


@dataclass
class Service:
    model_id: str
    tokenizer: object
    context_length: int
    vocab_size: int
    worker: object  # WorkerBase
    default_max_tokens: int = 512


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def encode_chat(tokenizer, messages) -> list[int]:
    """The conversation through the model's chat template (role: content lines when it has none)."""
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
    return list(tokenizer.encode(text))


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mlx-engine", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(msg, "invalid_request_error", loc[0] if loc else None), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_id, **service.worker.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                            "owned_by": "mlx-engine"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        check_model(body.model)
        prompt = encode_chat(service.tokenizer, body.messages)
        return await respond(body, prompt, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = list(service.tokenizer.encode(body.prompt))
        else:
            prompt = list(body.prompt)
            if min(prompt) < 0 or max(prompt) >= service.vocab_size:
                raise APIError(400, f"prompt token ids must be in [0, {service.vocab_size})", param="prompt")
        return await respond(body, prompt, http, chat=False)

    def check_model(name: str) -> None:
        if name != service.model_id:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{service.model_id}'",
                           param="model", code="model_not_found")

    async def respond(body, prompt: list[int], http: HTTPRequest, chat: bool):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        where = "messages" if chat else "prompt"
        if len(prompt) >= service.context_length:
            raise APIError(400, f"this model's maximum context length is {service.context_length} tokens; the "
                                f"prompt has {len(prompt)}", param=where, code="context_length_exceeded")
        max_tokens = body.limit(min(service.default_max_tokens, service.context_length - len(prompt)))
        if len(prompt) + max_tokens > service.context_length:
            raise APIError(400, f"this model's maximum context length is {service.context_length} tokens; the prompt "
                                f"has {len(prompt)} and max_tokens asks for {max_tokens} more",
                           param="max_tokens", code="context_length_exceeded")
        if service.worker.saturated():
            raise APIError(503, "the server is at capacity; retry later", type_="server_error", code="overloaded")
        try:
            sampling = body.sampling()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        job = Job(Request(prompt, max_tokens, sampling, seed, body.stop, body.num_draft))
        service.worker.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            return StreamingResponse(stream(job, rid, chat, body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(job, rid, chat, http)

    def envelope(rid: str, chat: bool, stream: bool) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": service.model_id}

    def usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    def finish_reason(done: Done) -> str:
        return "stop" if done.finish_reason == "stop" else "length"

    async def complete(job: Job, rid: str, chat: bool, http: HTTPRequest):
        parts = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():  # the client left: stop its generation
                        job.cancel()
                        return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
                    continue
                if isinstance(event, Delta):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    raise APIError(500, event.message, type_="server_error")
                elif isinstance(event, Done):
                    break
        except asyncio.CancelledError:
            job.cancel()
            raise
        text = "".join(parts)
        out = envelope(rid, chat, False)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason(event)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(event)}
        out.update(choices=[choice], usage=usage(event), speculation=event.speculation)
        return out

    async def stream(job: Job, rid: str, chat: bool, body):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
            out = envelope(rid, chat, True)
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            else:
                out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
            return out

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        try:
            if chat:
                yield sse(chunk("", None, first=True))
            while True:
                event = await job.events.get()
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
                        extra = envelope(rid, chat, True)
                        extra.update(choices=[], usage=usage(event), speculation=event.speculation)
                        yield sse(extra)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed) or the stream ended: stop the job
            job.cancel()

    return app
