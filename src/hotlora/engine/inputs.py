"""A request's input images as the engine takes them: plain uint8 arrays, made once in prepare.

A client's bytes are decoded under the request limits' budget by ``hotlora.images`` (formats, pixel and
byte bounds, orientation, colour modes: the input is hostile); the Python API may also give PIL
images or arrays. Either way the prepared request holds HxWx3 (a mask: HxW) uint8 arrays, which
pickle as they are to the engine process, where ``as_pil`` makes the images the pipelines take.

An edit's reference images are fitted to the served size here (centre crop to its aspect ratio,
then a Lanczos resize): the reference tokens the denoiser sees then have the shape warm-up
compiled, whatever size the client sent. Image-to-image and inpaint inputs are resized to the
size served by the task pipeline's own image processor, as the pipelines that take a size do it
(``runner.at_served_size``: SDXL's and SD1.5's image-to-image pipelines take none).
"""

from __future__ import annotations

import numpy as np

from hotlora.errors import InvalidRequest


def pixels_of(value, *, label: str, budget, mode: str = "RGB") -> np.ndarray:
    """``value`` (file bytes, a ``DecodedImage``, a PIL image or a uint8 array) as an HxWx3
    (``mode="RGB"``) or HxW (``mode="L"``) uint8 array. Bytes are decoded by
    ``hotlora.images.decode_image`` under ``budget`` (an ``ImageBudget``)."""
    from PIL import Image

    from hotlora.images import DecodedImage, decode_image

    if isinstance(value, (bytes, bytearray, memoryview)):
        value = decode_image(bytes(value), label=label, budget=budget, mode=mode)
    if isinstance(value, DecodedImage):
        if value.mode == mode:
            return value.pixels
        value = value.to_pil()
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or not (value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3))):
            raise InvalidRequest(f"{label}: an array input must be HxW or HxWx3 uint8, got {value.dtype} "
                                 f"{tuple(value.shape)}")
        value = Image.fromarray(value.squeeze(-1) if value.ndim == 3 and value.shape[2] == 1 else value)
    if isinstance(value, Image.Image):
        return np.asarray(value if value.mode == mode else value.convert(mode))
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
