"""Input images decoded as hostile bytes (hotlora.images): every hostile file is built here, in
memory, with Pillow or by hand, and each test asserts what would fail if a check went missing."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from hotlora import images
from hotlora.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from hotlora.images import DecodedImage, ImageBudget, decode_image
from hotlora.server.errors import status_of
from hotlora.settings import ServerConfig

BUDGET = ImageBudget()


# ----------------------------------------------------------------------------- files, built here


def encoded(im: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **options)
    return out.getvalue()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_by_hand(width, height, idat: bytes, depth=8, colour=2, interlace=0, extra=()) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    return (images._PNG_SIGNATURE + chunk(b"IHDR", ihdr) + b"".join(extra) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


def chunks(png: bytes) -> list[tuple[bytes, int, int]]:
    """(type, offset, data length) of each chunk."""
    out, pos = [], 8
    while pos < len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        out.append((kind, pos, length))
        pos += 12 + length
    return out


def rgb_noise(height=48, width=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """13000x13000 1-bit grey, all black: ~20 KB of file, 169 Mpx (169 MB as Pillow holds mode "1")."""
    row = b"\0" * (1 + (13000 + 7) // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(13000)) + packer.flush()
    return png_by_hand(13000, 13000, idat, depth=1, colour=0)


@pytest.fixture
def opened(monkeypatch):
    """Every call to Pillow's Image.open, recorded (the refusals below must come before it)."""
    calls = []
    real = Image.open

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(Image, "open", spy)
    return calls


# ----------------------------------------------------------------------------- budget and settings


def test_the_budget_defaults_and_the_settings_agree():
    assert ImageBudget.of(ServerConfig()) == ImageBudget() == ImageBudget(20 * 1024**2, 4096 * 4096, 8192,
                                                                          "first_frame", (255, 255, 255))
    budget = ImageBudget.of(ServerConfig(input_image_max_side=64, input_image_background="0,0,0",
                                         input_image_animation="refuse", input_image_max_bytes=10,
                                         input_image_max_pixels=100))
    assert budget == ImageBudget(10, 100, 64, "refuse", (0, 0, 0))
    assert ImageBudget().max_pixels < Image.MAX_IMAGE_PIXELS  # below Pillow's own warning threshold


@pytest.mark.parametrize("bad", [dict(max_bytes=0), dict(max_side=-1), dict(animation="all"),
                                 dict(background=(0, 0)), dict(background=(0, 0, 256))])
def test_an_impossible_budget_is_refused(bad):
    with pytest.raises(ValueError):
        ImageBudget(**bad)


def test_the_byte_budget_is_checked_before_anything_is_parsed(opened, monkeypatch):
    data = encoded(Image.fromarray(rgb_noise()), "PNG")
    monkeypatch.setattr(images, "_STRUCTURE", None)  # nothing may look at the structure either
    with pytest.raises(RequestTooLarge, match=rf"{len(data):,} bytes.*at most 100 \(input_image_max_bytes\)") as info:
        decode_image(data, budget=ImageBudget(max_bytes=100))
    assert opened == [] and status_of(info.value) == 413


def test_a_decompression_bomb_is_refused_from_its_header_without_allocating(bomb, opened):
    assert len(bomb) < 64 * 1024
    stats = Image.core.get_stats()
    tracemalloc.start()
    try:
        with pytest.raises(RequestTooLarge) as info:
            decode_image(bomb, budget=BUDGET)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "13,000x13,000" in str(info.value) and "169,000,000 pixels" in str(info.value)
    assert "16,777,216" in str(info.value) and "8,192" in str(info.value)  # the limits, named
    assert peak < 1024**2  # Python and numpy: a fraction of the 21 MB of raw rows, let alone 169 MB
    assert opened == []  # Pillow never saw it: its image memory cannot have grown
    assert Image.core.get_stats()["new_count"] == stats["new_count"]
    assert status_of(info.value) == 413


