"""The app's pure ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from
the endpoints): ``CountRequests`` counts every POST by route and outcome; ``BodyLimit`` bounds
request bodies (Starlette has no body cap of its own).

Bodies here are prompts and adapter references, never weights, so a small cap is generous. The
body is read (at most ``limit`` bytes, within ``deadline_s``) before the app sees it, and
replayed; a declared or streamed body over the cap is answered 413 without reading the rest, a
body that trickles in past the deadline 408. After the replay, ``receive`` is the client's again,
so the routes still notice a client that goes away.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from hotlora.errors import RequestError, RequestTooLarge
from hotlora.server.errors import is_openai

BODY_METHODS = {"POST", "PUT", "PATCH"}


def outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "server_error"


class CountRequests:
    """``hotlora_requests{api, outcome}``: one count per POST, labelled with the matched route's path."""

    def __init__(self, inner, *, metrics):
        self.inner = inner
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.inner(scope, receive, send)
        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.inner(scope, receive, watch)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(route.path if route else "unmatched", outcome(status.get("code", 500))).inc()



class BodyTimeout(RequestError):
    status_code = 408


class BodyLimit:
    """Read the body (bounded in size and time) before the app does, then replay it."""

    def __init__(self, inner, *, limit: int, refuse: Callable, deadline_s: float = 30.0):
        self.inner = inner
        self.limit = limit
        self.refuse = refuse  # exception, openai -> Response: the app's own error body
        self.deadline_s = deadline_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.inner(scope, receive, send)
        openai = is_openai(scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._answer(RequestTooLarge(self._too_large(int(declared))), openai, scope, receive, send)
        try:
            body, disconnected = await asyncio.wait_for(self._read(receive), self.deadline_s)
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

    async def _read(self, receive) -> tuple[bytes, bool]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise RequestTooLarge(self._too_large(size, at_least=True))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return f"request body of {'at least ' if at_least else ''}{size} bytes exceeds the {self.limit}-byte limit"

    async def _answer(self, exc, openai: bool, scope, receive, send):
        response = self.refuse(exc, openai)
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)
