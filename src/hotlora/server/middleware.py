"""The app's pure ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from
the endpoints): ``CountRequests`` counts every POST by route and outcome; ``BodyLimit`` bounds
request bodies (Starlette has no body cap of its own); ``SameOrigin`` refuses requests a web page
on another origin made the user's browser send; ``browser_guards`` adds Starlette's own Host check
and, only when configured, CORS.

Bodies here are prompts and adapter references, never weights, so a small cap is generous. The
body is read (at most ``limit`` bytes, within ``deadline_s``) before the app sees it, and
replayed; a declared or streamed body over the cap is answered 413 without reading the rest, a
body that trickles in past the deadline 408. After the replay, ``receive`` is the client's again,
so the routes still notice a client that goes away.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable
from urllib.parse import urlsplit

from hotlora.errors import BodyTimeout, CrossOriginRefused, RequestTooLarge
from hotlora.server.auth import is_loopback
from hotlora.server.errors import is_openai
from hotlora.settings import ServerConfig

BODY_METHODS = {"POST", "PUT", "PATCH"}
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
# What a loopback server without keys answers to: a page whose own name resolves to 127.0.0.1
# (DNS rebinding) arrives with that name in Host, and is refused.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


# Where a streaming route puts the status of an answer it sent after its 200 had started (the
# ``error`` event of /v1/generate/stream): in the request's state (Starlette's ``request.state``,
# ``scope["state"]``), so the request is counted by that status, not by the 200 that carried it.
STREAMED_STATUS = "streamed_status"


def outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "server_error"


class CountRequests:
    """``hotlora_requests_total{api, outcome}`` and ``hotlora_request_duration_seconds{api, outcome}``:
    each POST, labelled with the matched route's template (never the path a caller typed: bounded),
    and by its answer's status: a stream's error event's where it ended in one (``STREAMED_STATUS``)."""

    def __init__(self, inner, *, metrics):
        self.inner = inner
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.inner(scope, receive, send)
        status, began = {}, time.monotonic()

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.inner(scope, receive, watch)
        finally:
            route = scope.get("route")
            code = (scope.get("state") or {}).get(STREAMED_STATUS) or status.get("code", 500)
            self.metrics.observe_request(route.path if route else "unmatched", outcome(code), time.monotonic() - began)


# The routes a request's input images arrive on (base64 in JSON, or a multipart upload).
IMAGE_ROUTES = ("/", "/v1/generate", "/v1/generate/stream", "/v1/images/edits", "/v1/videos")


def body_limits(config: ServerConfig):
    """The body cap per path: ``max_body_bytes``, and on the generation routes of an engine that
    serves tasks with input images, room for as many images as a request may give (references or
    an image, and a mask), each ``input_image_max_bytes`` as base64, beside the rest of the body."""
    if tuple(config.tasks) == ("text-to-image",):
        return lambda path: config.max_body_bytes
    images = max(config.max_reference_images, 1) + 1
    larger = config.max_body_bytes + images * (config.input_image_max_bytes * 4 // 3 + 4096)
    return lambda path: larger if path in IMAGE_ROUTES or path.startswith("/models/") else config.max_body_bytes


class BodyLimit:
    """Read the body (bounded in size and time) before the app does, then replay it. ``limit_of``:
    the cap for a path when some paths take more (the generation routes of an engine serving
    input images); default ``limit`` everywhere."""

    def __init__(self, inner, *, limit: int, refuse: Callable, deadline_s: float = 30.0,
                 limit_of: Callable[[str], int] | None = None):
        self.inner = inner
        self.limit = limit
        self.limit_of = limit_of or (lambda path: limit)
        self.refuse = refuse  # exception, openai -> Response: the app's own error body
        self.deadline_s = deadline_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.inner(scope, receive, send)
        openai = is_openai(scope.get("path", ""))
        limit = self.limit_of(scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await self._answer(RequestTooLarge(too_large(int(declared), limit)), openai, scope, receive, send)
        try:
            body, disconnected = await asyncio.wait_for(self._read(receive, limit), self.deadline_s)
        except RequestTooLarge as exc:
            return await self._answer(exc, openai, scope, receive, send)
        except asyncio.TimeoutError:
            exc = BodyTimeout(f"the request body did not arrive within {self.deadline_s:g} s")
            return await self._answer(exc, openai, scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if disconnected:
                    return {"type": "http.disconnect"}
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.inner(scope, replay, send)

    async def _read(self, receive, limit: int) -> tuple[bytes, bool]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(too_large(size, limit, at_least=True))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _answer(self, exc, openai: bool, scope, receive, send):
        response = self.refuse(exc, openai)
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def too_large(size: int, limit: int, at_least: bool = False) -> str:
    return f"request body of {'at least ' if at_least else ''}{size} bytes exceeds the {limit}-byte limit"


class SameOrigin:
    """Refuse a state-changing request whose ``Origin`` is neither this server's own nor one of
    ``cors_origins``, unless it carries an ``Authorization`` header.

    Browsers name the page behind every cross-origin POST in ``Origin``, and a page may send a
    "simple" POST (text/plain, a form, a body without a type) to any address without asking first:
    with no keys on a loopback server, that is enough to generate and fetch. A request with an
    ``Authorization`` header is one no page can send cross-origin without a CORS preflight this
    server only grants to ``cors_origins``; curl and the Python clients send no ``Origin``.
    """

    def __init__(self, inner, *, allowed_origins=(), refuse: Callable):
        self.inner = inner
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins}
        self.refuse = refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            return await self.inner(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1").strip().lower()
        if not origin or b"authorization" in headers or origin in self.allowed or self._same(origin, headers):
            return await self.inner(scope, receive, send)
        exc = CrossOriginRefused("a request from another origin (a web page) needs an API key; "
                                 "allow a page's origin with cors_origins")
        response = self.refuse(exc, is_openai(scope.get("path", "")))
        response.headers["Connection"] = "close"  # the body is never read
        await response(scope, receive, send)

    @staticmethod
    def _same(origin: str, headers: dict) -> bool:
        """Origin ``scheme://host[:port]`` against the Host header (default ports dropped). The scheme
        is not compared: behind a TLS terminator the page is https and this server hears http."""
        if origin == "null":  # sandboxed frames, file: pages, cross-origin redirects
            return False
        parts = urlsplit(origin)
        host = headers.get(b"host", b"").decode("latin-1").lower()
        return bool(parts.netloc) and _without_default_port(parts.netloc) == _without_default_port(host)


def _without_default_port(netloc: str) -> str:
    for port in (":80", ":443"):
        if netloc.endswith(port):
            return netloc[: -len(port)]
    return netloc


def allowed_hosts(config, keys_required: bool) -> list[str]:
    """The Host headers to answer: the configured list; else any when keys are required or the
    server binds a non-loopback address (every name it is reached by is fine); else the loopback names."""
    if config.allowed_host_headers:
        return list(config.allowed_host_headers)
    if keys_required or not is_loopback(config.host):
        return ["*"]
    return list(LOOPBACK_HOSTS)


def browser_guards(app, config, keys_required: bool, refuse: Callable) -> None:
    """Starlette's Host check (outermost of the three), CORS only for ``cors_origins``, then ``SameOrigin``."""
    from starlette.middleware.cors import CORSMiddleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    app.add_middleware(SameOrigin, allowed_origins=config.cors_origins, refuse=refuse)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "accept", "lora"],
                           expose_headers=["server-timing", "retry-after"])
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(config, keys_required))
