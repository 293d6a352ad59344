"""A run's own scheduler shift and, on Wan 2.2's two experts, the low-noise expert's own guidance
(``shift``, ``guidance_scale_2``), on the tiny two-expert Wan model, eager: each equal to plain
diffusers given the same values (``guidance_scale_2`` as ``WanPipeline`` takes it, the shift as a
diffusers user sets it: a scheduler ``from_config`` with it), each moving the output, the model's own
scheduler back after every run; an adapter's declared shift applied and reported, and ignored by a
model whose scheduler has no fixed shift (SDXL's; Flux's published one shifts by image size). Compiled, with
recompiles as errors: tests/integration/test_video.py (``make test-families``)."""

import pytest
import torch

from hotlora import Engine
from hotlora.errors import InvalidRequest
from hotlora.testing import declare_defaults, plain_diffusers_reference, save_tiny_model

from ..helpers import TARGET_RANK

TOLERANCE = 1e-4
STEPS = 2  # the tiny scheduler's two steps fall on both sides of the boundary: both experts run


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("two-experts") / "wan", "wan", target_rank=TARGET_RANK,
                            variant="two-experts")
    engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=1, compile=False, rank_buckets=())
    return model, engine


def at_shift(shift):
    def prepare(pipeline):
        if shift is not None:
            pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, shift=shift)
    return prepare


def test_guidance_scale_2_and_shift_are_diffusers_own(wan22):
    model, engine = wan22
    samples = model / "adapters"
    adapters = {"identity": (samples / "experts-pair", 0.9)}
    # diffusers loads each expert's file apart (the low-noise one with ``load_into_transformer_2``)
    as_diffusers_loads = {"identity": ((samples / "experts-high", samples / "experts-low"), 0.9)}
    own_scheduler = engine.pipeline.scheduler

    def both(guidance_scale_2=None, shift=None):
        ours = engine.generate("a cat", adapters=adapters, num_inference_steps=STEPS, guidance_scale=5.0,
                               guidance_scale_2=guidance_scale_2, shift=shift, output_type="latent").images
        assert engine.pipeline.scheduler is own_scheduler
        theirs = plain_diffusers_reference(
            model, as_diffusers_loads, prompt="a cat", num_images=1, num_inference_steps=STEPS, guidance_scale=5.0,
            height=engine.height, width=engine.width, seed=0, prepare=at_shift(shift),
            task_arguments={} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2})
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        return ours

    default = both()
    assert engine.pipeline.scheduler.config.shift == 7.0  # the tiny model's own, untouched
    assert "guidance_scale_2" in engine.describe()["request_options"] and "shift" in engine.describe()["request_options"]
    low_guided_less = both(guidance_scale_2=1.0)
    shifted = both(shift=2.0)
    both(guidance_scale_2=8.0, shift=12.0)
    assert (low_guided_less - default).abs().max() > 1e-3  # the low-noise expert's guidance counts
    assert (shifted - default).abs().max() > 1e-3
    assert both().equal(default)  # nothing of the shifted runs stayed


def test_a_declared_shift_is_applied_and_reported_and_the_requests_own_wins(wan22, tmp_path):
    model, engine = wan22
    distill = declare_defaults(model / "adapters" / "experts-pair", tmp_path / "distill.safetensors",
                               num_inference_steps=STEPS, shift=2.0)
    declared = engine.generate("a cat", adapters={"identity": str(distill)}, guidance_scale=5.0, output_type="latent")
    assert declared.adapter_defaults == {"num_inference_steps": {"value": STEPS, "slots": ["identity"]},
                                         "shift": {"value": 2.0, "slots": ["identity"]}}
    explicit = engine.generate("a cat", adapters={"identity": str(distill)}, guidance_scale=5.0, output_type="latent",
                               num_inference_steps=STEPS, shift=2.0)
    assert explicit.adapter_defaults == {} and explicit.images.equal(declared.images)
    own = engine.generate("a cat", adapters={"identity": str(distill)}, guidance_scale=5.0, output_type="latent",
                          num_inference_steps=STEPS, shift=7.0)
    assert (own.images - declared.images).abs().max() > 1e-3


def test_a_model_without_a_fixed_shift_ignores_a_declared_one_and_refuses_a_requests(tiny_models, tmp_path):
    """SDXL's Euler scheduler has no shift (Flux's published one shifts by image size, the same case):
    an adapter's declared shift is not applied there, nor reported, as a guidance a family does not
    take; a request's own is refused, naming the scheduler."""
    model = tiny_models["sdxl"]
    engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=1, compile=False, rank_buckets=())
    plain = model / "adapters" / "style-diffusers"
    shifted = declare_defaults(plain, tmp_path / "shifted.safetensors", shift=5.0)
    declared = engine.generate("a cat", adapters={"style": str(shifted)}, num_inference_steps=STEPS, output_type="latent")
    own = engine.generate("a cat", adapters={"style": str(plain)}, num_inference_steps=STEPS, output_type="latent")
    assert declared.adapter_defaults == {} and declared.images.equal(own.images)
    with pytest.raises(InvalidRequest, match=r"shift is not taken by this model: its scheduler "
                                             r"\(EulerDiscreteScheduler\) has no fixed timestep shift"):
        engine.prepare("a cat", shift=5.0)
    with pytest.raises(InvalidRequest, match="guidance_scale_2 is taken by a model of two experts"):
        engine.prepare("a cat", guidance_scale_2=3.0)
    assert not {"shift", "guidance_scale_2"} & set(engine.describe()["request_options"])
