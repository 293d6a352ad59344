"""A video family served at several frame counts: each warmed up (no request compiles), each equal to
plain diffusers, and every output type as diffusers' own post-processing makes it. The contract
(test_contract.py) covers Wan at its default frame count; this module adds what only video has."""

import dataclasses

import numpy as np
import pytest
import torch

from hotlora import Engine
from hotlora.engine.request import UnservedShape
from hotlora.errors import InvalidRequest
from hotlora.families import REGISTERED
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK, recompiles_are_errors

pytestmark = pytest.mark.families

TOLERANCE = 1e-4
FRAMES = (5, 9)  # the default first


@pytest.fixture(scope="module", params=[f.name for f in REGISTERED if f.video])
def video(request, tiny_models):
    engine = Engine.from_pretrained(tiny_models[request.param], target_rank=TARGET_RANK, batch_size=2, compile=True,
                                    rank_buckets=(), frames=FRAMES)
    with recompiles_are_errors():
        yield tiny_models[request.param], engine
    assert engine.recompiles == 0


def adapters(model_dir):
    return {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9),
            "style": (model_dir / "adapters" / "style-diffusers", 0.6)}


def reference(engine, model_dir, frames, output_type="latent", num_images=3):
    return plain_diffusers_reference(model_dir, adapters(model_dir), prompt="a cat", num_images=num_images,
                                     num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"],
                                     height=engine.height, width=engine.width, seed=0, num_frames=frames,
                                     output_type=output_type)


def test_every_served_frame_count_is_warm_and_equals_plain_diffusers(video):
    model_dir, engine = video
    assert engine.rules.frames == FRAMES and engine.describe()["frames"] == list(FRAMES)
    for frames in FRAMES:
        ours = engine.generate("a cat", adapters=adapters(model_dir), num_images=3, num_inference_steps=2,
                               num_frames=frames, output_type="latent").images
        latent_frames = (frames - 1) // 4 + 1
        assert ours.shape[0] == 3 and ours.shape[2] == latent_frames
        torch.testing.assert_close(ours, reference(engine, model_dir, frames), atol=TOLERANCE, rtol=0)
    assert engine.generate("a cat", num_inference_steps=2, output_type="latent").images.shape[2] == 2  # 5 frames
    assert engine.recompiles == 0


def test_a_frame_count_not_served_is_refused_before_running(video):
    model_dir, engine = video
    with pytest.raises(UnservedShape, match="13 frames is not served .* 5, 9"):
        engine.generate("a cat", num_frames=13)
    with pytest.raises(InvalidRequest, match=r"4k \+ 1 .* got 7"):
        engine.generate("a cat", num_frames=7)


def test_output_types_are_diffusers_own(video):
    """"pil": one list of frames per video, the pixels diffusers' "pil" makes (compiled kernels may
    move a value across a rounding boundary: at most one level); "np" (B, T, H, W, C) floats;
    "uint8" what the engine process ships, the "pil" pixels as one tensor."""
    model_dir, engine = video

    def ours(output_type):
        return engine.generate("a cat", adapters=adapters(model_dir), num_images=2, num_inference_steps=2,
                               num_frames=5, output_type=output_type).images

    pil, theirs = ours("pil"), reference(engine, model_dir, 5, "pil", num_images=2)
    assert [len(v) for v in pil] == [5, 5] and pil[0][0].size == (engine.width, engine.height)
    ours_pixels = np.stack([[np.asarray(f, dtype=np.int16) for f in v] for v in pil])
    their_pixels = np.stack([[np.asarray(f, dtype=np.int16) for f in v] for v in theirs])
    assert np.abs(ours_pixels - their_pixels).max() <= 1
    arrays = ours("np")
    assert arrays.shape == (2, 5, engine.height, engine.width, 3)
    np.testing.assert_allclose(arrays, reference(engine, model_dir, 5, "np", num_images=2), atol=1e-3, rtol=0)
    # "uint8" is no request's output type: the engine process sets it on a prepared "pil" request.
    prepared = engine.prepare("a cat", adapters=adapters(model_dir), num_images=2, num_inference_steps=2,
                              num_frames=5, output_type="pil")
    shipped = engine.run(dataclasses.replace(prepared, output_type="uint8")).images
    assert shipped.dtype == torch.uint8 and np.array_equal(shipped.numpy().astype(np.int16), ours_pixels)
