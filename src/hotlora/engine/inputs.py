"""A request's input images as the engine takes them: plain uint8 arrays, made once in prepare.

A client's bytes are decoded under the server's budget by ``hotlora.images`` (formats, pixel and
byte bounds, orientation, colour modes: the input is hostile); the Python API may also give PIL
images or arrays. Either way the prepared request holds HxWx3 (a mask: HxW) uint8 arrays, which
pickle as they are to the engine process, where ``as_pil`` makes the images the pipelines take.

An edit's reference images are fitted to the served size here (centre crop to its aspect ratio,
then a Lanczos resize): the reference tokens the denoiser sees then have the shape warm-up
compiled, whatever size the client sent. Image-to-image and inpaint inputs go to the pipeline
as they are: its own image processor resizes them to the size served, as plain diffusers does.
"""

from __future__ import annotations

import numpy as np

from hotlora.errors import InvalidRequest


def pixels_of(value, *, label: str, budget=None, mode: str = "RGB") -> np.ndarray:
    """``value`` (file bytes, a PIL image or a uint8 array) as an HxWx3 (``mode="RGB"``) or HxW
    (``mode="L"``) uint8 array. Bytes are decoded by ``hotlora.images.decode_image`` under
    ``budget`` (None: its defaults)."""
    from PIL import Image

    if isinstance(value, (bytes, bytearray, memoryview)):
        from hotlora.images import ImageBudget, decode_image

        return decode_image(bytes(value), label=label, budget=budget or ImageBudget(), mode=mode).pixels
    if hasattr(value, "pixels") and isinstance(getattr(value, "pixels"), np.ndarray):  # decoded already
        value = value.pixels
    if isinstance(value, Image.Image):
        return np.asarray(value.convert(mode))
    if isinstance(value, np.ndarray):
        channels = value.shape[2] if value.ndim == 3 else None
        if value.dtype != np.uint8 or not (value.ndim == 2 or channels in (1, 3)):
            raise InvalidRequest(f"{label}: an array input must be HxW or HxWx3 uint8, got {value.dtype} "
                                 f"{tuple(value.shape)}")
        if mode == "L":
            return value if value.ndim == 2 else np.asarray(Image.fromarray(value.squeeze(-1) if channels == 1
                                                                              else value).convert("L"))
        return np.repeat(value[..., None] if value.ndim == 2 else value, 3 if channels != 3 else 1, axis=-1)
    raise InvalidRequest(f"{label} must be image file bytes (PNG, JPEG or WebP), a PIL image or a uint8 array, "
                         f"got {type(value).__name__}")


def fitted(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``pixels`` centre-cropped to ``width / height`` and resized (Lanczos) to exactly that size."""
    from PIL import Image, ImageOps

    if pixels.shape[:2] == (height, width):
        return pixels
    return np.asarray(ImageOps.fit(Image.fromarray(pixels), (width, height), Image.Resampling.LANCZOS))


def as_pil(pixels: np.ndarray):
    from PIL import Image

    return Image.fromarray(pixels)
