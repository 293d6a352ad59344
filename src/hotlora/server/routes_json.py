"""hotlora's own JSON API: ``POST /v1/generate`` (a job with ``Prefer: respond-async``) and its progress
stream ``POST /v1/generate/stream``."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hotlora.errors import HotloraError, InvalidRequest
from hotlora.server.errors import stream_error
from hotlora.server.jobs import Jobs, view
from hotlora.server.middleware import STREAMED_STATUS
from hotlora.server.schemas import GenerateRequest, prefers_async
from hotlora.server.service import Generated, Service, result_headers

log = logging.getLogger(__name__)


def json_routes(service: Service, jobs: Jobs) -> APIRouter:
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        """``Prefer: respond-async`` (RFC 7240): a job (server/jobs.py), answered 202 with its
        ``Location``; else the generation itself."""
        if respond_async(request):
            record = await jobs.create(request, body.to_request(), body.output_format, retention_s=body.retention_s,
                                       webhook=body.webhook)
            return JSONResponse(view(record), status_code=202,
                                headers={"Location": f"/v1/jobs/{record.id}", "Preference-Applied": "respond-async"})
        if body.webhook is not None or body.retention_s is not None:
            raise InvalidRequest("webhook and retention_s are a job's: send the request with 'Prefer: respond-async'")
        out = await service.generate(request, body.to_request(), fmt=body.output_format)
        return JSONResponse(json_body(out), headers=result_headers(out))

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
                await events.put(("result", json_body(out)))
            except Exception as exc:  # the stream must end with an answer, whatever happened
                if not isinstance(exc, HotloraError):
                    log.exception("stream generation failed")
                error = stream_error(exc)
                setattr(request.state, STREAMED_STATUS, error["status"])  # counted as what it was (middleware.py)
                await events.put(("error", error))
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


def respond_async(request: Request) -> bool:
    """Whether a ``Prefer`` header asks for ``respond-async`` (among other preferences, any case)."""
    return prefers_async(request.headers.getlist("prefer"))


def json_body(out: Generated) -> dict:
    """The /v1/generate body: the service's answer with the images (a video model's videos) base64-encoded."""
    return {**out.body(), "images": [base64.b64encode(b).decode() for b in out.images], "format": out.format}
