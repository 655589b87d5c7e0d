"""Every error the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with
the right status (on the Anthropic Messages API's routes in Anthropic's: {"type": "error", "error":
{"type", "message"}}). Bad input (a field out of range, a body that is not UTF-8 or not JSON, an unknown route
or method) is answered without a traceback in the log; only a bug (an exception nobody expected) logs one."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from .schemas import Unsupported


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "cancelled",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's envelope, for the Messages API's routes (anthropic_api.py)."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status, headers=e.headers)


def invalid_request(e: ValidationError) -> APIError:
    """pydantic's first complaint -> a 400 naming the field (`param`: its top-level name)."""
    first = e.errors()[0] if e.errors() else {}
    loc = [str(x) for x in first.get("loc", ())]
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    unsupported = isinstance((first.get("ctx") or {}).get("error"), Unsupported)
    where = "" if not loc or msg.startswith(".".join(loc)) else ".".join(loc) + ": "  # "seed must be ..." names itself
    return APIError(400, where + msg, param=loc[0] if loc else None,
                    code="unsupported_parameter" if unsupported else None)


_STATUS_TEXT = {404: ("not_found", "no such route: {method} {path}"),
                405: ("method_not_allowed", "{method} is not allowed on {path}")}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)  # starlette's own: unknown route (404), wrong method (405)
    async def _http_error(request, e: HTTPException):
        code, text = _STATUS_TEXT.get(e.status_code, (None, "{detail}"))
        message = text.format(method=request.method, path=request.url.path, detail=e.detail)
        return error_response(APIError(e.status_code, message, code=code, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)  # a bug: say so in OpenAI's shape (starlette re-raises it: uvicorn logs it)
    async def _bug(_, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error"))
