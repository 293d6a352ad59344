"""The app's exception handlers: every error leaves as the response ``server/errors.py`` decides."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotlora.errors import HotloraError, InvalidRequest, RequestError
from hotlora.server.errors import error_reply, http_error_reply, internal_error_reply, is_openai, validation_error

log = logging.getLogger(__name__)


def error_response(exc: Exception, openai: bool = False) -> JSONResponse:
    reply = error_reply(exc, openai)
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def options_note(service, errors) -> str:
    """For a body with fields the API does not have (``true_cfg_scale``, a pipeline's own argument):
    what the served model's family takes, in the words an option it does not take gets
    (``ModelRules.untaken``). "" before an engine is ready, or when no field was unknown."""
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden" and len(e.get("loc", ())) == 2]
    rules = getattr(getattr(getattr(service, "worker", None), "engine", None), "rules", None)
    if not unknown or rules is None:
        return ""
    return "; ".join(rules.untaken(**dict.fromkeys(unknown, True)))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HotloraError)
    async def hotlora_error(request: Request, exc: HotloraError):
        if not isinstance(exc, RequestError):
            log.error("%s %s: %s", request.method, request.url.path, exc)
        return error_response(exc, openai=is_openai(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError):
        problem = validation_error(exc.errors(), located=True)
        note = options_note(getattr(app.state, "service", None), exc.errors())
        if note:
            problem = InvalidRequest(f"{problem}; {note}")
        return error_response(problem, openai=is_openai(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        reply = http_error_reply(exc.status_code, exc.detail, exc.headers, openai=is_openai(request.url.path))
        return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        reply = internal_error_reply(exc)  # Connection: close: uvicorn drops the connection after it
        return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
