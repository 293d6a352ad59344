"""``GET /``: the playground for a browser, a short JSON pointer for anything else (``POST /`` is
the inference API)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


def playground_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/")
    async def root(request: Request):
        """A browser gets the playground; anything else a short JSON pointer (POST / is the inference API)."""
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(PLAYGROUND.read_text())
        return {"name": "hotlora", "playground": "open / in a browser", "docs": "/docs"}

    return router
