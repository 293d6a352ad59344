"""No request can take the warm engine down: bounded scales and weights, work caps, unserved
sizes and a non-finite pack are the caller's fault (4xx, no rebuild, no compile); a corrupted base
weight is still an engine fault. The engine is compiled and ``error_on_recompile`` is on."""

import time

import pytest
import torch

from hotlora import Engine
from hotlora.settings import RequestLimits
from hotlora.engine.guard import NonFiniteOutput
from hotlora.engine.request import UnservedShape
from hotlora.errors import AdapterRejected, EngineError, InvalidRequest, RequestError, RequestTooLarge
from hotlora.server.errors import status_of
from hotlora.testing import plain_diffusers_reference, random_lora

from ..helpers import TARGET_RANK, recompiles_are_errors

PROMPT = "a portrait"
STEPS = 2
FAST_S = 2.0  # refusals happen before the engine runs: milliseconds in practice


@pytest.fixture(scope="module")
def warm(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=3, compile=True,
                                    rank_buckets=(),  # one writer state: CI time (test_rank_buckets covers them)
                                    limits=RequestLimits(max_scale=4.0, max_work=32 * 32 * 8 * 10))
    with recompiles_are_errors():
        yield tiny_models["flux"], engine
    assert engine.recompiles == 0


@pytest.fixture(scope="module")
def linears(warm):
    from diffusers import FluxTransformer2DModel

    model_dir, _ = warm
    transformer = FluxTransformer2DModel.from_pretrained(model_dir / "transformer")
    return {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear)}


def lora(linears, factor=1.0, seed=1):
    return {f"transformer.{k}": v * factor for k, v in random_lora(linears, 4, seed=seed).items()}


def refused_fast(call, error, match):
    began = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        call()
    assert time.perf_counter() - began < FAST_S
    assert isinstance(info.value, RequestError)
    return info.value


def test_a_huge_scale_is_refused_before_any_swap(warm, linears):
    _, engine = warm
    occupants = engine.writer.describe()["occupants"]
    for scale in (1e30, -5.0, 4.5):
        refused_fast(lambda: engine.generate(PROMPT, adapters={"style": (lora(linears), scale)}, num_inference_steps=STEPS),
                     InvalidRequest, "outside the allowed range -4..4")
    assert engine.writer.describe()["occupants"] == occupants  # nothing was written


def test_huge_but_finite_weights_are_refused_with_the_reason(warm, linears):
    _, engine = warm
    exc = refused_fast(lambda: engine.generate(PROMPT, adapters={"identity": lora(linears, factor=1e12)},
                                               num_inference_steps=STEPS),
                       AdapterRejected, "too large for the serving dtype")
    assert status_of(exc) == 422


def test_an_overflowing_pack_is_the_requests_fault_and_the_engine_stays_warm(warm, linears):
    """Weights under the static bound can still overflow the pack: the request gets a 422 naming its
    adapters, the base model is checked intact, and the next request equals a fresh diffusers load."""
    model_dir, engine = warm
    overflowing = lora(linears, factor=3e7)
    with pytest.raises(NonFiniteOutput, match="identity=.* at scale 1.*base model is intact") as info:
        engine.generate(PROMPT, adapters={"identity": (overflowing, 1.0)}, num_inference_steps=STEPS)
    assert status_of(info.value) == 422

    good = lora(linears, seed=2)
    ours = engine.generate(PROMPT, adapters={"identity": (good, 0.8)}, num_images=2, num_inference_steps=STEPS,
                           output_type="latent").images
    theirs = plain_diffusers_reference(model_dir, {"identity": (good, 0.8)}, prompt=PROMPT, num_images=2,
                                       num_inference_steps=STEPS, guidance_scale=engine.defaults["guidance_scale"],
                                       height=engine.height, width=engine.width, seed=0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_a_size_the_engine_was_not_warmed_at_is_refused_without_compiling(warm):
    _, engine = warm
    exc = refused_fast(lambda: engine.generate(PROMPT, height=engine.height * 2, width=engine.width,
                                               num_inference_steps=1),
                       UnservedShape, f"served sizes: {engine.width}x{engine.height}")
    assert status_of(exc) == 422
    assert engine.describe()["sizes"] == [f"{engine.width}x{engine.height}"]


def test_the_fail_on_recompile_stance_backs_the_size_check(warm):
    """Whatever RequestRules miss, the engine section refuses a compile instead of starting one.
    The shape no graph in this process has seen: a shorter T5 sequence (other test modules' engines
    share dynamo's graphs, dynamic image sizes included)."""
    _, engine = warm
    with pytest.raises(UnservedShape, match="would compile a new graph"):
        with engine.warm.section():
            engine.pipeline(prompt=PROMPT, num_inference_steps=1, max_sequence_length=128, output_type="latent")


def test_work_caps_answer_413_with_the_limit(warm):
    _, engine = warm
    exc = refused_fast(lambda: engine.generate(PROMPT, num_images=8, num_inference_steps=11),
                       RequestTooLarge, "limit is 81,920")
    assert status_of(exc) == 413
    refused_fast(lambda: engine.generate("x" * 20_000), RequestTooLarge, "prompt has 20000 characters")
    refused_fast(lambda: engine.generate(PROMPT, num_images=65), InvalidRequest, "num_images must be an integer in 1..64")


def test_a_corrupted_base_weight_is_still_an_engine_fault(tiny_models, linears):
    """The same non-finite output with a NaN in a base weight: EngineError (the worker rebuilds)."""
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False)
    weight = next(p for n, p in engine.denoiser.named_parameters() if "lora_" not in n and p.ndim == 2)
    with torch.no_grad():
        weight.fill_(float("nan"))
    with pytest.raises(EngineError, match="non-finite"):
        engine.generate(PROMPT, adapters={"identity": lora(linears)}, num_inference_steps=1)
