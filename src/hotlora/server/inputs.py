"""A request's input images as the APIs receive them, made pixels before the engine is touched.

The routes give each image as an ``ImageInput``: the text a JSON body carries (base64, a ``data:``
URL, or an ``http(s)`` URL) or a multipart upload's bytes. ``load_inputs`` (the service calls it
while the request's adapters are fetched) brings each to a ``DecodedImage``: a URL fetched under
the adapter store's egress policy for client-chosen URLs (``adapters/store/images.py``: public
addresses only unless listed, every redirect re-checked, bytes and time bounded), then decoded by
``hotlora.images`` under the engine's request limits. All of it on a worker thread, never the
event loop; ``Engine.prepare`` then takes the decoded pixels as they are.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from hotlora.errors import InvalidRequest, RequestTooLarge

# ``data:image/png;base64,....``: what a browser's FileReader and most SDKs write.
DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.ASCII)


@dataclass(frozen=True)
class ImageInput:
    """One input image as a route received it: ``text`` from a JSON body (base64, a data URL, or
    an http(s) URL to fetch) or ``data``, an upload's bytes; ``content_type`` as the client
    labelled it (the content decides: ``hotlora.images.decode_image``)."""

    text: str | None = None
    data: bytes | None = None
    content_type: str | None = None

    @property
    def url(self) -> str | None:
        text = self.text
        return text if text is not None and text[:8].lower().startswith(("http://", "https://")) else None


def load_image(value, *, label: str, mode: str, budget, policy, fetch_timeout_s: float):
    """``value`` as a ``DecodedImage`` when it is an ``ImageInput`` (anything else, the Python
    API's PIL images and arrays, goes to the engine as it is). Blocking: call it on a thread."""
    from hotlora.adapters.store.images import fetch_image_bytes
    from hotlora.images import decode_image

    if not isinstance(value, ImageInput):
        return value
    declared = value.content_type
    if value.url is not None:
        fetched = fetch_image_bytes(value.url, policy=policy, budget=budget, timeout_s=fetch_timeout_s, label=label)
        data, declared = fetched.data, fetched.content_type
    elif value.text is not None:
        data, declared = _base64_image(value.text, label, budget.max_bytes)
    else:
        data = value.data
    return decode_image(data, label=label, budget=budget, mode=mode, declared_type=declared)


def _base64_image(text: str, label: str, max_bytes: int) -> tuple[bytes, str | None]:
    """A base64 image (optionally a data URL) as bytes and its declared type; bounded before decoding."""
    declared = None
    match = DATA_URL.match(text[:256])
    if match:
        declared, text = match.group("type"), text[match.end():]
    elif text.startswith("data:"):
        raise InvalidRequest(f"{label}: a data URL must be base64 (data:image/png;base64,...)")
    if len(text) // 4 * 3 > max_bytes + 2:  # the decoded size, known from the length alone
        raise RequestTooLarge(f"{label} is about {len(text) // 4 * 3:,} bytes; input images may have at most "
                              f"{max_bytes:,} (input_image_max_bytes)")
    try:
        return base64.b64decode(text, validate=True), declared
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{label} is neither an http(s) URL nor valid base64 (a data: URL or plain base64 of "
                             "a PNG, JPEG or WebP file)") from None


def image_label(index: int, count: int) -> str:
    """How an input image is named in errors, as ``Engine.prepare`` names it."""
    return f"image {index + 1}" if count > 1 else "image"
