"""OpenAI's videos API over the jobs (server/jobs.py; a video is a job of kind "video", one
mechanism): ``POST /v1/videos`` (JSON, or multipart as the openai client sends it) makes a job and
answers OpenAI's video object (``jobstore.video_object``: queued, then in_progress with a progress
percentage, completed or failed); ``GET /v1/videos/{id}``; ``GET /v1/videos/{id}/content`` the MP4
(``variant=thumbnail``: its first frame as WebP; ``spritesheet`` is not made); ``DELETE`` (cancels
an unfinished video and deletes it); ``GET /v1/videos`` the caller's own. A video belongs to the
key that made it: to any other it does not exist (404). Errors are answered in OpenAI's shape.

``seconds`` -> frames: ``seconds x fps + 1`` (a video of n frames spans (n - 1) / fps seconds from
its first frame to its last: Wan's 81 frames at 16 fps are its "5 seconds"). It must come out a
whole frame count the engine serves, else a 422 listing the seconds served; none given: the
engine's default frame count. Everything is checked before the job exists.

``input_reference`` (an image file in the form, as the openai client uploads it; in a JSON body an
image as the other routes take one: base64, a data URL or an http(s) URL) is the video's first
frame: the task ``image-to-video``, served by an engine started with it (a 422 naming the served
tasks otherwise). An uploaded or base64 image is decoded when the job is created (one that is no
image: 415, no job); a URL is fetched when the job runs, as a job's adapters are (a failed fetch
fails the job, saying why).
"""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from hotlora.errors import InvalidRequest, JobNotFound, UnsupportedMediaType
from hotlora.server import video
from hotlora.server.access import public_model_id
from hotlora.server.errors import validation_error
from hotlora.server.inputs import ImageInput
from hotlora.server.jobs import Jobs
from hotlora.server.jobstore import JobRecord, video_object
from hotlora.server.schemas import MAX_FORM_FIELDS, OpenAIVideosRequest, place

POLL_AFTER_MS = 500  # the openai client's poll helper waits this long between polls (else 1 s)


# Long as the other route modules' are: its routes are closures over the same jobs and service.
def videos_routes(jobs: Jobs) -> APIRouter:
    service = jobs.service
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/v1/videos")
    async def create_video(request: Request):
        body, input_frames = await videos_body(request)
        engine = service.worker.engine
        if engine is None:
            raise service.worker.not_ready()
        if engine.family.output_kind != "frames":
            raise InvalidRequest(f"the model served here ({public_model_id(engine)}) makes images, not videos: "
                                 "POST /v1/images/generations or /v1/generate")
        rules, fps = engine.rules, engine.family.fps
        frames = frames_for(body.seconds, fps, rules.frames, rules.sizes_only)
        size = body.size if body.size not in (None, "auto") else rules.size_names()[0]
        # The model asked for, else the served one by its id: a video object never shows this machine's paths.
        # No ``seconds``: the default frame count, reported as the seconds it makes.
        shown = frames if frames is not None else rules.default_frames()
        params = {"model": body.model or public_model_id(engine), "seconds": seconds_of(shown, fps), "size": size,
                  "prompt": body.prompt}
        record = await jobs.create(request, body.to_request(frames, input_frames), "mp4", retention_s=body.retention_s,
                                   kind="video", params=params)
        return video_object(record)

    @router.get("/v1/videos")
    async def list_videos(request: Request, limit: int = Query(20, ge=1, le=100),
                          order: str = Query("desc", pattern="^(asc|desc)$"), after: str | None = None):
        """OpenAI's list: newest first (``order=desc``), ``limit`` after the id ``after``."""
        records = jobs.store.owned(service.access.client_of(request), kind="video")
        if order == "desc":
            records.reverse()
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise JobNotFound(f"no video {after[:64]!r}")
            records = records[ids.index(after) + 1:]
        page = [video_object(r) for r in records[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(records) > limit}

    @router.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request):
        record = owned_video(jobs, request, video_id)
        headers = {} if record.finished else {"openai-poll-after-ms": str(POLL_AFTER_MS)}
        return JSONResponse(video_object(record), headers=headers)

    @router.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request, variant: str = "video"):
        record = owned_video(jobs, request, video_id)
        if variant not in ("video", "thumbnail"):
            raise InvalidRequest(f"variant {variant[:32]!r} is not made here; variants: video (MP4), thumbnail (WebP)")
        _, files = jobs.content(record)  # 409 until it has succeeded
        if record.result["media_type"] != video.MEDIA_TYPES["mp4"]:  # a /v1/generate job in another format
            raise InvalidRequest(f"this video was made as {record.result['meta'].get('format')}, not MP4: "
                                 f"GET /v1/jobs/{record.id}/content")
        if variant == "thumbnail":
            return Response(await asyncio.to_thread(video.thumbnail, files[0]), media_type=video.MEDIA_TYPES["webp"])
        return Response(files[0], media_type=video.MEDIA_TYPES["mp4"])

    @router.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str, request: Request):
        """Deleted outright, as OpenAI does; an unfinished one is cancelled first (one already
        running on the engine stops at its next denoising step)."""
        record = owned_video(jobs, request, video_id)
        if not record.finished:
            jobs.cancel(request, video_id)
        jobs.store.delete(video_id)
        return {"id": record.id, "object": "video.deleted", "deleted": True}

    return router


