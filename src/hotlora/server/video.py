"""Encode a video (its frames, as the engine returns them) for the wire: MP4, animated WebP, or
every frame a PNG.

MP4 is H.264 in yuv420p, the one combination every browser and player decodes. yuv420p stores
colour at half resolution in both directions, so libx264 refuses an odd width or height: an odd
frame is padded by one row or column repeating its edge (nothing of the frame is lost, and a
repeated edge is invisible where black would show as a line). Frames are timed at the family's
``fps``; the encoder runs on a worker thread (``Service.run``), never on the event loop.

A video that comes with a sound track (LTX-2's: a float waveform per video) gets it in the MP4 as
AAC, the audio codec every MP4 player decodes; WebP and PNG frames carry no sound.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

FORMATS = ("mp4", "webp", "png")  # what a frames model serves; the first is the default
MEDIA_TYPES = {"mp4": "video/mp4", "webp": "image/webp", "png": "image/png"}
CRF = 18  # libx264's constant quality: visually lossless, a fraction of lossless' size
WEBP_QUALITY = 92  # as server/images.py encodes a still


def rgb_frames(frames) -> np.ndarray:
    """One video's frames (PIL images, HxWxC arrays, or one TxHxWxC array) as a TxHxWx3 uint8 array."""
    array = np.stack([np.asarray(frame.convert("RGB") if hasattr(frame, "convert") else frame) for frame in frames])
    if array.dtype != np.uint8:
        raise TypeError(f"frames must be uint8, got {array.dtype}")
    if array.ndim == 3:  # grayscale frames
        array = array[..., None]
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return np.ascontiguousarray(array[..., :3])


def even(array: np.ndarray) -> np.ndarray:
    """``array`` (T, H, W, 3) padded to an even height and width by repeating its last row/column."""
    _, height, width, _ = array.shape
    pad = ((0, 0), (0, height % 2), (0, width % 2), (0, 0))
    return np.pad(array, pad, mode="edge") if height % 2 or width % 2 else array


def mp4(frames, fps: int, sound: Sound | None = None) -> bytes:
    """The frames as one MP4 with its index (``moov``) before the media (``mdat``): "faststart", so
    a browser or player fetching it over HTTP starts playing before the last byte arrives, with no
    range request for the file's end. FFmpeg's mov muxer moves the index in a second pass over the
    file by name, so the encode goes through a temporary file (an in-memory one would keep the
    index last). ``sound``: the video's sound track, muxed beside it as AAC (its stream added before
    anything is muxed: the header is written with the first packet)."""
    import tempfile

    import av

    array = even(rgb_frames(frames))
    with tempfile.TemporaryDirectory(prefix="hotlora-mp4-") as folder:
        path = Path(folder) / "video.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=Fraction(fps))
            stream.width, stream.height = array.shape[2], array.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(CRF)}
            track = sound_frame(sound) if sound is not None else None
            audio = container.add_stream("aac", rate=sound.rate, layout=track.layout.name) if track else None
            for pixels in array:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            container.mux(stream.encode())  # flush the frames the encoder still holds
            if audio is not None:
                container.mux(audio.encode(track))  # PyAV's encoder cuts it into AAC's frame size
                container.mux(audio.encode())
        return path.read_bytes()


class Sound(NamedTuple):
    """One video's sound track: a (channels, samples) float waveform in [-1, 1] and its rate."""

    waveform: np.ndarray
    rate: int


def sound_frame(sound: Sound):
    """``sound`` as one planar float frame, timed from zero."""
    import av

    waveform = np.ascontiguousarray(np.clip(sound.waveform, -1.0, 1.0), dtype=np.float32)
    layout = {1: "mono", 2: "stereo"}.get(waveform.shape[0])
    if layout is None:
        raise ValueError(f"a sound track of {waveform.shape[0]} channels; MP4 here takes 1 or 2")
    frame = av.AudioFrame.from_ndarray(waveform, format="fltp", layout=layout)
    frame.sample_rate, frame.pts, frame.time_base = sound.rate, 0, Fraction(1, sound.rate)
    return frame


def webp(frames, fps: int) -> bytes:
    from PIL import Image

    images = [Image.fromarray(pixels) for pixels in rgb_frames(frames)]
    buffer = io.BytesIO()
    # WebP times frames in whole milliseconds: 16 fps is 62 ms a frame.
    images[0].save(buffer, format="WEBP", save_all=True, append_images=images[1:], duration=round(1000 / fps),
                   loop=0, quality=WEBP_QUALITY)
    return buffer.getvalue()


def png_frames(frames) -> list[bytes]:
    from PIL import Image

    out = []
    for pixels in rgb_frames(frames):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def encode(frames: Sequence, fmt: str, fps: int, sound: Sound | None = None) -> list[bytes]:
    """One video as the files of ``fmt``: one MP4 (with ``sound`` where given) or WebP, or one PNG
    per frame."""
    if fmt == "mp4":
        return [mp4(frames, fps, sound)]
    if fmt == "webp":
        return [webp(frames, fps)]
    if fmt == "png":
        return png_frames(frames)
    raise ValueError(f"no video format {fmt!r}; one of {', '.join(FORMATS)}")


def thumbnail(video: bytes) -> bytes:
    """An MP4's first frame as a WebP still (OpenAI's ``variant=thumbnail``)."""
    import av
    from PIL import Image

    with av.open(io.BytesIO(video)) as container:
        first = next(container.decode(video=0))
    buffer = io.BytesIO()
    Image.fromarray(first.to_ndarray(format="rgb24")).save(buffer, format="WEBP", quality=WEBP_QUALITY)
    return buffer.getvalue()
