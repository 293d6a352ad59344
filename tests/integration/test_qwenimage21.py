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


def test_a_kohya_named_file_reads_as_its_diffusers_twin(turbo, tmp_path):
    """kohya names (``lora_unet_`` + the module flattened) over every 2.1 Linear, alpha != rank: the
    same per-module updates plain diffusers loads from the diffusers-layout file of the same weights
    (diffusers' own converter made ``img_mlp.gate.layer`` of ``gate_layer``); a name of no 2.1 module
    is refused, named."""
    from safetensors.torch import load_file

    from hotlora.adapters.format.convert import load_adapter
    from hotlora.errors import AdapterFormatError
    from hotlora.families._tiny import random_lora, save_kohya_layout
    from hotlora.tiny import denoiser_linears, save_diffusers_lora

    from ..helpers import assert_same_deltas, canonical_deltas, fresh_pipeline, loaded_deltas

    family = family_named("qwenimage21")
    pipeline = fresh_pipeline(turbo)
    linears = denoiser_linears(pipeline)
    assert {"txt_in.in_layer", "modulation.1", "transformer_blocks.0.img_mlp.gate_layer"} <= set(linears)
    sd = random_lora(linears, 4, seed=7)
    kohya = save_kohya_layout(tmp_path / "kohya.safetensors", sd, alpha=6.0)
    adapter = load_adapter(kohya, family)
    assert adapter.layout == "kohya" and set(adapter.modules) == set(linears)
    pipeline.load_lora_weights(str(save_diffusers_lora(tmp_path / "twin", "qwenimage21", sd, rank=4, alpha=6.0)),
                               adapter_name="ref")
    assert_same_deltas(canonical_deltas(adapter), loaded_deltas(pipeline.transformer, "ref"))
    unknown = "lora_unet_transformer_blocks_0_img_mlp_gate_proj"
    raw = load_file(str(kohya))
    raw.update({f"{unknown}.lora_down.weight": torch.zeros(4, 32), f"{unknown}.lora_up.weight": torch.zeros(32, 4),
                f"{unknown}.alpha": torch.tensor(4.0)})
    with pytest.raises(AdapterFormatError, match=f"3 kohya-named keys name no Qwen-Image 2.1 module .*{unknown}"):
        load_adapter(raw, family, name="bad.safetensors")