def owned_video(jobs: Jobs, request: Request, video_id: str) -> JobRecord:
    """The caller's video; JobNotFound for another key's, and for a job that is no video."""
    record = jobs.get(request, video_id)
    if record.kind != "video":
        raise JobNotFound(f"no video {video_id[:64]!r}")
    return record


FRAME_TOLERANCE = 1e-3  # of a frame, between a request's seconds x fps and a whole frame count


def seconds_of(frames: int, fps: int) -> str:
    return f"{(frames - 1) / fps:g}"


def frames_for(seconds, fps: int, served: tuple[int, ...], served_only: bool) -> int | None:
    """The frame count ``seconds`` asks for (``seconds x fps + 1``), or None (the default) when
    none given; a 422 naming the served seconds for one that is no whole frame count or one not
    served (``served_only``: a compiled engine serves only the counts it warmed up)."""
    if seconds is None or seconds == "":
        return None
    listed = ", ".join(f"{seconds_of(f, fps)} ({f} frames)" for f in served)
    try:
        value = float(seconds)
    except ValueError:
        raise InvalidRequest(f"seconds must be a number, got {str(seconds)[:16]!r}; served: {listed}") from None
    exact = value * fps
    # Within a thousandth of a frame: a count whose seconds are no short decimal at the rate (8 frames
    # at 24 fps) is asked for as the listed seconds, six significant digits (0.333333: 7.999992 frames).
    if not (math.isfinite(exact) and exact >= 0 and abs(exact - round(exact)) < FRAME_TOLERANCE):
        raise InvalidRequest(f"seconds {seconds} is not a whole number of frames at {fps} fps (frames = seconds x "
                             f"fps + 1); served: {listed}")
    frames = round(exact) + 1
    if served_only and frames not in served:
        raise InvalidRequest(f"seconds {seconds} ({frames} frames at {fps} fps) is not served; served: {listed}")
    return frames


# The body's input images: OpenAI's first frame, and hotlora's last frame (Wan FLF2V and 2.2 I2V).
FRAME_FIELDS = ("input_reference", "last_frame")


async def videos_body(request: Request) -> tuple[OpenAIVideosRequest, tuple[ImageInput, ...]]:
    """The request body: JSON, or a multipart form (the openai client's way; bracketed keys nested
    as ``extra_body`` flattens them: ``adapters[style][ref]``); and its input frames: the first
    (``input_reference``) of an image-to-video request, and its last (``last_frame``, which needs a
    first): a form's files (no other field may be one), or a JSON body's image texts."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    frames: dict[str, ImageInput] = {}
    if media == "application/json":
        try:
            fields = await request.json()
        except ValueError:
            raise InvalidRequest("invalid request: body: not JSON") from None
        if not isinstance(fields, dict):
            raise InvalidRequest("invalid request: body: a JSON object is expected")
        for name in FRAME_FIELDS:
            reference = fields.pop(name, None)
            if reference is not None:
                if not isinstance(reference, str) or not reference:
                    raise InvalidRequest(f"{name} must be an image: base64, a data: URL or an http(s) URL")
                frames[name] = ImageInput(text=reference)
    elif media in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=len(FRAME_FIELDS), max_fields=MAX_FORM_FIELDS)
        try:
            fields = {}
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if key not in FRAME_FIELDS or key in frames:
                        raise InvalidRequest(f"form field {key[:80]!r} is a file; the files taken are input_reference "
                                             "(image-to-video's first frame) and last_frame, one each")
                    frames[key] = ImageInput(data=await value.read(), content_type=value.content_type)
                    continue
                if key in FRAME_FIELDS:
                    raise InvalidRequest(f"form field {key!r} must be a file (an image upload), not text")
                place(fields, key, value)
        finally:
            await form.close()
    else:
        raise UnsupportedMediaType("POST /v1/videos takes application/json or multipart/form-data")
    if "last_frame" in frames and "input_reference" not in frames:
        raise InvalidRequest("last_frame needs a first frame: input_reference")
    try:
        return OpenAIVideosRequest.model_validate(fields), tuple(frames[name] for name in FRAME_FIELDS if name in frames)
    except ValidationError as exc:
        raise InvalidRequest(validation_error(exc.errors())) from None
