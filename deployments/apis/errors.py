"""Errors of the HTTP APIs: one exception type carrying status, message and kind, the
mapping from the engine's typed errors to it, and the OpenAI-shaped JSON body.

Why one place: every API (OpenAI, Responses, Anthropic Messages) maps the same engine
errors to the same statuses; only the body's shape differs (each API module renders
HTTPError its own way; OpenAI's shape is the default).
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineSleepingError,
    FlotillaError,
    InconsistentUtilityResults,
    InvalidRequestError,
    NoEnginesError,
    RequestAbortedError,
    RequestTimeoutError,
)

RETRY_AFTER_S = 1  # what a 429 (an engine's waiting queue full) asks the client to wait
TIMEOUT_MESSAGE = ("the request passed its deadline (timeout, or the server's "
                   "request_timeout_s) and was aborted; usage counts what it used")


class ParamError(InvalidRequestError):
    """A request field that is valid JSON but cannot be honoured; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)


# the request fields a structured-outputs constraint comes from, in each API
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


def constraint_param(body: Any) -> str:
    """The field of `body` that asked for its structured-outputs constraint (for an
    error about the constraint): one of CONSTRAINT_FIELDS, the Responses API's
    text.format, else tool_choice (a forced tool call's constraint)."""
    for name in CONSTRAINT_FIELDS:
        if getattr(body, name, None) is not None:
            return name
    fmt = getattr(getattr(body, "text", None), "format", None)
    if fmt is not None and getattr(fmt, "type", "text") != "text":
        return "text.format"
    return "tool_choice"


def first_unsupported(body: Any, table: dict[str, Any]) -> ParamError | None:
    """The first field of `body` set to something Flotilla does not implement: table
    maps each such field to the value (or tuple of values) that is accepted, its "off"."""
    for name, accepted in table.items():
        value = getattr(body, name)
        ok = accepted if isinstance(accepted, tuple) else (accepted,)
        if value not in ok:
            return ParamError(name, f"{name} is not supported by this server")
    return None


class HTTPError(Exception):
    """usage: what a request that failed part way used (a timed-out one's tokens)."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 usage: dict | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param
        self.usage = usage
        self.headers = headers or {}
        self.extra: dict[str, Any] | None = None  # more fields for the error object


def usage_dict(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def cause(exc: BaseException) -> BaseException:
    """The original error of one that crossed a Ray call (Ray keeps it as .cause)."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, BaseException) else exc


def map_error(exc: BaseException) -> HTTPError:
    """The HTTP status and kind for any error a handler raised."""
    exc = cause(exc)
    if isinstance(exc, HTTPError):
        return exc
    err = _mapped(exc)
    if isinstance(exc, InconsistentUtilityResults):
        err.extra = {"values": exc.values}
    return err


def _mapped(exc: BaseException) -> HTTPError:
    if isinstance(exc, (InvalidRequestError, ValueError)):  # some name their field
        return HTTPError(400, str(exc), "BadRequestError", getattr(exc, "param", None))
    if isinstance(exc, EngineOverloadedError):
        return HTTPError(429, str(exc), "RateLimitError",
                         headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(exc, (EngineSleepingError, EngineDrainingError, RequestAbortedError,
                        EngineDeadError, NoEnginesError)):
        return HTTPError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, RequestTimeoutError):  # before any token: only the prompt was used
        return HTTPError(408, TIMEOUT_MESSAGE, "TimeoutError",
                         usage=usage_dict(exc.prompt_tokens, 0))
    if isinstance(exc, FlotillaError):
        return HTTPError(500, str(exc), "InternalServerError")
    return HTTPError(500, f"internal error: {type(exc).__name__}", "InternalServerError")


def openai_error_body(err: HTTPError) -> dict[str, Any]:
    body: dict[str, Any] = {"error": {"message": err.message, "type": err.err_type,
                                      "param": err.param, "code": err.status}}
    if err.extra:
        body["error"].update(err.extra)
    if err.usage is not None:
        body["usage"] = err.usage
    return body


def openai_error_response(err: HTTPError) -> JSONResponse:
    response = JSONResponse(openai_error_body(err), status_code=err.status)
    response.headers.update(err.headers)
    return response
