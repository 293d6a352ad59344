"""The jobs resource (server/jobs.py): ``GET /v1/jobs/{id}`` (status, progress, error),
``/content`` (the result: the JSON ``/v1/generate`` answers, or the image itself when there is one
and the client's ``Accept`` asks for an image; 409 until it has succeeded), ``/events`` (SSE:
progress per step, then the job), ``DELETE`` (cancel an unfinished job, delete a finished one).
A job is created by ``POST /v1/generate`` with ``Prefer: respond-async`` (routes_json.py)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hotlora.server.jobs import Jobs, view
from hotlora.server.service import result_headers


def jobs_routes(jobs: Jobs) -> APIRouter:
    router = APIRouter(dependencies=[Depends(jobs.service.access.require("generate"))])

    @router.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        return view(jobs.get(request, job_id))

    @router.get("/v1/jobs/{job_id}/content")
    async def job_content(job_id: str, request: Request):
        record = jobs.get(request, job_id)
        out, files = jobs.content(record)
        media_type = record.result["media_type"]
        if len(files) == 1 and wants(request, media_type):
            return Response(files[0], media_type=media_type, headers=result_headers(out))
        body = {**out.body(), "images": [base64.b64encode(b).decode() for b in files],
                "format": record.result["meta"].get("format")}
        return JSONResponse(body, headers=result_headers(out))

    @router.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        jobs.get(request, job_id)  # a 404 before the stream starts, not inside it
        return StreamingResponse(jobs.events(request, job_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.delete("/v1/jobs/{job_id}")
    async def delete_job(job_id: str, request: Request):
        record = jobs.cancel(request, job_id)
        return {**view(record), "deleted": record.finished and jobs.store.get(job_id) is None}

    return router


def wants(request: Request, media_type: str) -> bool:
    """Whether the client's ``Accept`` names ``media_type`` (or ``image/*``) rather than JSON."""
    accept = [part.split(";")[0].strip().lower() for part in request.headers.get("accept", "").split(",")]
    return media_type in accept or (media_type.startswith("image/") and "image/*" in accept)
