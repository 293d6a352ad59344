"""What a generation is encoded as, per output kind of the served model (``ModelFamily.output_kind``):
images as PNG (the default), JPEG or WebP (server/images.py); a video as MP4 (the default),
animated WebP or every frame a PNG (server/video.py). A format the kind does not make is a 422
naming the ones it does, raised with the request's other checks, before anything runs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hotlora.errors import InvalidRequest
from hotlora.server import images, video

FORMATS = {"images": tuple(images.MEDIA_TYPES), "frames": video.FORMATS}  # the default first
MEDIA_TYPES = {**images.MEDIA_TYPES, **video.MEDIA_TYPES}
OTHER_ROUTES = {"frames": "POST /v1/videos or /v1/generate", "images": "POST /v1/images/generations or /v1/generate"}


def output_format(engine, fmt: str | None, kind: str | None = None) -> str:
    """The format a generation on ``engine`` is encoded in: ``fmt`` where its output kind makes it
    (else a 422 naming those it does); none asked: the kind's default. ``kind``: the one output
    kind the route serves (a 422 naming the routes for the model's own otherwise)."""
    served = engine.family.output_kind
    if kind is not None and kind != served:
        raise InvalidRequest(f"this route serves models of {kind}; the model served here makes {served}: "
                             f"{OTHER_ROUTES[served]}")
    formats = FORMATS[served]
    if fmt is None:
        return formats[0]
    if fmt not in formats:
        raise InvalidRequest(f"output format {fmt!r} is not made for a model of {served}; this one makes: "
                             f"{', '.join(formats)}")
    return fmt


def media_types(engine) -> dict[str, str]:
    """Format -> media type of what ``engine``'s model makes, its default first (an image model's
    while no engine is up: the request is refused as not ready then anyway)."""
    kind = engine.family.output_kind if engine is not None else "images"
    return {fmt: MEDIA_TYPES[fmt] for fmt in FORMATS[kind]}


class Encoded(NamedTuple):
    files: list[bytes]  # per image; per video (MP4, WebP) or every video's frames in order (PNG)
    frames: int | None = None  # a video's frames, and their rate
    fps: int | None = None


def encode(family, outputs, fmt: str, audio=None, audio_rate: int | None = None) -> Encoded:
    """The engine's outputs (PIL images; a video model's: one list of frames per video) as ``fmt``'s
    files; ``audio``: the videos' sound tracks (``GenerationResult.audio``: (videos, channels, samples)
    at ``audio_rate``), one a video. CPU work: the service calls it on a worker thread."""
    if family.output_kind != "frames":
        return Encoded([images.encode(image, fmt) for image in outputs])
    sounds = [None] * len(outputs) if audio is None else [
        video.Sound(np.asarray(track, dtype=np.float32), audio_rate) for track in audio]
    files = [file for frames, sound in zip(outputs, sounds) for file in video.encode(frames, fmt, family.fps, sound)]
    return Encoded(files, len(outputs[0]) if outputs else None, family.fps)