def test_a_30000_square_png_header_is_refused_before_pillow_opens_it(opened):
    header = png_by_hand(30000, 30000, zlib.compress(b"\0" * 16))  # valid CRCs, a lying IDAT never inflated
    with pytest.raises(RequestTooLarge, match="30,000x30,000"):
        decode_image(header, budget=BUDGET)
    assert opened == []


def test_a_webp_header_is_checked_before_libwebp_allocates_its_canvas(opened):
    # VP8X: canvas 16000x16000 (a 1 GB RGBA canvas that Pillow's opener would allocate).
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0\0\0\0" + (16000 - 1).to_bytes(3, "little") * 2
    data = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    with pytest.raises(RequestTooLarge, match="16,000x16,000"):
        decode_image(data, budget=BUDGET)
    real = encoded(Image.new("RGB", (300, 20)), "WEBP")
    with pytest.raises(RequestTooLarge, match="300x20"):
        decode_image(real, budget=ImageBudget(max_side=256))
    assert opened == []


def test_the_side_limit_holds_even_when_the_area_is_small():
    data = encoded(Image.new("L", (9000, 2)), "PNG")
    with pytest.raises(RequestTooLarge, match="9,000x2"):
        decode_image(data, budget=BUDGET)
    assert decode_image(data, budget=ImageBudget(max_side=9000)).width == 9000


def test_pillows_own_lower_limit_still_refuses_as_too_large(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # another library's choice, not ours
    with pytest.raises(RequestTooLarge):
        decode_image(encoded(Image.new("RGB", (100, 100)), "PNG"), budget=BUDGET)


def test_a_zlib_bomb_inside_a_small_png_stops_at_the_declared_size():
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(b"\0" * 1024**2) for _ in range(64)) + packer.flush()  # 64 MB of zeros
    data = png_by_hand(100, 100, idat)  # its header promises 30,100 bytes
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="larger than its header declares"):
            decode_image(data, budget=BUDGET)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024**2


