"""The one path from a Turn (turn.py) to the engine and back, shared by every wire API's adapter: prepare
it off the event loop, check it against the model (context window, memory budget), cut max_tokens to the
room left (agents send max_tokens 32000 to every model: the answer then ends with `length`), queue the job,
then hand its events to the adapter, cancelling the job when the client leaves or the server shuts down.
No MLX here."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool

from . import sampling_defaults
from .errors import APIError
from .jobs import GONE, Done, Failed, Job, Request
from .keepalive import KEEPALIVE
from .turn import Prepared, Turn, prepare

RETRY_AFTER_SECONDS = 1  # a 503's Retry-After: a place frees as soon as one request ends
SHUTTING_DOWN = APIError(503, "the server is shutting down: this request was cancelled (--shutdown-timeout "
                              "passed)", type_="server_error", code="shutting_down")


class ClientLeft(Exception):
    """The client disconnected (or cancelled): nobody reads the rest."""


def check_model(name: str, service) -> None:
    """Another model's name is served by the one model this server holds (Claude Code, Codex send their
    own model names), unless --strict-model-name."""
    if name != service.model_id and getattr(service, "strict_model_name", False):
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{service.model_id}'",
                       param="model", code="model_not_found")


def room(prompt_tokens: int, asked: int | None, service, where: str) -> int:
    """max_tokens for a prompt: what was asked (else the server's default), cut to the context left."""
    left = service.context_length - prompt_tokens
    if left < 1:
        raise APIError(400, f"this model's maximum context length is {service.context_length} tokens; the "
                            f"prompt has {prompt_tokens}", param=where, code="context_length_exceeded")
    return min(asked or service.default_max_tokens, left)


async def start(turn: Turn, service, prefix: str = "chatcmpl-", arrived: float | None = None,
                http=None) -> tuple[Job, Prepared]:
    """Prepare the turn and queue its job (400 / 404 / 503 as APIError); the job's events follow."""
    arrived = arrived or time.perf_counter()
    check_model(turn.model, service)
    prepared = await run_in_threadpool(prepare, turn, service.tokenizer, service.vocab_size)
    where = "messages" if turn.messages is not None else "prompt"
    if not prepared.prompt:
        raise APIError(400, "the prompt is empty", param=where)
    max_tokens = room(len(prepared.prompt), turn.max_tokens, service, where)
    if service.memory is not None:
        try:
            service.memory.check_sequence(len(prepared.prompt) + max_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens", code="memory_budget_exceeded") from None
    seed = turn.seed if turn.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
    turn.sampling = sampling_defaults.apply(turn.sampling, turn.named, getattr(service, "sampling_defaults", {}))
    try:
        turn.sampling.check_vocab(service.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), param="logit_bias") from None
    request = Request(prepared.prompt, max_tokens, turn.sampling, seed, turn.stop, turn.num_draft, prepared.grammar,
                      prepared.answer, turn.logprobs)
    job = Job(request, arrived=arrived)
    job.name = prefix + uuid.uuid4().hex[:24]
    if http is not None:  # the request log's line names the tokens
        http.scope.setdefault("state", {})["job"] = job
    if not service.worker.try_submit(job):
        raise APIError(503, f"the server is at capacity ({service.worker.max_queue} requests in); retry later",
                       type_="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return job, prepared


async def events(job: Job, http, cancel, keepalive: float | None = None) -> AsyncIterator:
    """The job's events up to its Done (raises ClientLeft when the client went away, APIError 500 on Failed,
    SHUTTING_DOWN when the server stops past --shutdown-timeout). The job is cancelled whenever the reader
    stops early. keepalive: seconds; after each such stretch with no event, KEEPALIVE (keepalive.py) is
    yielded for a stream to write its API's ping (None or 0: never)."""
    watcher = asyncio.create_task(watch_disconnect(http, job, cancel))
    try:
        while True:
            try:  # (a Queue.get cancelled by the timeout loses no event)
                event = await asyncio.wait_for(job.events.get(), keepalive) if keepalive else await job.events.get()
            except TimeoutError:
                yield KEEPALIVE
                continue
            if event is GONE or getattr(event, "finish_reason", None) == "cancelled":
                raise ClientLeft()
            if isinstance(event, Failed):
                raise APIError(500, event.message, type_="server_error")
            yield event
            if isinstance(event, Done):
                return
    except asyncio.CancelledError:  # shutting down past --shutdown-timeout
        cancel(job)
        raise
    finally:
        watcher.cancel()
        cancel(job)


async def watch_disconnect(http, job: Job, cancel) -> None:
    """Wait on the request's ASGI receive(): its body is read, so the next message is `http.disconnect`,
    sent the moment the client closes its connection. Then cancel the job and wake whoever waits on it."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            cancel(job)
            job.events.put_nowait(GONE)
            return
