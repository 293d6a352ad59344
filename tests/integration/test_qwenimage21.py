"""Qwen-Image-2.1-Turbo beyond the contract (which runs the base model's tiny one): a checkpoint whose
model_index.json fixes its own sigma schedule (``sample_sigmas``) is served at that schedule's step
count, refuses another with a message naming it, and equals plain diffusers, compiled, with no
recompile between adapters; its first step (the prefix cache filled) runs eagerly, every later one
compiled."""

import pytest
import torch

from hotlora import Engine
from hotlora.errors import InvalidRequest
from hotlora.families import family_named
from hotlora.testing import save_tiny_model

from ..helpers import TARGET_RANK, engine_reference, recompiles_are_errors

PROMPT = "a lighthouse on a cliff, ink wash"


@pytest.fixture(scope="module")
def turbo(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwenimage21-turbo"), "qwenimage21", variant="turbo")


def test_a_fixed_schedule_sets_the_steps_and_refuses_others(turbo, monkeypatch):
    steps = len(family_named("qwenimage21").TINY_TURBO_SIGMAS)
    adapters = {"identity": (turbo / "adapters" / "identity-diffusers", 0.9),
                "style": (turbo / "adapters" / "style-diffusers", 0.6)}
    engine = Engine.from_pretrained(turbo, target_rank=TARGET_RANK, batch_size=2, compile=True, rank_buckets=())
    assert engine.defaults["num_inference_steps"] == steps  # the schedule's, not hotlora.json's 4
    with pytest.raises(InvalidRequest, match=f"num_inference_steps must be {steps} on this model.*sample_sigmas"):
        engine.generate(PROMPT, num_inference_steps=steps + 2)
    family, calls = engine.family, []
    decide = family.eager_block_call
    monkeypatch.setattr(family, "eager_block_call", lambda kwargs: calls.append(
        (kwargs["kv_cache_mode"], decide(kwargs))) or calls[-1][1])
    with recompiles_are_errors():
        for chosen in (adapters, None, adapters):
            ours = engine.generate(PROMPT, adapters=chosen, num_images=2, seed=3, output_type="latent").images
            theirs = engine_reference(engine, turbo, chosen or {}, prompt=PROMPT, steps=steps, num_images=2, seed=3)
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert engine.recompiles == 0
    # Every block call of a run: the cache-filling first step eager, the schedule's other steps compiled.
    blocks = len(engine.denoiser.transformer_blocks)
    assert calls.count(("extract", True)) == 3 * blocks
    assert calls.count(("cached", False)) == 3 * blocks * (steps - 1) and len(calls) == 3 * blocks * steps


def test_a_published_scheduler_refuses_one_step(tmp_path):
    """Qwen-Image 2.1's published scheduler (shift_terminal 0.02, as Qwen-Image's) gives plain diffusers a
    NaN image on one step: the engine refuses one step, saying why, and serves two."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from hotlora.fullsize.qwen_image_21 import SCHEDULER

    model = save_tiny_model(tmp_path / "published-scheduler", "qwenimage21")
    published = {key: value for key, value in SCHEDULER.items() if not key.startswith("_")}
    FlowMatchEulerDiscreteScheduler.from_config(published).save_pretrained(model / "scheduler")
    engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False, rank_buckets=())
    with pytest.raises(InvalidRequest, match=r"num_inference_steps must be an integer in 2\.\..*shift_terminal \(0\.02\)"):
        engine.generate(PROMPT, num_inference_steps=1)
    assert torch.isfinite(engine.generate(PROMPT, num_inference_steps=2, output_type="latent").images).all()
