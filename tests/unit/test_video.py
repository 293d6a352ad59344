"""The video encoder (server/video.py), checked by decoding what it made: PyAV for the MP4 (codec,
pixel format, frame count, size, rate, the pixels themselves within H.264's loss), Pillow for the
animated WebP and the PNG frames."""

import io
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from hotlora.errors import InvalidRequest
from hotlora.server import video
from hotlora.server.routes_videos import frames_for, seconds_of


def moving_square(frames=5, height=16, width=16):
    """A white square walking right on grey: every frame differs, so a dropped or repeated frame shows."""
    out = np.full((frames, height, width, 3), 64, dtype=np.uint8)
    for t in range(frames):
        out[t, 2:8, 2 + 2 * t:8 + 2 * t] = 255
    return out


def decode_mp4(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        facts = {"codec": stream.codec_context.name, "pix_fmt": stream.codec_context.pix_fmt,
                 "rate": stream.average_rate, "size": (stream.width, stream.height)}
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return facts, np.stack(frames)


@pytest.mark.parametrize("fps", [16, 24])
def test_mp4_is_h264_yuv420p_at_the_rate_with_every_frame(fps):
    frames = moving_square()
    (data,) = video.encode(list(frames), "mp4", fps)
    facts, decoded = decode_mp4(data)
    assert facts == {"codec": "h264", "pix_fmt": "yuv420p", "rate": Fraction(fps), "size": (16, 16)}
    assert decoded.shape == frames.shape
    # Lossy, but each decoded frame is nearest its own source frame (the order and count are kept).
    errors = np.abs(decoded.astype(int)[:, None] - frames.astype(int)[None]).mean(axis=(2, 3, 4))
    assert list(errors.argmin(axis=1)) == list(range(len(frames)))
    assert errors.diagonal().max() < 8


@pytest.mark.parametrize("channels", [1, 2])
def test_mp4_with_a_sound_track_carries_it_as_aac_beside_every_frame(channels):
    """A video with its sound (LTX-2's): an AAC stream at the sound's rate and channels, as long as
    the waveform (within the codec's priming and padding), the sound itself kept (a 440 Hz tone
    decodes to a 440 Hz tone), and the frames as without it."""
    frames, rate = moving_square(), 16000
    t = np.arange(rate // 2) / rate  # half a second
    tone = np.stack([0.5 * np.sin(2 * np.pi * 440 * t)] * channels).astype(np.float32)
    (data,) = video.encode(list(frames), "mp4", 24, video.Sound(tone, rate))
    facts, decoded = decode_mp4(data)
    assert facts["codec"] == "h264" and decoded.shape == frames.shape
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.channels) == ("aac", rate, channels)
        sound = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)
    assert sound.shape[0] == channels and abs(sound.shape[-1] - tone.shape[-1]) <= 2048
    spectrum = np.abs(np.fft.rfft(sound[0]))
    assert abs(np.fft.rfftfreq(sound.shape[-1], 1 / rate)[spectrum.argmax()] - 440) < 5
    (silent,) = video.encode(list(frames), "mp4", 24)
    with av.open(io.BytesIO(silent)) as container:
        assert not container.streams.audio
    with pytest.raises(ValueError, match="3 channels"):
        video.encode(list(frames), "mp4", 24, video.Sound(np.zeros((3, 100), np.float32), rate))


def top_level_boxes(data: bytes) -> list[str]:
    """An MP4's top-level box types in file order (ISO/IEC 14496-12: a 32-bit size, a 4-byte type,
    a 64-bit size after them when the first is 1). Read by hand: PyAV does not list them."""
    kinds, at = [], 0
    while at + 8 <= len(data):
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8].decode("latin-1")
        if size == 1:
            size = int.from_bytes(data[at + 8:at + 16], "big")
        kinds.append(kind)
        if size < 8:  # 0: the box runs to the end of the file
            break
        at += size
    return kinds


