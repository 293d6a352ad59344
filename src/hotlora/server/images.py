"""Encode the pack for the wire."""

from __future__ import annotations

import io

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode(image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    if fmt == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=92)
    elif fmt == "webp":
        image.save(buffer, format="WEBP", quality=92)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


def format_from_accept(accept: str | None) -> str:
    """The first image type the Accept header asks for that we can make; PNG otherwise."""
    for part in (accept or "").split(","):
        media = part.split(";")[0].strip().lower()
        for fmt, media_type in MEDIA_TYPES.items():
            if media == media_type:
                return fmt
    return "png"
