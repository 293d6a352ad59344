"""A client's image bytes (img2img inputs, inpainting masks, edit references) decoded as hostile input.

``decode_image(data, budget=...)`` turns bytes into a ``DecodedImage``: a read-only uint8 array
(HxWx3 RGB, or HxW for a mask), the format it was and the notes the server may pass on to the
client (frames dropped, orientation applied, colours converted). Everything is refused with the
errors of ``hotlora.errors``, answered by the HTTP edge as 413 (``RequestTooLarge``: over
``ImageBudget``), 415 (``UnsupportedMediaType``: not PNG, JPEG or WebP) or 422 (``InvalidRequest``:
truncated, corrupt, animated under the "refuse" policy).

The checks, in order, each before anything that would cost more than it:

1. the byte budget, before anything is parsed;
2. the format, from the file's magic bytes (its content, never its declared type or file name);
3. the file's structure, by hand (below), which also yields the size its header declares;
4. that size against ``max_side`` and ``max_pixels``, before Pillow is handed the file;
5. Pillow's lazy ``Image.open`` restricted to that one format, and its ``im.size`` checked again;
6. animation (``n_frames``): refused, or frame 0 kept;
7. for a PNG, its IDAT stream inflated once and counted (below);
8. the pixels decoded (``load``), EXIF orientation applied and the size checked once more;
9. the colour mode made RGB (alpha composited on ``background``) or, for a mask, one channel.

Pillow does the decoding. Written here by hand, only what Pillow does not do:

- The size check before Pillow allocates: its WebP opener creates libwebp's decoder, which
  allocates the whole canvas, inside ``Image.open``; its own guard there is the process-wide
  ``Image.MAX_IMAGE_PIXELS`` (which this module neither relies on nor changes), and only at twice
  that (~179 Mpx, a 0.7 GB canvas). PNG and JPEG open lazily, but the header is read here anyway.
- Integrity that does not depend on ``ImageFile.LOAD_TRUNCATED_IMAGES``, a process-wide switch
  any other library may turn on: with it on, Pillow decodes a truncated PNG or JPEG without a word
  and skips the CRCs of ancillary PNG chunks. Even with it off (measured, Pillow 13) Pillow
  accepts a PNG without IEND, with a bad CRC on an IDAT chunk, or whose IDAT holds fewer rows
  than its header promises (the rest left black). So the PNG's chunks are walked (every length
  and CRC, IHDR first, IEND present) and its IDAT stream is inflated once, counted and discarded
  (never kept), to check it holds exactly the bytes its header promises; the JPEG's markers are
  walked to EOI; the WebP's RIFF length is checked against the file.
- Bounds on the work a small file can ask of those walks or of the decoder: PNG chunks and JPEG
  markers counted, a progressive JPEG's scans (each one a pass over the whole image in libjpeg)
  capped.

Not detected (a limit of what Pillow exposes): a JPEG cut short and given a new EOI marker decodes
with its missing part filled in by libjpeg (a warning in libjpeg, which Pillow does not surface); and
with ``LOAD_TRUNCATED_IMAGES`` on, an error *inside* a structurally whole file's compressed data
(a corrupt Huffman code, a bad PNG row filter) is not raised by Pillow either.

No torch, no diffusers: the HTTP edge imports this. Fetching an image by URL (the egress policy)
is ``hotlora.adapters.store.images``.
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from hotlora.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from hotlora.settings import MiB
from hotlora.settings.engine import ANIMATION_POLICIES  # declared with the setting that takes them

ACCEPTED = ("PNG", "JPEG", "WEBP")  # Pillow's format names
MODES = ("RGB", "L")
ACCEPTED_TEXT = "PNG, JPEG or WebP"

# Work bounds on the structure walks (see the module's docstring). Real files stay far below them:
# encoders write a few dozen PNG chunks (IDAT every 8-64 KiB: ~2,500 for 20 MiB) and JPEG markers,
# and libjpeg's progressive mode writes ~10 scans.
MAX_PNG_CHUNKS = 65_536
MAX_JPEG_MARKERS = 4_096
MAX_JPEG_SCANS = 100


@dataclass(frozen=True)
class ImageBudget:
    """What one input image may be. ``max_bytes``: the encoded file; ``max_pixels`` and
    ``max_side``: its size, as its header declares it (checked before any pixel is decoded);
    ``animation``: an animated PNG or WebP is refused, or its first frame used; ``background``:
    the RGB colour transparent pixels are composited on."""

    max_bytes: int = 20 * MiB
    max_pixels: int = 4096 * 4096
    max_side: int = 8192
    animation: str = "first_frame"
    background: tuple[int, int, int] = (255, 255, 255)

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "max_side"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageBudget.{name} must be a positive integer, got {value!r}")
        if self.animation not in ANIMATION_POLICIES:
            raise ValueError(f"ImageBudget.animation must be one of {ANIMATION_POLICIES}, got {self.animation!r}")
        background = tuple(self.background)
        if len(background) != 3 or not all(isinstance(c, int) and 0 <= c <= 255 for c in background):
            raise ValueError(f"ImageBudget.background must be three integers 0-255, got {self.background!r}")
        object.__setattr__(self, "background", background)

    @classmethod
    def of(cls, config) -> "ImageBudget":
        """From the request limits (``RequestLimits``' ``input_image_*`` fields; a ``ServerConfig``
        carries them flattened, under the same names)."""
        return cls(config.input_image_max_bytes, config.input_image_max_pixels, config.input_image_max_side,
                   config.input_image_animation, tuple(config.input_image_background))


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """``pixels``: a read-only uint8 array, HxWx3 (RGB) or HxW (a mask, mode "L"); ``format``: what
    the content was ("PNG", "JPEG", "WEBP"); ``notes``: what was done to it that the client may want
    to know, in words it can be told."""

    pixels: np.ndarray
    format: str
    notes: tuple[str, ...] = ()

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def mode(self) -> str:
        return "L" if self.pixels.ndim == 2 else "RGB"

    def to_pil(self) -> Image.Image:
        return Image.fromarray(np.ascontiguousarray(self.pixels), self.mode)


def decode_image(data: bytes, *, label: str = "image", budget: ImageBudget, mode: str = "RGB",
                 declared_type: str | None = None) -> DecodedImage:
    """``data`` (a client's bytes) decoded within ``budget``, or refused. ``label`` names the image
    in errors and notes ("image", "mask", "images[2]"). ``mode``: "RGB", or "L" for a mask (one
    channel; a colour or transparent mask is composited on the background, then its luminance
    taken, and a note says so). ``declared_type``: the content type or file name the client gave;
    the content decides, and a note says when the two disagree."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    data = bytes(data)
    if len(data) > budget.max_bytes:
        raise RequestTooLarge(f"{label} is {len(data):,} bytes; input images may have at most "
                              f"{budget.max_bytes:,} (input_image_max_bytes)")
    fmt = sniff(data)
    if fmt is None:
        raise UnsupportedMediaType(f"{label}: {_looks_like(data)} is not an accepted image; send {ACCEPTED_TEXT}")
    notes = []
    said = _declared_format(declared_type)
    if said is not None and said != fmt:
        notes.append(f"{label} was declared as {declared_type.strip()[:80]!r} but its content is {fmt}: "
                     f"decoded as {fmt}")
    layout = _STRUCTURE[fmt](data, label)
    check_size(layout.width, layout.height, budget, label)
    with _open(data, fmt, label) as im:  # closed on the way out, refused or not (libwebp's canvas with it)
        check_size(*im.size, budget, label)
        _frames(im, fmt, budget, label, notes)
        if fmt == "PNG":
            _png_pixels_complete(data, layout, label)
        _load(im, label)
        shown = _oriented(im, label, notes)
        check_size(*shown.size, budget, label)
        pixels = _pixels(shown, mode, budget.background, label, notes)
    pixels.setflags(write=False)  # a copy of Pillow's memory (np.asarray goes through tobytes)
    return DecodedImage(pixels, fmt, tuple(notes))


def _frames(im: Image.Image, fmt: str, budget: ImageBudget, label: str, notes: list[str]) -> None:
    """An animation refused, or its first frame kept (``budget.animation``); a camera's
    multi-picture JPEG (MPO: the primary image, then previews or a stereo pair) gives its first."""
    frames = int(getattr(im, "n_frames", 1) or 1)
    if frames < 2:
        return
    if im.format == "MPO":
        notes.append(f"{label} is a multi-picture JPEG: its first of {frames:,} images was used")
        return
    name = {"PNG": "animated PNG", "WEBP": "animated WebP"}[fmt]
    if budget.animation == "refuse":
        raise InvalidRequest(f"{label} is an {name} with {frames:,} frames; this server takes still images "
                             f"({ACCEPTED_TEXT})")
    notes.append(f"{label} is an {name}: its first of {frames:,} frames was used")


def check_size(width: int, height: int, budget: ImageBudget, label: str = "image") -> None:
    """RequestTooLarge unless ``width`` x ``height`` is within ``budget``."""
    if width > budget.max_side or height > budget.max_side or width * height > budget.max_pixels:
        raise RequestTooLarge(
            f"{label} is {width:,}x{height:,} (width x height, {width * height:,} pixels); input images may "
            f"have at most {budget.max_pixels:,} pixels (input_image_max_pixels) and {budget.max_side:,} on a "
            "side (input_image_max_side)")


# ------------------------------------------------------------------ formats: what the content is


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sniff(data: bytes) -> str | None:
    """The accepted format the content is, by its magic bytes, or None."""
    if data.startswith(_PNG_SIGNATURE):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    return None


# Only to name what was sent in the refusal (415).
_OTHER_MAGIC = ((b"GIF87a", "a GIF image"), (b"GIF89a", "a GIF image"), (b"BM", "a BMP image"),
                (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"), (b"\x00\x00\x01\x00", "an ICO image"),
                (b"8BPS", "a Photoshop file"), (b"%PDF", "a PDF document"), (b"\xff\x0a", "a JPEG XL image"),
                (b"\x00\x00\x00\x0cJXL ", "a JPEG XL image"), (b"qoif", "a QOI image"))
_BRANDS = {b"avif": "an AVIF image", b"avis": "an AVIF image", b"heic": "a HEIC image", b"heix": "a HEIC image",
           b"mif1": "a HEIF image", b"msf1": "a HEIF image"}


def _looks_like(data: bytes) -> str:
    if not data:
        return "an empty body"
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return _BRANDS.get(data[8:12], "an ISO media file")
    head = data[:512].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in data[:4096].lower()):
        return "an SVG image"
    if head.startswith((b"<!doctype html", b"<html")):
        return "an HTML document"
    try:
        data[:4096].decode("utf-8")
    except UnicodeDecodeError:
        return "this content"
    return "text"


_DECLARED = {"image/png": "PNG", "image/x-png": "PNG", "image/apng": "PNG", "image/vnd.mozilla.apng": "PNG",
             "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/pjpeg": "JPEG", "image/webp": "WEBP",
             ".png": "PNG", ".apng": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".jpe": "JPEG", ".jfif": "JPEG",
             ".webp": "WEBP"}
_GENERIC = ("", "application/octet-stream", "binary/octet-stream")
_MEDIA_TOP_LEVEL = {"application", "audio", "binary", "font", "image", "message", "model", "multipart", "text", "video"}


def _declared_format(declared: str | None) -> str | None:
    """The format a content type ("image/jpeg; q=1") or a file name ("cat.JPG") claims; "?" for a
    claim of anything else; None for no claim (nothing, or a generic type)."""
    if declared is None:
        return None
    text = declared.split(";", 1)[0].strip().lower()
    if text in _GENERIC:
        return None
    if text.split("/", 1)[0] in _MEDIA_TOP_LEVEL and re.fullmatch(r"[a-z]+/[a-z0-9!#$&^_.+-]+", text):
        return _DECLARED.get(text, "?")  # a media type; anything else is a file name ("uploads/cat.jpg")
    suffix = "." + text.rsplit(".", 1)[1] if "." in text.rsplit("/", 1)[-1] else ""
    return _DECLARED.get(suffix, "?")


# ------------------------------------------------------------------ structure, by hand (see the docstring)


class _Layout(NamedTuple):
    width: int
    height: int
    raw_bytes: int = 0  # PNG: the bytes IDAT must inflate to
    idat: tuple = ()  # PNG: (start, end) of each IDAT chunk's data


def _corrupt(label: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{label} is truncated or corrupt: {why}")


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_structure(data: bytes, label: str) -> _Layout:
    """Every chunk whole and its CRC right, IHDR first and valid, IEND present; the IDAT spans and
    the bytes they must inflate to. Data after IEND is ignored, as decoders do."""
    view, pos, count, idat, header = memoryview(data), len(_PNG_SIGNATURE), 0, [], None
    while True:
        if pos + 12 > len(data):
            raise _corrupt(label, "the PNG ends before its IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, pos)
        if length > 0x7FFFFFFF or not kind.isalpha():
            raise _corrupt(label, f"a PNG chunk header is broken at byte {pos:,}")
        end = pos + 8 + length
        if end + 4 > len(data):
            raise _corrupt(label, f"the PNG's {kind.decode()} chunk runs past the end of the file")
        if zlib.crc32(view[pos + 4:end]) != struct.unpack_from(">I", data, end)[0]:
            raise _corrupt(label, f"the PNG's {kind.decode()} chunk at byte {pos:,} fails its CRC check")
        count += 1
        if count > MAX_PNG_CHUNKS:
            raise _corrupt(label, f"the PNG has more than {MAX_PNG_CHUNKS:,} chunks")
        if header is None:
            if kind != b"IHDR" or length != 13:
                raise _corrupt(label, "the PNG does not start with its IHDR chunk")
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif kind == b"IDAT":
            idat.append((pos + 8, end))
        elif kind == b"IEND":
            break
        pos = end + 4
    width, height, depth, colour, _, _, interlace = header
    if not width or not height or depth not in _PNG_DEPTHS.get(colour, ()) or interlace not in (0, 1):
        raise _corrupt(label, f"the PNG's IHDR is invalid ({width}x{height}, depth {depth}, colour type {colour})")
    if not idat:
        raise _corrupt(label, "the PNG has no IDAT (pixel data) chunk")
    bits = _PNG_CHANNELS[colour] * depth

    def rows(w, h):  # each row: a filter byte, then its pixels packed to whole bytes
        return h * (1 + (w * bits + 7) // 8) if w and h else 0

    if interlace:
        raw = sum(rows((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7)
    else:
        raw = rows(width, height)
    return _Layout(width, height, raw, tuple(idat))


def _png_pixels_complete(data: bytes, layout: _Layout, label: str) -> None:
    """The IDAT stream inflates to exactly the bytes the header promises and ends: inflated in
    1 MiB pieces that are counted and dropped, so it costs time, not memory, and stops at the
    promised size (a stream that would inflate further is refused there)."""
    view, inflater, total = memoryview(data), zlib.decompressobj(), 0
    try:
        for start, end in layout.idat:
            pending = view[start:end]
            while pending:
                total += len(inflater.decompress(pending, MiB))
                if total > layout.raw_bytes:
                    raise _corrupt(label, "the PNG's pixel data is larger than its header declares")
                pending = inflater.unconsumed_tail
            if inflater.eof:
                break
    except zlib.error as exc:
        raise _corrupt(label, f"the PNG's pixel data does not inflate ({exc})") from None
    if total < layout.raw_bytes:
        raise _corrupt(label, f"the PNG's pixel data ends early ({total:,} of {layout.raw_bytes:,} bytes)")
    if not inflater.eof:
        raise _corrupt(label, "the PNG's compressed pixel data is not terminated")


_FILL = re.compile(rb"\xff+")
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # in entropy-coded data: not stuffing, not RSTn
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_structure(data: bytes, label: str) -> _Layout:
    """The markers walked from SOI to EOI: every segment whole, a frame header (SOF) before the
    first scan, at most ``MAX_JPEG_SCANS`` scans, each scan's data ended by a marker."""
    pos, markers, scans, size = 2, 0, 0, None
    while True:
        if pos >= len(data) or data[pos] != 0xFF:
            raise _corrupt(label, "the JPEG ends before its end-of-image marker" if pos >= len(data)
                           else f"the JPEG has no marker where one must be (byte {pos:,})")
        pos = _FILL.match(data, pos).end()  # fill bytes (0xFF runs) may precede any marker
        if pos >= len(data):
            raise _corrupt(label, "the JPEG ends before its end-of-image marker")
        marker, pos = data[pos], pos + 1
        markers += 1
        if markers > MAX_JPEG_MARKERS:
            raise _corrupt(label, f"the JPEG has more than {MAX_JPEG_MARKERS:,} markers")
        if marker == 0xD9:
            if size is None or not scans:
                raise _corrupt(label, "the JPEG ends before any image data")
            return _Layout(*size)
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # RSTn, TEM: no length
            continue
        if marker in (0x00, 0xD8) or pos + 2 > len(data):
            raise _corrupt(label, "the JPEG's marker structure is broken")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2 or pos + length > len(data):
            raise _corrupt(label, f"a JPEG segment (marker 0x{marker:02X}) runs past the end of the file")
        if marker in _SOF and size is None:
            if length < 8:
                raise _corrupt(label, "the JPEG's frame header is too short")
            height, width = struct.unpack_from(">HH", data, pos + 3)
            if not width or not height:
                raise _corrupt(label, f"the JPEG's frame header declares a {width}x{height} image")
            size = (width, height)
        pos += length
        if marker == 0xDA:
            if size is None:
                raise _corrupt(label, "the JPEG has a scan before its frame header")
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise _corrupt(label, f"the JPEG has more than {MAX_JPEG_SCANS} scans")
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                raise _corrupt(label, "the JPEG ends inside its image data")
            pos = found.start()


def _webp_structure(data: bytes, label: str) -> _Layout:
    """The RIFF container's length against the file, and the canvas size from the first chunk
    (VP8X, or a lone VP8 / VP8L bitstream), read before libwebp allocates the canvas."""
    if len(data) < 30:
        raise _corrupt(label, "the WebP file is shorter than its header")
    (riff,) = struct.unpack_from("<I", data, 4)
    if riff + 8 > len(data):
        raise _corrupt(label, f"the WebP's RIFF header promises {riff + 8:,} bytes; the file has {len(data):,}")
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = 1 + int.from_bytes(data[24:27], "little")
        height = 1 + int.from_bytes(data[27:30], "little")
    elif chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = (v & 0x3FFF for v in struct.unpack_from("<HH", data, 26))
    elif chunk == b"VP8L" and data[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", data, 21)
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    else:
        raise _corrupt(label, f"the WebP's first chunk ({chunk!r}) is not an image header")
    if not width or not height:
        raise _corrupt(label, f"the WebP declares a {width}x{height} image")
    return _Layout(width, height)


_STRUCTURE = {"PNG": _png_structure, "JPEG": _jpeg_structure, "WEBP": _webp_structure}

# What Pillow raises for a file it cannot read: its plugins' SyntaxError, OSError (the decoders'
# "broken data stream", "image file is truncated", UnidentifiedImageError), struct errors, EOFError
# (WebP's "failed to decode next frame"), ValueError (a PNG text chunk over its limit).
_PILLOW_FAILURES = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error, zlib.error)


def _open(data: bytes, fmt: str, label: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own process-wide limit (MAX_IMAGE_PIXELS), when it is lower than ours: a warning
        # only reaches here where warnings are errors.
        raise RequestTooLarge(f"{label} is over this process's image size limit: {exc}") from None
    except _PILLOW_FAILURES as exc:
        raise _corrupt(label, f"{fmt} header unreadable ({exc})") from None


def _load(im: Image.Image, label: str) -> None:
    try:
        im.seek(0)
        im.load()
    except _PILLOW_FAILURES as exc:
        raise _corrupt(label, f"{im.format} pixel data unreadable ({exc})") from None


# ------------------------------------------------------------------ orientation and colour


def _oriented(im: Image.Image, label: str, notes: list[str]) -> Image.Image:
    """EXIF orientation applied (the pixels as a viewer shows them). An EXIF block Pillow cannot
    read is ignored with a note: it is metadata, the pixels are whole."""
    try:
        orientation = im.getexif().get(0x0112, 1)
        if orientation in (2, 3, 4, 5, 6, 7, 8):
            im = ImageOps.exif_transpose(im)
            notes.append(f"{label}: EXIF orientation {orientation} applied")
    except _PILLOW_FAILURES + (KeyError,) as exc:
        notes.append(f"{label}: its EXIF data is unreadable and was ignored ({type(exc).__name__})")
    return im


_SIXTEEN = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _pixels(im: Image.Image, mode: str, background: tuple[int, int, int], label: str,
            notes: list[str]) -> np.ndarray:
    """The image as a uint8 array in ``mode``. Grey stays grey for a mask; anything else becomes
    RGB first (CMYK and YCbCr converted, a palette expanded, alpha and transparency composited on
    ``background``), and a mask then takes its luminance (ITU-R 601-2, Pillow's "L")."""
    grey = im.mode in _SIXTEEN + ("1", "L", "LA", "La", "F")
    if im.mode in _SIXTEEN:
        im = _eight_bits(im)
        notes.append(f"{label}: 16-bit grey reduced to 8 bits")
    elif im.mode == "F":  # from no accepted format; kept for callers handing over Pillow images
        im = im.convert("L")
    if im.mode in ("1", "L") and "transparency" not in im.info:
        im = im.convert("L")
        return np.asarray(im if mode == "L" else im.convert("RGB"))
    if im.mode == "CMYK":
        notes.append(f"{label}: CMYK converted to RGB (no colour profile applied)")
    if "transparency" in im.info or im.mode in ("LA", "La", "PA", "RGBa", "RGBA"):
        im = _composited(im.convert("RGBA"), background, label, notes)
    rgb = im if im.mode == "RGB" else im.convert("RGB")
    if mode == "RGB":
        return np.asarray(rgb)
    if not grey:
        notes.append(f"{label}: a colour image used as a mask: its luminance was taken")
    return np.asarray(rgb.convert("L"))


def _eight_bits(im: Image.Image) -> Image.Image:
    """16-bit grey to 8 bits, scaled (Pillow's own conversion clips every value above 255 to white)."""
    wide = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")


def _composited(rgba: Image.Image, background: tuple[int, int, int], label: str, notes: list[str]) -> Image.Image:
    if rgba.getchannel("A").getextrema()[0] == 255:  # opaque throughout: nothing to composite
        return rgba.convert("RGB")
    notes.append(f"{label}: transparency composited on {_colour_name(background)}")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background, 255)), rgba).convert("RGB")


def _colour_name(rgb: tuple[int, int, int]) -> str:
    return {(255, 255, 255): "white", (0, 0, 0): "black"}.get(tuple(rgb), "rgb({}, {}, {})".format(*rgb))