def test_work_bounds_on_png_chunks_and_jpeg_scans():
    spam = [chunk(b"spAm", b"")] * (images.MAX_PNG_CHUNKS + 1)
    with pytest.raises(InvalidRequest, match="more than 65,536 chunks"):
        decode_image(png_by_hand(4, 4, zlib.compress(b"\0" * 52), extra=spam), budget=BUDGET)
    sof = b"\xff\xc2" + struct.pack(">HBHHB", 11, 8, 16, 16, 1) + b"\x01\x11\x00"
    scan = b"\xff\xda" + struct.pack(">HB", 8, 1) + b"\x01\x00\x00\x3f\x00" + b"\x12"
    many = b"\xff\xd8" + sof + scan * (images.MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    with pytest.raises(InvalidRequest, match="more than 100 scans"):
        decode_image(many, budget=BUDGET)


# ----------------------------------------------------------------------------- formats


def test_png_jpeg_and_webp_decode_to_read_only_uint8_arrays():
    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([x * 4, y * 5, 255 - x * 2], axis=-1).astype(np.uint8)  # smooth: JPEG keeps it close
    for fmt, options, tolerance in [("PNG", {}, 0), ("JPEG", {"quality": 95}, 2), ("WEBP", {"lossless": True}, 0)]:
        decoded = decode_image(encoded(Image.fromarray(pixels), fmt, **options), budget=BUDGET)
        assert isinstance(decoded, DecodedImage) and decoded.format == fmt and decoded.notes == ()
        assert decoded.pixels.dtype == np.uint8 and decoded.pixels.shape == (48, 64, 3)
        assert (decoded.width, decoded.height, decoded.mode) == (64, 48, "RGB")
        assert np.abs(decoded.pixels.astype(int) - pixels).mean() <= tolerance, fmt
        assert not decoded.pixels.flags.writeable
        with pytest.raises(ValueError):
            decoded.pixels[0, 0, 0] = 1
        again = decoded.to_pil()
        assert again.mode == "RGB" and again.size == (64, 48)
        assert np.array_equal(np.asarray(again), decoded.pixels)


@pytest.mark.parametrize("data, named", [
    (encoded(Image.new("RGB", (8, 8)), "GIF"), "a GIF image"),
    (encoded(Image.new("RGB", (8, 8)), "BMP"), "a BMP image"),
    (encoded(Image.new("RGB", (8, 8)), "TIFF"), "a TIFF image"),
    (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"></svg>', "an SVG image"),
    (b"<!DOCTYPE html><html><img src=x onerror=alert(1)></html>", "an HTML document"),
    (b"just some words", "text"),
    (b"", "an empty body"),
    (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00", "a HEIC image"),
    (bytes(range(256)), "this content"),
])
def test_anything_but_png_jpeg_and_webp_is_an_unsupported_media_type(data, named):
    with pytest.raises(UnsupportedMediaType) as info:
        decode_image(data, label="images[1]", budget=BUDGET, declared_type="image/png")
    assert str(info.value) == f"images[1]: {named} is not an accepted image; send PNG, JPEG or WebP"
    assert status_of(info.value) == 415


def test_the_content_decides_and_a_mislabelled_file_says_so():
    png = encoded(Image.fromarray(rgb_noise()), "PNG")
    for declared in ("image/jpeg", "photo.JPG", "uploads/v1.2/photo.jpeg", "image/gif", "text/html; charset=utf-8",
                     "cat"):
        decoded = decode_image(png, budget=BUDGET, declared_type=declared)
        assert decoded.format == "PNG" and np.array_equal(decoded.pixels, rgb_noise())
        (note,) = decoded.notes
        assert repr(declared) in note and "its content is PNG" in note
    for agreeing in (None, "image/png", "IMAGE/PNG; q=1", "x.png", "uploads/cat.PNG", "C:\\cat.png",
                     "application/octet-stream", ""):
        assert decode_image(png, budget=BUDGET, declared_type=agreeing).notes == ()
    with pytest.raises(UnsupportedMediaType):
        decode_image(b"<html>not an image</html>", budget=BUDGET, declared_type="image/jpeg")


# ----------------------------------------------------------------------------- truncated and lying files


def _png() -> bytes:
    return encoded(Image.fromarray(rgb_noise()), "PNG")


def _with_bad_crc(png: bytes, kind: bytes) -> bytes:
    kind_, pos, length = next(c for c in chunks(png) if c[0] == kind)
    broken = bytearray(png)
    broken[pos + 8 + length] ^= 0xFF
    return bytes(broken)


def _promising_more_rows() -> bytes:
    """A PNG whose IDAT (valid CRC, a whole zlib stream) holds half the rows its IHDR declares."""
    raw = zlib.decompress(b"".join(_png()[p + 8:p + 8 + n] for kind, p, n in chunks(_png()) if kind == b"IDAT"))
    return png_by_hand(64, 48, zlib.compress(raw[:len(raw) // 2]))


def _unterminated() -> bytes:
    raw = zlib.decompress(b"".join(_png()[p + 8:p + 8 + n] for kind, p, n in chunks(_png()) if kind == b"IDAT"))
    packer = zlib.compressobj()
    return png_by_hand(64, 48, packer.compress(raw) + packer.flush(zlib.Z_SYNC_FLUSH))


def _jpeg() -> bytes:
    return encoded(Image.fromarray(rgb_noise()), "JPEG", quality=90)


def _webp() -> bytes:
    return encoded(Image.fromarray(rgb_noise()), "WEBP")


LYING = {
    "png cut in half": lambda: _png()[:len(_png()) // 2],
    "png without IEND": lambda: _png()[:-12],
    "png with a bad IDAT CRC": lambda: _with_bad_crc(_png(), b"IDAT"),
    "png with a bad IHDR CRC": lambda: _with_bad_crc(_png(), b"IHDR"),
    "png with a bad ancillary CRC": lambda: _with_bad_crc(
        encoded(Image.fromarray(rgb_noise()), "PNG", pnginfo=_text_info()), b"tEXt"),
    "png promising more rows": _promising_more_rows,
    "png with an unterminated stream": _unterminated,
    "png signature then garbage": lambda: images._PNG_SIGNATURE + b"\x00" * 40,
    "jpeg cut in half": lambda: _jpeg()[:len(_jpeg()) // 2],
    "jpeg without EOI": lambda: _jpeg()[:-2],
    "jpeg header only": lambda: _jpeg()[:20],
    "webp cut in half": lambda: _webp()[:len(_webp()) // 2],
    "webp one byte short": lambda: _webp()[:-1],
}


def _text_info():
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("comment", "hello")
    return info


@pytest.mark.parametrize("lenient", [False, True], ids=["strict-pillow", "LOAD_TRUNCATED_IMAGES"])
@pytest.mark.parametrize("name", list(LYING))
def test_truncated_and_lying_files_are_refused_whatever_pillows_global_says(name, lenient, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", lenient)  # as another library might set it
    with pytest.raises(InvalidRequest, match=r"^image is truncated or corrupt: ") as info:
        decode_image(LYING[name](), budget=BUDGET)
    assert status_of(info.value) == 422
    assert ImageFile.LOAD_TRUNCATED_IMAGES is lenient  # we read it, never change it


def test_pixels_after_the_end_marker_are_ignored_as_decoders_do():
    assert decode_image(_png() + b"trailing", budget=BUDGET).format == "PNG"
    assert decode_image(_jpeg() + b"\0" * 100, budget=BUDGET).format == "JPEG"


# ----------------------------------------------------------------------------- animation


def _frames():
    return [Image.new("RGB", (16, 12), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]


@pytest.mark.parametrize("fmt, options, name", [("PNG", {}, "animated PNG"), ("WEBP", {"lossless": True}, "animated WebP")])
def test_animations_are_refused_or_give_their_first_frame(fmt, options, name):
    first, *rest = _frames()
    data = encoded(first, fmt, save_all=True, append_images=rest, duration=100, **options)
    with pytest.raises(InvalidRequest, match=f"is an {name} with 3 frames; this server takes still images") as info:
        decode_image(data, budget=ImageBudget(animation="refuse"))
    assert status_of(info.value) == 422
    decoded = decode_image(data, budget=ImageBudget(animation="first_frame"))
    assert decoded.format == fmt and decoded.notes == (f"image is an {name}: its first of 3 frames was used",)
    assert (decoded.pixels == (255, 0, 0)).all()


def test_a_multi_picture_jpeg_gives_its_primary_image_under_either_policy():
    first, *rest = _frames()
    data = encoded(first, "MPO", save_all=True, append_images=rest)
    decoded = decode_image(data, budget=ImageBudget(animation="refuse"))
    assert decoded.format == "JPEG" and decoded.notes == ("image is a multi-picture JPEG: its first of 3 images was used",)
    assert np.abs(decoded.pixels.astype(int) - (255, 0, 0)).max() < 8


# ----------------------------------------------------------------------------- orientation and colour


def test_exif_orientation_is_applied_and_the_size_checked_after():
    im = Image.new("RGB", (40, 20), (0, 0, 0))
    im.paste((255, 0, 0), (0, 0, 8, 8))  # top-left, as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    data = encoded(im, "JPEG", quality=95, exif=exif.tobytes())
    decoded = decode_image(data, budget=BUDGET)
    assert (decoded.width, decoded.height) == (20, 40)
    assert decoded.notes == ("image: EXIF orientation 6 applied",)
    assert decoded.pixels[1:6, -6:-1, 0].min() > 200 and decoded.pixels[1:6, -6:-1, 1:].max() < 60  # now top-right
    assert decoded.pixels[1:6, 1:6].max() < 60  # top-left is black
    assert decoded.pixels[-6:, :].max() < 60
    with pytest.raises(RequestTooLarge):  # 40 wide as stored, 40 tall as shown: both are checked
        decode_image(data, budget=ImageBudget(max_side=39))


def test_cmyk_becomes_rgb_with_a_note():
    data = encoded(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95)
    decoded = decode_image(data, budget=BUDGET)
    assert decoded.notes == ("image: CMYK converted to RGB (no colour profile applied)",)
    assert np.abs(decoded.pixels.astype(int) - (255, 0, 0)).max() < 8


def test_a_palette_with_transparency_is_composited_on_the_background():
    im = Image.new("P", (8, 8), 1)
    im.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    im.paste(0, (0, 0, 4, 8))  # left half: index 0, the transparent one
    data = encoded(im, "PNG", transparency=0)
    decoded = decode_image(data, budget=ImageBudget(background=(0, 0, 255)))
    assert decoded.notes == ("image: transparency composited on rgb(0, 0, 255)",)
    assert (decoded.pixels[:, :4] == (0, 0, 255)).all() and (decoded.pixels[:, 4:] == (255, 0, 0)).all()
    opaque = encoded(Image.new("P", (8, 8), 1), "PNG")
    assert decode_image(opaque, budget=BUDGET).notes == ()


def test_a_transparent_colour_of_an_rgb_or_grey_png_is_composited_too():
    rgb = np.zeros((2, 2, 3), np.uint8)
    rgb[0, 0] = (1, 2, 3)
    decoded = decode_image(encoded(Image.fromarray(rgb), "PNG", transparency=(0, 0, 0)),
                           budget=ImageBudget(background=(9, 9, 9)))
    assert decoded.pixels.tolist() == [[[1, 2, 3], [9, 9, 9]], [[9, 9, 9], [9, 9, 9]]]
    grey = np.zeros((2, 2), np.uint8)
    grey[0, 0] = 7
    mask = decode_image(encoded(Image.fromarray(grey), "PNG", transparency=0), budget=ImageBudget(background=(9, 9, 9)),
                        mode="L")
    assert mask.pixels.tolist() == [[7, 9], [9, 9]] and mask.notes == ("image: transparency composited on rgb(9, 9, 9)",)


def test_rgba_is_composited_on_the_background():
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 128  # half-transparent red
    rgba[0, 0] = (10, 20, 30, 255)  # one opaque pixel
    data = encoded(Image.fromarray(rgba, "RGBA"), "PNG")
    white = decode_image(data, budget=BUDGET)
    assert white.notes == ("image: transparency composited on white",)
    assert np.abs(white.pixels[1, 1].astype(int) - (255, 127, 127)).max() <= 1
    assert tuple(white.pixels[0, 0]) == (10, 20, 30)
    black = decode_image(data, budget=ImageBudget(background=(0, 0, 0)))
    assert np.abs(black.pixels[1, 1].astype(int) - (128, 0, 0)).max() <= 1
    rgba[..., 3] = 255
    assert decode_image(encoded(Image.fromarray(rgba, "RGBA"), "PNG"), budget=BUDGET).notes == ()


def test_grey_with_alpha_and_bilevel_images():
    la = Image.new("LA", (4, 4), (0, 0))
    decoded = decode_image(encoded(la, "PNG"), budget=BUDGET)
    assert (decoded.pixels == 255).all() and "composited on white" in decoded.notes[0]
    bilevel = Image.new("1", (13, 3), 0)
    bilevel.putpixel((12, 2), 1)
    decoded = decode_image(encoded(bilevel, "PNG"), budget=BUDGET)
    assert decoded.pixels.shape == (3, 13, 3) and tuple(decoded.pixels[2, 12]) == (255, 255, 255)
    assert decoded.pixels.sum() == 3 * 255


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped():
    wide = np.array([[0, 257, 32768, 65535]], np.uint16)
    data = encoded(Image.fromarray(wide), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    decoded = decode_image(data, budget=BUDGET)
    assert decoded.notes == ("image: 16-bit grey reduced to 8 bits",)
    assert decoded.pixels[0, :, 0].tolist() == [0, 1, 128, 255]  # Pillow's convert would give 0, 255, 255, 255
    mask = decode_image(data, budget=BUDGET, mode="L")
    assert mask.pixels.tolist() == [[0, 1, 128, 255]]


@pytest.mark.parametrize("depth, colour", [(8, 2), (1, 0), (16, 6)])
def test_interlaced_pngs_decode(depth, colour):
    """Adam7, built by hand (Pillow writes none): the pass sizes the completeness check computes."""
    rng = np.random.default_rng(1)
    height, width = 11, 13
    channels = {0: 1, 2: 3, 6: 4}[colour]
    top = (1 << depth) - 1
    values = rng.integers(0, top + 1, (height, width, channels), dtype=np.uint16 if depth == 16 else np.uint8)
    raw = b""
    for x0, y0, dx, dy in images._ADAM7:
        sub = values[y0::dy, x0::dx]
        for row in sub:
            if depth == 16:
                raw += b"\0" + row.astype(">u2").tobytes()
            elif depth == 1:
                raw += b"\0" + np.packbits(row[:, 0]).tobytes()
            else:
                raw += b"\0" + row.tobytes()
    data = png_by_hand(width, height, zlib.compress(raw), depth=depth, colour=colour, interlace=1)
    decoded = decode_image(data, budget=BUDGET)
    assert decoded.pixels.shape == (height, width, 3)
    expected = Image.open(io.BytesIO(data))
    expected = np.asarray(expected.convert("RGBA").convert("RGB") if colour == 6 else expected.convert("RGB"))
    if colour != 6:  # alpha composited: compared in the RGBA test
        assert np.array_equal(decoded.pixels, expected)
    with pytest.raises(InvalidRequest, match="ends early"):
        decode_image(png_by_hand(width, height, zlib.compress(raw[:-1]), depth=depth, colour=colour, interlace=1),
                     budget=BUDGET)


def test_sub_byte_palettes_and_odd_widths_pass_the_completeness_check():
    im = Image.new("P", (13, 5), 0)
    im.putpalette([0, 0, 0, 255, 255, 255, 255, 0, 0, 0, 255, 0] + [0] * 756)
    im.putpixel((12, 4), 2)
    for bits in (1, 2, 4):
        decoded = decode_image(encoded(im, "PNG", bits=bits), budget=BUDGET)
        assert decoded.pixels.shape == (5, 13, 3)
    assert tuple(decode_image(encoded(im, "PNG", bits=4), budget=BUDGET).pixels[4, 12]) == (255, 0, 0)


# ----------------------------------------------------------------------------- masks


def test_a_mask_is_one_channel():
    grey = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (4, 1))
    mask = decode_image(encoded(Image.fromarray(grey), "PNG"), label="mask", budget=BUDGET, mode="L")
    assert mask.pixels.shape == (4, 16) and mask.mode == "L" and np.array_equal(mask.pixels, grey)
    assert mask.notes == () and mask.to_pil().mode == "L"
    colour = np.zeros((2, 2, 3), np.uint8)
    colour[..., 0] = 255
    red = decode_image(encoded(Image.fromarray(colour), "PNG"), label="mask", budget=BUDGET, mode="L")
    assert red.pixels.tolist() == [[76, 76], [76, 76]]  # ITU-R 601-2 luma of pure red
    assert red.notes == ("mask: a colour image used as a mask: its luminance was taken",)


def test_a_transparent_mask_is_composited_then_its_luminance_taken():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (0, 0, 0, 255)  # opaque black: keep
    data = encoded(Image.fromarray(rgba, "RGBA"), "PNG")  # the rest transparent: white on the default background
    mask = decode_image(data, label="mask", budget=BUDGET, mode="L")
    assert mask.pixels.tolist() == [[0, 255], [255, 255]]
    assert mask.notes == ("mask: transparency composited on white",
                          "mask: a colour image used as a mask: its luminance was taken")
    with pytest.raises(ValueError):
        decode_image(data, budget=BUDGET, mode="RGBA")


# ----------------------------------------------------------------------------- the import rule


def test_images_import_without_torch_or_diffusers():
    code = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "diffusers", "transformers"):
            raise ImportError(name + " is blocked here")

sys.meta_path.insert(0, Block())
import hotlora.images, hotlora.adapters.store.images
assert not {"torch", "diffusers"} & set(sys.modules)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
