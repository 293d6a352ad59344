"""Rank buckets: the model is compiled for a few total ranks and each request runs the smallest
that holds its adapters, so rank-2 adapters in rank-8 slots do not pay for rank 8. Still exact
against plain diffusers, still no compile after warm-up."""

import pytest

from hotlora import Engine
from hotlora.testing import plain_diffusers_reference, random_lora, save_diffusers_lora

from ..helpers import TARGET_RANK, recompiles_are_errors

TOLERANCE = 1e-4
PROMPT = "a lighthouse at dusk"
STEPS = 2
BUCKETS = (2, 4)


@pytest.fixture(scope="module")
def bucketed(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=3, compile=True,
                                    rank_buckets=BUCKETS)
    with recompiles_are_errors():
        yield tiny_models["flux"], engine


def test_each_request_runs_the_smallest_bucket_that_holds_it(bucketed, tmp_path):
    model_dir, engine = bucketed
    assert engine.writer.rank_buckets == (2, 4, TARGET_RANK)
    linears = dict(engine.ceiling.modules)
    names = sorted(linears)

    def adapter(rank, seed, modules=None):
        sd = random_lora(linears, rank, seed, modules=modules)
        return save_diffusers_lora(tmp_path / f"r{rank}-{seed}", "flux", sd, rank=rank, alpha=rank * 2)

    sparse = names[: len(names) // 3]  # stays per-module: the bucket must follow it too
    cases = [  # (identity, style) as (path, scale) or None, and the bucket the request needs
        ((adapter(1, 1), 0.9), (adapter(2, 2), 0.6), 2),
        ((adapter(3, 3), 1.1), None, 4),
        ((adapter(TARGET_RANK, 4), 0.7), (adapter(2, 5), 1.0), TARGET_RANK),
        ((adapter(2, 6), 1.2), (adapter(1, 7), 0.5), 2),  # back down: the larger rows are not read
        ((adapter(4, 8, modules=sparse), 1.0), (adapter(1, 9), 0.8), 4),
        (None, None, 2),
    ]
    for i, (identity, style, bucket) in enumerate(cases):
        pair = {"identity": identity or (None, 0.0), "style": style or (None, 0.0)}
        request = {slot: spec for slot, spec in pair.items() if spec[0] is not None}
        result = engine.generate(PROMPT, adapters=request, num_images=4, num_inference_steps=STEPS,
                                 output_type="latent")
        assert result.swap.rank_bucket == bucket, f"case {i}"
        assert_equals_diffusers(engine, model_dir, pair, result.images, f"case {i}")
    assert engine.recompiles == 0
    engine.writer.check_intact()


def assert_equals_diffusers(engine, model_dir, pair, images, case: str) -> None:
    """A pack of 4 (seed 0) within TOLERANCE of plain diffusers with the same two adapters."""
    theirs = plain_diffusers_reference(
        model_dir, pair, prompt=PROMPT, num_images=4, num_inference_steps=STEPS,
        guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=0)
    diff = (images - theirs).abs().max().item()
    assert diff <= TOLERANCE, f"{case}: max |engine - diffusers| = {diff}"


def test_bucket_settings_are_checked(tiny_models):
    with pytest.raises(ValueError, match="rank buckets"):
        Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, compile=False,
                               rank_buckets=(TARGET_RANK + 1,))
    with pytest.raises(ValueError, match="mixed"):
        Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, compile=False, mixed=True,
                               rank_buckets=(2,))


def test_the_default_buckets_include_one_without_any_lora_branch(tiny_models, tmp_path):
    """Unset ``rank_buckets``: 0 and target_rank/4 besides target_rank. A request without adapters
    runs bucket 0 (PEFT's "adapters disabled" path in every slot layer: the base model's compute),
    equal to plain diffusers' base pipeline; adapters bring the branches back; no recompile."""
    from hotlora.errors import SlotStateCorrupt

    import torch

    model_dir = tiny_models["flux"]
    # The module's ``bucketed`` fixture keeps error_on_recompile on; this engine's warm-up must compile.
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=3, compile=True)
    assert engine.writer.rank_buckets == (0, TARGET_RANK // 4, TARGET_RANK)
    linears = dict(engine.ceiling.modules)

    def adapter(rank, seed):
        sd = random_lora(linears, rank, seed)
        return save_diffusers_lora(tmp_path / f"r{rank}-{seed}", "flux", sd, rank=rank, alpha=rank)

    quarter = TARGET_RANK // 4
    cases = [({}, 0), ({"identity": (adapter(quarter, 1), 0.8)}, quarter), ({}, 0),
             ({"identity": (adapter(TARGET_RANK, 2), 0.9), "style": (adapter(1, 3), 1.2)}, TARGET_RANK),
             ({"style": (adapter(1, 4), 0.0)}, 0)]  # scale 0 writes nothing: no branch either
    with recompiles_are_errors():
        for i, (request, bucket) in enumerate(cases):
            result = engine.generate(PROMPT, adapters=request, num_images=4, num_inference_steps=STEPS,
                                     output_type="latent")
            assert result.swap.rank_bucket == bucket, f"case {i}"
            assert all(layer.disable_adapters == (bucket == 0) for layer in engine.writer._layers)
            pair = {slot: request.get(slot, (None, 0.0)) for slot in ("identity", "style")}
            assert_equals_diffusers(engine, model_dir, pair, result.images, f"case {i}")
    assert engine.recompiles == 0
    engine.writer.check_intact()
    engine.writer._layers[0]._disable_adapters = False  # someone switching a branch back on behind the engine
    with pytest.raises(SlotStateCorrupt, match="switched"):
        engine.writer.check_intact()
    engine.writer._layers[0]._disable_adapters = True
