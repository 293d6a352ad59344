"""hotlora's own JSON API: ``POST /v1/generate`` and its progress stream ``POST /v1/generate/stream``."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hotlora.errors import HotloraError
from hotlora.server.errors import stream_error
from hotlora.server.schemas import GenerateRequest
from hotlora.server.service import Generated, Service, result_headers

log = logging.getLogger(__name__)


def json_routes(service: Service) -> APIRouter:
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        out = await service.generate(request, body.to_request(), fmt=body.output_format)
        return JSONResponse(json_body(out, body.output_format), headers=result_headers(out))

    @router.post("/v1/generate/stream")
    async def generate_stream(body: GenerateRequest, request: Request):
        """Server-Sent Events: ``progress`` {step, total} per denoising step, then ``result`` (the
        /v1/generate body) or ``error`` {error, type, status}. Schema errors are plain 422s."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def progress(done: int, total: int) -> None:  # called on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, ("progress", {"step": done, "total": total}))

        async def run():
            try:
                out = await service.generate(request, body.to_request(progress), fmt=body.output_format)
                await events.put(("result", json_body(out, body.output_format)))
            except Exception as exc:  # the stream must end with an answer, whatever happened
                if not isinstance(exc, HotloraError):
                    log.exception("stream generation failed")
                await events.put(("error", stream_error(exc)))
            finally:
                await events.put(None)

        task = asyncio.create_task(run())

        async def stream():
            yield "event: accepted\ndata: {}\n\n"
            while (item := await events.get()) is not None:
                name, data = item
                yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
            await task

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return router


def json_body(out: Generated, fmt: str) -> dict:
    """The /v1/generate body: the service's answer with the images base64-encoded."""
    return {**out.body(), "images": [base64.b64encode(b).decode() for b in out.images], "format": fmt}
