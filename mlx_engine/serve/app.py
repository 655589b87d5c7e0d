"""The HTTP side: FastAPI routes for each wire API's adapter (openai_api.py; anthropic.py and responses.py
where present), /health, /metrics, /v1/models, and a request log. No MLX here: requests are read, turned
into a Turn (turn.py) by their adapter, run through runner.py (the one path to the engine thread) and their
events turned back into the adapter's shapes. A client that leaves is noticed at once, streamed or not (its
ASGI `receive()` says `http.disconnect`), and its job is cancelled."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from . import anthropic_api, openai_api, responses_api, sampling_defaults
from .errors import install_error_handlers
from .intake import DEFAULT_MAX_BODY_BYTES, RequireAPIKey
from .keepalive import DEFAULT_SECONDS as KEEPALIVE_SECONDS
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .runner import RETRY_AFTER_SECONDS, SHUTTING_DOWN  # noqa: F401  (kept importable from here)
from .turn import encode_chat  # noqa: F401  (tests and tools count prompts with it)

log = logging.getLogger("mlx_engine.serve")


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
    strict_model_name: bool = False  # a request naming another model gets 404 (default: the one model serves it)
    drafter: str | None = None  # the drafter's kind (/v1/models says it)
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's: what a request naming none gets
    keepalive: float = KEEPALIVE_SECONDS  # a stream's ping after this many silent seconds (0: none; keepalive.py)


class RequestLog:
    """ASGI middleware: one line per request at info level (method, path, status, prompt / generated
    tokens, seconds, and a 4xx / 5xx's message), so a refusal shows in the server's output."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, seen = time.perf_counter(), {"status": 0, "body": b""}

        async def capture(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and seen["status"] >= 400 and len(seen["body"]) < 4096:
                seen["body"] += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            log.info(request_line(scope, seen["status"], seen["body"], time.perf_counter() - t0))


def request_line(scope, status: int, body: bytes, seconds: float) -> str:
    path = scope.get("path", "")
    line = f"{scope.get('method', '?')} {path} {status}"
    job = (scope.get("state") or {}).get("job")
    if job is not None:
        line += f" prompt {len(job.request.prompt)} tokens"
        generated = getattr(job, "generated", None)
        if generated is not None:
            line += f", generated {generated}"
    line += f" {seconds:.2f} s"
    if status >= 400 and body:
        try:
            err = json.loads(body)
            message = (err.get("error") or {}).get("message") if isinstance(err.get("error"), dict) else err.get("error")
        except (ValueError, AttributeError):
            message = None
        if message:
            line += f": {message}"
    return line


def model_card(service: Service) -> dict:
    """/v1/models' entry: OpenAI's four fields, then what an agent sizes and shows by: the context window (as
    `context_length`, and as vLLM names it, `max_model_len`), what serves it (drafter, mode), and the sampling a
    request that names none gets (the checkpoint's generation_config.json over the server's greedy defaults)."""
    return {"id": service.model_id, "object": "model", "created": 0, "owned_by": "mlx-engine",
            "context_length": service.context_length, "max_model_len": service.context_length,
            "drafter": service.drafter or "none", "mode": service.worker.mode,
            "sampling_defaults": sampling_defaults.effective(service.sampling_defaults),
            "sampling_defaults_source": "generation_config.json" if service.sampling_defaults else "server"}


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mlx-engine", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if service.api_key:
        app.add_middleware(RequireAPIKey, key=service.api_key)
    app.add_middleware(RequestLog)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():  # clients probe the base URL before their first request (Claude Code: HEAD /)
        return {"status": "ok", "model": service.model_id}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_id, **service.worker.status()}

    @app.get("/metrics")
    async def metrics():
        return Response(service.worker.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(service)]}

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        return await openai_api.respond(http, service, chat=True, arrived=time.perf_counter())

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await openai_api.respond(http, service, chat=False, arrived=time.perf_counter())

    anthropic_api.install(app, service)  # /v1/messages, /v1/messages/count_tokens
    responses_api.install(app, service)  # /v1/responses
    return app
