"""What a request passes before its adapter reads it: the API key, the body's size, UTF-8, JSON, the schema.
Each refusal is an APIError (401, 413, 400), never a traceback.

The body limit (`--max-body-bytes`, default 8 MiB) is checked on Content-Length before anything is read,
and again while a chunked upload streams in, so an oversized body is never held in memory whole.
Adapters parse (and turn.py tokenizes) in a worker thread: a body of megabytes takes seconds to tokenize,
and the event loop must stay free for /health and the other clients' streams."""

from __future__ import annotations

import hmac
import json

from pydantic import ValidationError

from .errors import APIError, anthropic_error_response, error_response, invalid_request

# 8 MiB: a whole 128k-token context as JSON text is ~0.5-1 MB (~4 bytes per token, some escaping); a
# completions prompt of token ids ~7 bytes per id, so 8 MiB still carries ~1M ids. Beyond that a body
# only costs memory and seconds of tokenizing before the context check refuses it.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/"})  # liveness probes need no key (Claude Code sends HEAD /); counts only


class RequireAPIKey:
    """ASGI middleware: every path but OPEN_PATHS needs `Authorization: Bearer KEY` or, as Anthropic's
    clients send it, `x-api-key: KEY` (401 otherwise, in Anthropic's envelope on its /v1/messages routes).
    Pure ASGI, not BaseHTTPMiddleware, so a request's `receive` (disconnects included) reaches the app as is."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth, api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        scheme, _, token = auth.partition(b" ")
        if (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)) or \
                (api_key is not None and hmac.compare_digest(api_key.strip(), self.key)):
            return await self.app(scope, receive, send)
        message = ("incorrect API key provided" if auth or api_key is not None else
                   "no API key provided: send it as the header 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        refusal = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope["path"] == "/v1/messages" or scope["path"].startswith("/v1/messages/"):
            response = anthropic_error_response(refusal)
        else:
            response = error_response(refusal)
        await response(scope, receive, send)


def too_large(limit: int, size: int | None = None) -> APIError:
    what = f"has {size} bytes, more than" if size is not None else "passed"
    return APIError(413, f"the request body {what} this server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


async def read_body(http, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass `limit` bytes."""
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit, int(length))
    parts, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, schema):
    """bytes -> a validated schema instance (400 naming what is wrong)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") \
            from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except ValueError as e:  # NaN / Infinity
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise invalid_request(e) from None
