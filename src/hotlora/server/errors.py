"""Errors as HTTP answers, decided in one place: status, body, ``Retry-After``, validation messages.

Plain Python over ``hotlora.errors`` (no FastAPI, Starlette, prometheus-client or torch), so the Ray
ingress (``scaleout/routing.py``, ``scaleout/ingress.py``) answers in exactly the shape ``hotlora serve``
does without importing the server. The two shapes:

* hotlora's own APIs: ``{"error": message, "type": ExceptionName}``
* the OpenAI images and videos APIs (paths under ``/v1/images``, ``/v1/videos``): ``{"error": {"message": ..., "type": ...}}``

The errors carry no HTTP: ``STATUS`` maps each ``HotloraError`` class to its status, looked up
along the exception's MRO (a subclass answers as its nearest listed ancestor: ``UnservedShape`` as
``InvalidRequest``, 422; a ``HotloraError`` with no listed ancestor is a 500), and ``HEADERS`` the
headers a class's answer always carries (``WWW-Authenticate`` on a 401). An error that means "try
again later" carries ``retry_after_s``, sent as ``Retry-After``. Anything else is a 500 whose body
names only the exception's type, with ``Connection: close`` (the server drops the connection after
it). The web framework's own refusals (404, 405, a body it could not parse) take the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Iterable, Mapping

from hotlora.errors import (
    AdapterFormatError, AdapterNotFound, AdapterRejected, BodyTimeout, ClientGone, CrossOriginRefused, DeadlineExceeded,
    EngineError, FetchersBusy, Forbidden, HotloraError, InvalidRequest, JobNotFinished, JobNotFound, ModelsOverloaded, NotAccepting, Overloaded,
    ReplicasUnavailable, RequestError, RequestTooLarge, SourceUnavailable, Unauthorized, UnknownModel, UnsafeReference,
    UnsupportedMediaType,
)

OPENAI_PREFIX = ("/v1/images", "/v1/videos")  # the routes that answer in the OpenAI error shape

STATUS: dict[type[HotloraError], int] = {
    RequestError: 400,
    AdapterNotFound: 404,
    AdapterFormatError: 422,
    AdapterRejected: 422,
    InvalidRequest: 422,
    RequestTooLarge: 413,
    UnsafeReference: 403,
    UnsupportedMediaType: 415,
    Overloaded: 429,
    NotAccepting: 503,
    DeadlineExceeded: 504,
    ClientGone: 499,  # nginx's "client closed request": nobody reads it, the logs and metrics do
    FetchersBusy: 429,
    BodyTimeout: 408,
    CrossOriginRefused: 403,
    Unauthorized: 401,
    Forbidden: 403,
    JobNotFound: 404,
    JobNotFinished: 409,
    UnknownModel: 404,
    ReplicasUnavailable: 503,
    ModelsOverloaded: 429,
    SourceUnavailable: 502,  # a remote source failed: a bad gateway, not our fault
    EngineError: 500,
}
HEADERS: dict[type[HotloraError], dict[str, str]] = {
    Unauthorized: {"WWW-Authenticate": 'Bearer realm="hotlora"'},  # RFC 9110: a 401 names its scheme
}


def _nearest(table: Mapping[type, Any], exc: BaseException):
    """The entry of the exception's class or its nearest ancestor in ``table``, or None."""
    return next((table[cls] for cls in type(exc).__mro__ if cls in table), None)


@dataclass(frozen=True)
class ErrorReply:
    """Everything an HTTP error response is made of; the web framework only serializes it."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def status_of(exc: BaseException) -> int:
    return _nearest(STATUS, exc) or 500


def retry_after(exc: BaseException) -> str | None:
    """The ``Retry-After`` header value (seconds), or None when the error does not ask for a retry."""
    seconds = getattr(exc, "retry_after_s", None)
    return None if seconds is None else str(seconds)


def error_body(exc: BaseException, openai: bool = False) -> dict:
    message = str(exc)
    kind = type(exc).__name__
    return {"error": {"message": message, "type": kind}} if openai else {"error": message, "type": kind}


def error_reply(exc: BaseException, openai: bool = False) -> ErrorReply:
    """A deliberate error (``HotloraError``) as status, body and headers (``HEADERS``: those an
    error class's answer always carries, e.g. ``WWW-Authenticate`` on a 401; ``Retry-After``)."""
    seconds = retry_after(exc)
    headers = dict(_nearest(HEADERS, exc) or {})
    if seconds is not None:
        headers["Retry-After"] = seconds
    return ErrorReply(status_of(exc), error_body(exc, openai), headers)


def internal_error_body(exc: BaseException) -> dict:
    """An unexpected exception: a 500 that names the type and nothing else (the log has the rest)."""
    return {"error": f"internal error: {type(exc).__name__}"}


def internal_error_reply(exc: BaseException) -> ErrorReply:
    """An unexpected exception's 500, with ``Connection: close``. Starlette re-raises the exception
    after the answer is sent (so the server logs it) and uvicorn then drops the connection: a
    keep-alive client that was not told would send its next request down a closed socket."""
    return ErrorReply(500, internal_error_body(exc), {"Connection": "close"})


def http_error_reply(status: int, detail: Any, headers: Mapping[str, str] | None = None,
                     openai: bool = False) -> ErrorReply:
    """The web framework's own refusals (Starlette's ``HTTPException``: 404, 405, a body FastAPI
    could not parse) in the API's shape instead of ``{"detail": ...}``. A body that did not parse
    (JSON nested too deeply) is the ``InvalidRequest`` a malformed JSON body already is: 422."""
    if status == 400:
        return error_reply(InvalidRequest(f"invalid request: body: {str(detail).lower()} "
                                          "(not JSON, or nested too deeply)"), openai)
    try:
        kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")  # "Not Found" -> "NotFound"
    except ValueError:
        kind = "HTTPError"
    message = str(detail)
    body = {"error": {"message": message, "type": kind}} if openai else {"error": message, "type": kind}
    return ErrorReply(status, body, dict(headers or {}))


def stream_error(exc: BaseException) -> dict:
    """The ``error`` event of ``/v1/generate/stream``: the JSON error body plus its status."""
    if isinstance(exc, HotloraError):
        return {**error_body(exc), "status": status_of(exc)}
    return {**internal_error_body(exc), "status": 500}


def validation_error(errors: Iterable[Mapping[str, Any]], *, located: bool = False) -> InvalidRequest:
    """Pydantic's errors as one ``InvalidRequest``: ``"invalid request: field.path: msg; ..."``.

    ``located``: the errors are FastAPI's, whose ``loc`` starts with where the value came from
    (``body``, ``query``...); that part is left out, so a field is named the same whether the
    server or the Ray ingress found the problem. An error about the whole body is ``body: msg``.
    """
    skip = 1 if located else 0
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][skip:]) or 'body'}: {e['msg']}" for e in errors)
    return InvalidRequest(f"invalid request: {problems}")
