"""Mixed-adapter batches: requests with different adapters share one compiled forward pass, and
every sample equals what a fresh plain diffusers pipeline gives for its request alone."""

import random

import pytest

from hotlora.adapters.binding import Binding
from hotlora.errors import InvalidRequest
from hotlora.families import family_named
from hotlora.testing import plain_diffusers_reference

from ..helpers import PackRequest, allow_cfg_rounding, generate_batch, recompiles_are_errors

TOLERANCE = 1e-4
STEPS = 3


@pytest.fixture(autouse=True)
def no_recompiles(mixed):
    with recompiles_are_errors():
        yield


def mixes_one_prompt(family: str) -> bool:
    """Whether requests of different prompts never share a mixed batch of ``family``."""
    texts = family_named(family).mixed_batch_texts
    return texts("a cat", None, ()) != texts("a red house", None, ())


def random_request(rng, pool, images, family):
    """Random adapters and scales; a random prompt, or one for all where a family mixes the same
    prompts only (Qwen-Image 2.1: ``mixed_batch_texts``)."""
    adapters = {}
    for slot in ("identity", "style"):
        if rng.random() < 0.8:
            adapters[slot] = (pool[rng.randrange(len(pool))], round(rng.uniform(0.0, 1.5), 2))
    prompts = ["a cat"] if mixes_one_prompt(family) else ["a cat", "a red house", "an astronaut"]
    return PackRequest(prompt=rng.choice(prompts), adapters=adapters, num_images=images, seed=rng.randrange(1000))


def test_every_sample_equals_its_single_request_result(mixed, request):
    family, model_dir, engine, pool = mixed
    allow_cfg_rounding(request, family, banks=True)
    rng = random.Random(f"schedule-{family}")
    compared = expected = 0
    for batch in range(8):  # a random schedule: 1..3 requests per batch, adapters recycled through the bank
        sizes = rng.choice([[1, 1, 1], [2, 1], [1, 2], [3], [1, 1], [2]])
        requests = [random_request(rng, pool, n, family) for n in sizes]
        expected += len(requests)
        results = generate_batch(engine, requests, num_inference_steps=STEPS, output_type="latent")
        for request, result in zip(requests, results):
            reference = plain_diffusers_reference(
                model_dir, {slot: (str(path), scale) for slot, (path, scale) in request.adapters.items()},
                prompt=request.prompt, num_images=request.num_images, num_inference_steps=STEPS,
                guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width,
                seed=request.seed)
            diff = (result.images - reference).abs().max().item()
            assert diff <= TOLERANCE, f"batch {batch}: request {request} differs by {diff}"
            compared += 1
    assert compared == expected
    assert engine.recompiles == 0


def test_single_requests_and_long_random_schedules_never_recompile(mixed):
    family, model_dir, engine, pool = mixed
    rng = random.Random(f"long-{family}")
    steps = engine.family.min_steps  # one, where the family's scheduler can run a single step
    for _ in range(25):
        sizes = rng.choice([[1, 1, 1], [2, 1], [3], [1], [1, 1]])
        generate_batch(engine, [random_request(rng, pool, n, family) for n in sizes], num_inference_steps=steps,
                              output_type="latent")
    single = engine.generate("a cat", adapters={"identity": (pool[0], 0.9)}, num_images=4, num_inference_steps=steps,
                             output_type="latent")  # chunks 3 + 1, through the same bank
    assert single.images.shape[0] == 4
    assert engine.recompiles == 0


def test_bank_limits_are_request_errors(mixed):
    family, model_dir, engine, pool = mixed
    with pytest.raises(InvalidRequest, match="mixed batch holds"):
        generate_batch(engine, [PackRequest("a", num_images=2), PackRequest("b", num_images=2)])
    adapter = engine.load_adapter(str(pool[0]))
    too_many = [{"identity": Binding(adapter, 0.1 * i), "style": Binding(adapter, 0.1 * i + 0.05)} for i in range(1, engine.writer.entries)]
    with pytest.raises(InvalidRequest, match="distinct adapters in one batch"):
        engine.writer.bind(too_many)


@pytest.mark.parametrize("mixed", [pytest.param("zimage", marks=pytest.mark.families)], indirect=True)
def test_packed_layers_keep_each_samples_adapter(mixed, tmp_path):
    """Z-Image's embedders see the batch's tokens packed into one sequence (``packed_linears``):
    adapters there only, two of them on prompts of unequal lengths (the captions' runs differ)
    beside a sample without any, under guidance (the doubled batch), each equal to plain
    diffusers alone."""
    from hotlora.testing import random_lora, save_diffusers_lora

    family, model_dir, engine, pool = mixed
    packed = family_named(family).packed_linears
    linears = dict(engine.ceiling.modules)
    embedders = sorted(name for name in linears if name.startswith(packed))
    assert {name.split(".")[0] for name in embedders} == {"all_x_embedder", "cap_embedder"}
    files = [save_diffusers_lora(tmp_path / f"packed{i}", family, random_lora(linears, 4, seed=70 + i, strength=2.0,
                                                                              modules=embedders), rank=4, alpha=4)
             for i in range(2)]
    requests = [PackRequest("a cat", {"identity": (files[0], 1.0)}, seed=1),
                PackRequest("a red house on a hill under a violet sky, oil on canvas", {}, seed=2),
                PackRequest(" ".join(["astronaut"] * 12), {"style": (files[1], 0.7)}, seed=3)]
    results = generate_batch(engine, requests, num_inference_steps=2, output_type="latent", guidance_scale=1.0)
    for request, result in zip(requests, results):
        reference = plain_diffusers_reference(
            model_dir, {slot: (str(path), scale) for slot, (path, scale) in request.adapters.items()},
            prompt=request.prompt, num_images=1, num_inference_steps=2, guidance_scale=1.0,
            height=engine.height, width=engine.width, seed=request.seed)
        assert (result.images - reference).abs().max().item() <= TOLERANCE, request
    assert engine.recompiles == 0
