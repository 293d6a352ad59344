"""LTX-2: what only it has beside the contract (test_contract.py) and the video tests (test_video.py):
LoRA for its connectors, the model between the text encoder and the transformer that runs inside the
pipeline call, applied per request and equal to plain diffusers loading the same file; adapters in
the trainers' layout with the connectors' part; each video's sound track; one request per forward
batch, and no image-to-video, each refused at start-up with the reason."""

import pytest
import torch

from hotlora import Engine
from hotlora.adapters.format.convert import load_adapter
from hotlora.families import UnservedModel, family_named
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK, recompiles_are_errors, sample_adapter as sample, served_frames

pytestmark = pytest.mark.families

TOLERANCE = 1e-4
FAMILY = family_named("ltx2")


@pytest.fixture(scope="module")
def ltx2(tiny_models):
    model_dir = tiny_models["ltx2"]
    with torch._dynamo.config.patch(error_on_recompile=False):  # warm-up compiles by definition
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        rank_buckets=(), frames=served_frames(FAMILY))
    with recompiles_are_errors():
        yield model_dir, engine
    assert engine.recompiles == 0


def both_ways(engine, model_dir, slots):
    """The engine's latents and plain diffusers' for ``slots`` (slot -> (file, scale))."""
    ours = engine.generate("a cat", adapters=slots, num_images=2, num_inference_steps=2,
                           output_type="latent").images
    theirs = plain_diffusers_reference(model_dir, slots, prompt="a cat", num_images=2, num_inference_steps=2,
                                       guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
                                       width=engine.width, seed=0)
    return ours, theirs


def test_connectors_lora_in_both_layouts_is_read_as_diffusers_reads_it(ltx2):
    model_dir, _ = ltx2
    for name, modules in (("identity-connectors", None), ("style-comfy", {"text_proj_in"})):
        adapter = load_adapter(sample(model_dir, name), FAMILY)
        connectors = adapter.text_modules["connectors"]
        assert connectors and (modules is None or set(connectors) == modules)
        assert adapter.modules  # and the transformer's part beside it


def test_connectors_lora_per_request_equals_plain_diffusers_and_leaves_no_trace(ltx2):
    model_dir, engine = ltx2
    slots = {"identity": (sample(model_dir, "identity-connectors"), 0.9), "style": (sample(model_dir, "style-comfy"), 0.6)}
    ours, theirs = both_ways(engine, model_dir, slots)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    # The transformer's part alone (the connectors' dropped from the file) would be another video:
    # the connectors' LoRA is applied, not only carried.
    transformer_only, _ = both_ways(engine, model_dir, {"identity": (sample(model_dir, "identity-diffusers"), 0.9)})
    assert (ours - transformer_only).abs().max() > 1e-2
    # A request without adapters after it runs the base connectors: equal to plain diffusers with none.
    base, plain = both_ways(engine, model_dir, {})
    torch.testing.assert_close(base, plain, atol=TOLERANCE, rtol=0)
    # And the connectors' adapter again, at another scale: hooks re-pointed, the scale followed.
    again, theirs_again = both_ways(engine, model_dir, {"identity": (sample(model_dir, "identity-connectors"), 0.4)})
    torch.testing.assert_close(again, theirs_again, atol=TOLERANCE, rtol=0)
    assert engine.recompiles == 0


def test_each_video_comes_with_its_sound_track_as_plain_diffusers_makes_it(ltx2):
    """The pipeline's ``.audio`` (the vocoder's waveform per video) reaches the result, each video's
    own, at the vocoder's rate, equal to plain diffusers' for the same request; chunked or not."""
    model_dir, engine = ltx2
    slots = {"identity": (sample(model_dir, "identity-connectors"), 0.9)}
    result = engine.generate("a cat", adapters=slots, num_images=3, num_inference_steps=2, output_type="np")
    theirs = plain_diffusers_reference(model_dir, slots, prompt="a cat", num_images=3, num_inference_steps=2,
                                       guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
                                       width=engine.width, seed=0, output_type="np", attribute="audio")
    assert result.audio_rate == engine.warm.pipeline.vocoder.config.output_sampling_rate
    assert result.audio.shape == theirs.shape and result.audio.shape[:2] == (3, 2)
    torch.testing.assert_close(result.audio, theirs, atol=TOLERANCE, rtol=0)
    assert (result.audio[0] - result.audio[1]).abs().max() > 1e-3  # each video its own seed's sound


def test_mixed_batches_and_image_to_video_are_refused_at_start_up_saying_why(tiny_models):
    with pytest.raises(UnservedModel, match="LTX2Pipeline .* 'ltx2' family.*connectors.*mixed=False"):
        Engine.from_pretrained(tiny_models["ltx2"], target_rank=TARGET_RANK, mixed=True, compile=False)
    with pytest.raises(UnservedModel, match="does not serve image-to-video .*LTX2ImageToVideoPipeline re-compresses"):
        Engine.from_pretrained(tiny_models["ltx2"], target_rank=TARGET_RANK, tasks=("image-to-video",), compile=False)
