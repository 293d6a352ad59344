"""Step caching (cache-dit DBCache) on the compiled, hot-swapped engine."""

import pytest
import torch

from hotlora import Engine
from hotlora.engine.stepcache import StepCache, StepCacheError

STEPS = 10


def cached_runs_stay_close(model, backend: str, requests, steps: int, num_images: int) -> None:
    """A compiled engine with the step cache ``backend`` and a plain eager one run ``requests`` (the
    i-th at ``steps + i`` steps: per-request step counts) under ``error_on_recompile``: each result
    finite and close to the exact one but not equal to it; no recompile."""
    plain = Engine.from_pretrained(model, target_rank=8, batch_size=num_images, compile=False)
    # Random weights move the first block's residual by ~0.2-0.5 per step: 0.8 lets steps be skipped.
    cached = Engine.from_pretrained(model, target_rank=8, batch_size=num_images, compile=True, rank_buckets=(),  # 1 state: CI time
                                    step_cache=StepCache(backend, threshold=0.8, warmup_steps=2))
    assert cached.describe()["step_cache"] == backend
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        for i, adapters_here in enumerate(requests):
            ours = cached.generate("a cat", adapters=adapters_here, num_images=num_images, num_inference_steps=steps + i,
                                   output_type="latent").images
            exact = plain.generate("a cat", adapters=adapters_here, num_images=num_images, num_inference_steps=steps + i,
                                   output_type="latent").images
            assert torch.isfinite(ours).all()
            relative = ((ours - exact).norm() / exact.norm()).item()
            # Skipped steps reuse cached residuals: close to the exact result, but not equal to it
            # (compiled without a cache the engine matches it within 1e-5, see test_contract).
            assert 1e-3 < relative < 0.5, f"request {i}: relative difference {relative:.4f}"
    finally:
        torch._dynamo.config.error_on_recompile = previous
    assert cached.recompiles == 0
    torch._dynamo.reset()  # the next backend compiles the same block classes afresh


@pytest.mark.parametrize("backend", ["dbcache", "taylorseer", "fbcache"])
def test_a_threshold_that_skips_steps_stays_close_and_never_recompiles(tiny_models, backend):
    model = tiny_models["flux"]
    adapters = model / "adapters"
    requests = [{"identity": (str(adapters / "identity-diffusers"), 0.9), "style": (str(adapters / "style-kohya.safetensors"), 0.6)},
                {"identity": (str(adapters / "identity-peft"), 1.2)},
                {"style": (str(adapters / "style-diffusers"), 0.4)}]
    cached_runs_stay_close(model, backend, requests, STEPS, num_images=2)


def test_unknown_backends_and_unsupported_models_fail_at_start_up(tiny_models):
    with pytest.raises(StepCacheError, match="unknown step cache"):
        Engine.from_pretrained(tiny_models["flux"], target_rank=8, batch_size=1, compile=False,
                               step_cache=StepCache(backend="magic"))


VIDEO_STEPS = 8


@pytest.mark.families
@pytest.mark.parametrize(("backend", "variant"), [("dbcache", None), ("dbcache", "two-experts"),
                                                  ("taylorseer", "two-experts")])
def test_wan_steps_are_cached_on_every_expert_without_recompiling(tiny_models, tmp_path_factory, variant, backend):
    """Wan 2.1 (one transformer) and Wan 2.2 A14B (two experts: cache-dit's Wan adapter caches
    both) with true CFG's two passes: compiled, adapters swapped
    and steps varied per request, never recompiling; close to the uncached result, not equal to it
    (steps were skipped)."""
    from hotlora.testing import save_tiny_model

    model = tiny_models["wan"] if variant is None else save_tiny_model(
        tmp_path_factory.mktemp(variant) / "wan", "wan", target_rank=8, variant=variant)
    adapters = model / "adapters"
    pair = adapters / ("experts-pair" if variant else "identity-diffusers")
    requests = [{"identity": (str(pair), 0.9), "style": (str(adapters / "style-diffusers"), 0.6)},
                {"identity": (str(pair), 1.2)}]
    cached_runs_stay_close(model, backend, requests, VIDEO_STEPS, num_images=1)


def test_first_block_cache_is_refused_on_wan_at_start_up(tiny_models):
    """FirstBlockCache recompiled a compiled Wan engine's blocks on a request (true CFG's two
    passes): refused when the engine starts, naming what to use instead."""
    with pytest.raises(StepCacheError, match="'fbcache' is not served on wan: .* use dbcache"):
        Engine.from_pretrained(tiny_models["wan"], target_rank=8, batch_size=1, compile=False,
                               step_cache=StepCache(backend="fbcache"))
