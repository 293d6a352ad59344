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


def format_from_accept(accept: str | None, media_types=MEDIA_TYPES) -> str | None:
    """The first of ``media_types`` (format -> media type) the Accept header asks for; None when
    it names none of them (the model's default format then)."""
    for part in (accept or "").split(","):
        media = part.split(";")[0].strip().lower()
        for fmt, media_type in media_types.items():
            if media == media_type:
                return fmt
    return None