def test_mp4_has_its_index_first_so_a_player_starts_before_the_end_arrives():
    """faststart: ``moov`` (the index) before ``mdat`` (the frames), every byte a box's."""
    (data,) = video.encode(list(moving_square()), "mp4", 16)
    kinds = top_level_boxes(data)
    assert kinds[0] == "ftyp" and "moov" in kinds and "mdat" in kinds
    assert kinds.index("moov") < kinds.index("mdat"), kinds


def test_mp4_of_an_odd_size_is_padded_to_even_keeping_every_pixel():
    frames = moving_square(frames=3, height=15, width=17)
    facts, decoded = decode_mp4(video.encode(list(frames), "mp4", 16)[0])
    assert facts["size"] == (18, 16)
    assert np.abs(decoded[:, :15, :17].astype(int) - frames).mean() < 8
    # The added column repeats the last one rather than adding a black line.
    assert np.abs(decoded[:, :15, 17].astype(int) - frames[:, :, 16]).mean() < 8


def test_pil_frames_and_one_array_encode_alike():
    frames = moving_square()
    from_pil = video.encode([Image.fromarray(f) for f in frames], "mp4", 16)[0]
    assert decode_mp4(from_pil)[1].shape == decode_mp4(video.encode(frames, "mp4", 16)[0])[1].shape


def test_animated_webp_has_every_frame_timed_at_the_rate():
    frames = moving_square()
    (data,) = video.encode(list(frames), "webp", 16)
    image = Image.open(io.BytesIO(data))
    assert image.format == "WEBP" and image.n_frames == len(frames) and image.size == (16, 16)
    for t in range(len(frames)):
        image.seek(t)
        image.load()  # Pillow reads a frame's timing as it decodes it
        assert image.info["duration"] == 62  # 1000 / 16, in WebP's whole milliseconds
        assert np.abs(np.asarray(image.convert("RGB")).astype(int) - frames[t]).mean() < 8


def test_png_frames_are_lossless_one_per_frame():
    frames = moving_square()
    pngs = video.encode(list(frames), "png", 16)
    assert len(pngs) == len(frames)
    for png, frame in zip(pngs, frames):
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), frame)


def test_thumbnail_is_the_first_frame_as_webp():
    frames = moving_square()
    thumbnail = Image.open(io.BytesIO(video.thumbnail(video.encode(frames, "mp4", 16)[0])))
    assert thumbnail.format == "WEBP" and thumbnail.size == (16, 16)
    errors = [np.abs(np.asarray(thumbnail.convert("RGB")).astype(int) - f).mean() for f in frames]
    assert int(np.argmin(errors)) == 0


def test_unknown_format_and_non_uint8_frames_are_refused():
    with pytest.raises(ValueError, match="mp4, webp, png"):
        video.encode(moving_square(), "gif", 16)
    with pytest.raises(TypeError, match="uint8"):
        video.encode(moving_square().astype(np.float32), "mp4", 16)


def test_seconds_become_seconds_times_fps_plus_one_frames_of_those_served():
    assert frames_for("5", 16, (81, 49), served_only=True) == 81  # Wan's 81 frames at 16 fps: "5 seconds"
    assert frames_for(3, 16, (81, 49), served_only=True) == 49
    assert frames_for(None, 16, (81,), served_only=True) is None  # the engine's default count
    assert frames_for("2", 16, (81,), served_only=False) == 33  # an eager engine: any count (the engine checks 4k + 1)
    with pytest.raises(InvalidRequest, match=r"served: 5 \(81 frames\), 3 \(49 frames\)"):
        frames_for("4", 16, (81, 49), served_only=True)
    # The listed seconds of a count that is no short decimal at the rate ask for it (8 frames at 24 fps).
    assert frames_for("0.333333", 24, (9,), served_only=True) == 9
    assert frames_for(seconds_of(121, 24), 24, (121,), served_only=True) == 121
    for bad in ("0.3", "0.33", "-1", "inf", "four"):
        with pytest.raises(InvalidRequest, match="served: 5 "):
            frames_for(bad, 16, (81,), served_only=False)
