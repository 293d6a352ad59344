"""Many sizes from one warm engine (issue 16): every served size at every batch shape equals plain
diffusers at that size with no compile after warm-up; a size outside the set is refused with the
list, or snapped to the nearest served size, without compiling; requests of different sizes never
share a forward batch; the adapter memory does not grow with the sizes.

Compiled engines shared by the module: Flux with adapter banks (mixed batches) at three sizes;
Flux with slots and rank buckets at two sizes (rank buckets x sizes); SDXL with slots at two sizes,
with and without CFG. ``error_on_recompile`` is on for every request.

CI time: compiles are the cost, and in one pytest process engines of one configuration share
dynamo's graphs (they run the same block classes' code). So each engine here is configured like
one compiled before this module at the default size (batch 3, as the shared mixed-batch Flux
engine, ``mixed`` in conftest.py, and test_contract.py's SDXL engine): in a full run only the sizes
past the first compile here. The third Flux size compiles nothing anywhere (the second made the
dimensions dynamic), so it costs only its warm-up passes."""

import random
import time
from dataclasses import replace

import pytest
import torch

from hotlora import Engine
from hotlora.settings import EngineConfig, parse_size, parse_sizes
from hotlora.engine.pipeline import graph_count
from hotlora.engine.request import RequestRules, UnservedShape, nearest_size
from hotlora.engine.worker import Job, Worker
from hotlora.engine.writers import install_writer
from hotlora.errors import InvalidRequest
from hotlora.families import family_named
from hotlora.server.errors import status_of
from hotlora.testing import plain_diffusers_reference, random_lora, save_diffusers_lora

from ..helpers import TARGET_RANK

TOLERANCE = 1e-4  # float32 latents; compiled kernels reorder sums
STEPS = 2
BATCH = 3  # see the module docstring: the batch of the engines whose graphs these reuse
PROMPT = "a lighthouse at dusk"
# WIDTHxHEIGHT; the tiny Flux model's default is 32x32 (multiples of 2: VAE factor 1 x 2x2 packing).
# Three aspect ratios and three sequence lengths (256, 384, 512 tokens).
FLUX_SIZES = ("32x32", "48x32", "32x64")
SDXL_SIZES = ("64x64", "96x64")  # the tiny SDXL model's default is 64x64 (multiples of 4)
BUCKETS = (4,)  # with the target rank: buckets 4 and 8


@pytest.fixture(scope="module")
def no_recompiles():
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    yield
    torch._dynamo.config.error_on_recompile = previous


def warm(model_dir, batch_size=BATCH, **options):
    with torch._dynamo.config.patch(error_on_recompile=False):  # the warm-up compiles; requests may not
        # rank_buckets=(): one writer state (the default's three would triple every size's warm-up here;
        # tests/integration/test_rank_buckets.py and test_contract.py cover the default buckets)
        return Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=batch_size, compile=True,
                                      **{"rank_buckets": (), **options})


@pytest.fixture(scope="module")
def flux(tiny_models, no_recompiles):
    engine = warm(tiny_models["flux"], mixed=True, sizes=",".join(FLUX_SIZES))
    yield tiny_models["flux"], engine
    assert engine.recompiles == 0


@pytest.fixture(scope="module")
def bucketed(tiny_models, no_recompiles):
    """Slots with rank buckets at two sizes. Batch 1 (CI time): every bucket compiles its graphs per
    batch shape, and graphs with a dynamic sequence length are the slowest to compile. Measured
    cold: giving test_rank_buckets.py's batch-3 engine a second size cost 88 s more (24 graphs
    instead of 18); this engine compiles 6 in about 30 s. Chunks of 3 with buckets stay
    test_rank_buckets.py's."""
    engine = warm(tiny_models["flux"], batch_size=1, rank_buckets=BUCKETS, sizes=",".join(FLUX_SIZES[:2]))
    yield tiny_models["flux"], engine
    assert engine.recompiles == 0


@pytest.fixture(scope="module")
def sdxl(tiny_models, no_recompiles):
    engine = warm(tiny_models["sdxl"], sizes=SDXL_SIZES)
    yield tiny_models["sdxl"], engine
    assert engine.recompiles == 0


def reference(model_dir, adapters, size, num_images, seed, guidance):
    height, width = parse_size(size)
    return plain_diffusers_reference(model_dir, {slot: (str(p), s) for slot, (p, s) in adapters.items()},
                                     prompt=PROMPT, num_images=num_images, num_inference_steps=STEPS,
                                     guidance_scale=guidance, height=height, width=width, seed=seed)


def random_adapters(rng, model_dir):
    names = {"identity": ["identity-diffusers"],  # what plain diffusers loads as it is (not the PEFT layout)
             "style": ["style-diffusers", "style-kohya.safetensors"]}
    return {slot: (model_dir / "adapters" / rng.choice(options), round(rng.uniform(0.3, 1.3), 2))
            for slot, options in names.items() if rng.random() < 0.8}


def generate(engine, adapters, size, num_images=1, seed=0, **extra):
    height, width = parse_size(size)
    return engine.generate(PROMPT, adapters=adapters, num_images=num_images, num_inference_steps=STEPS, seed=seed,
                           height=height, width=width, output_type="latent", **extra)


# ---------------------------------------------------------------------------- configuration


def test_sizes_parse_as_the_openai_api_writes_them():
    assert parse_sizes("1024x1024, 832x1216,1024x1024") == ((1024, 1024), (1216, 832))  # (height, width)
    assert EngineConfig(sizes=["48x32", (64, 32)]).sizes == ((32, 48), (64, 32))
    assert EngineConfig().sizes == ()
    for bad in ("1024", "0x64", "axb"):
        with pytest.raises(ValueError, match="size"):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="size_policy"):
        EngineConfig(size_policy="biggest")
    # Fingerprints: the sizes enter resolved, so "32x32" given and the model's default 32x32 are one key.
    assert EngineConfig(sizes="32x32").fingerprint("m", "flux", sizes=((32, 32),)) == \
        EngineConfig().fingerprint("m", "flux", sizes=((32, 32),))


def test_nearest_is_closest_in_aspect_ratio_then_area():
    served = ((1024, 1024), (1216, 832), (832, 1216), (1536, 1024))  # (height, width)
    assert nearest_size(served, 512, 512) == (1024, 1024)
    assert nearest_size(served, 1792, 1024) == (1536, 1024)  # OpenAI's 1024x1792: 1.75 is closer to 1.5 than 1.46
    assert nearest_size(served, 1216 * 2, 832 * 2) == (1216, 832)
    assert nearest_size(served, 1000, 1500) == (832, 1216)


def test_an_eager_engine_serves_any_multiple_unless_given_sizes(tiny_models):
    free = RequestRules(family_named("flux"), {"num_inference_steps": 2, "guidance_scale": 3.5}, EngineConfig().limits,
                        ((32, 32),), 2, sizes_only=False)  # what an engine with compile=False and no sizes has
    assert free.check(PROMPT, height=48, width=40).height == 48
    with pytest.raises(InvalidRequest, match="multiple of 2"):
        free.check(PROMPT, height=33)
    fixed = Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                                   sizes="32x32,48x32", size_policy="nearest")
    assert fixed.describe()["sizes"] == ["32x32", "48x32"] and fixed.describe()["size_policy"] == "nearest"
    params = fixed.rules.check(PROMPT, height=40, width=64)
    assert (params.height, params.width, params.snapped_from) == (32, 48, "64x40")
    with pytest.raises(ValueError, match="multiples of 2"):
        Engine.from_pretrained(tiny_models["flux"], target_rank=TARGET_RANK, batch_size=1, compile=False,
                               sizes="33x32")


# ---------------------------------------------------------------------------- Flux: three sizes, banks


def test_every_served_size_equals_plain_diffusers_without_recompiling(flux):
    model_dir, engine = flux
    assert engine.describe()["sizes"] == list(FLUX_SIZES) and engine.served_sizes[0] == (32, 32)
    rng = random.Random("sizes-flux")
    # Every size and every batch shape: 1, 2, 3 and 4 images (a full chunk and a last chunk of 1).
    schedule = [(size, n) for size, n in zip(FLUX_SIZES, (BATCH + 1, 1, BATCH))] + [(FLUX_SIZES[1], BATCH - 1)]
    rng.shuffle(schedule)
    for size, n in schedule:
        adapters, seed = random_adapters(rng, model_dir), rng.randrange(1000)
        result = generate(engine, adapters, size, n, seed)
        assert result.size == size and result.snapped_from is None
        theirs = reference(model_dir, adapters, size, n, seed, engine.defaults["guidance_scale"])
        diff = (result.images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"{size} x {n}: max |engine - diffusers| = {diff}"
    assert engine.recompiles == 0


def test_an_unserved_size_is_refused_with_the_list_without_compiling(flux):
    _, engine = flux
    graphs = graph_count()
    for height, width in ((64, 64), (32, 33), (48, 48)):
        began = time.perf_counter()
        with pytest.raises(UnservedShape, match="served sizes: 32x32, 48x32, 32x64") as info:
            engine.generate(PROMPT, height=height, width=width, num_inference_steps=STEPS)
        assert time.perf_counter() - began < 2.0
        assert status_of(info.value) == 422 and info.value.sizes == FLUX_SIZES
        assert f"size {width}x{height}" in str(info.value)
    assert graph_count() == graphs and engine.recompiles == 0


def test_nearest_snaps_to_a_served_size_and_says_so(flux):
    model_dir, engine = flux
    rules = engine.rules
    engine.front.rules = replace(rules, size_policy="nearest")  # what size_policy="nearest" builds
    try:
        graphs = graph_count()
        adapters = {"style": (model_dir / "adapters" / "style-diffusers", 0.9)}
        for asked, served in (("96x64", "48x32"), ("31x61", "32x64"), ("40x40", "32x32")):
            prepared = engine.prepare(PROMPT, adapters=adapters, num_inference_steps=STEPS, output_type="latent",
                                      height=parse_size(asked)[0], width=parse_size(asked)[1], seed=5)
            assert (prepared.size, prepared.snapped_from) == (served, asked)
            result = engine.run(prepared)
            assert (result.size, result.snapped_from) == (served, asked)
            theirs = reference(model_dir, adapters, served, 1, 5, engine.defaults["guidance_scale"])
            torch.testing.assert_close(result.images, theirs, atol=TOLERANCE, rtol=0)
        assert graph_count() == graphs and engine.recompiles == 0
    finally:
        engine.front.rules = rules


def test_requests_of_different_sizes_never_share_a_forward_batch(flux):
    model_dir, engine = flux
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.8)}

    def prepared(size, seed):
        height, width = parse_size(size)
        return engine.prepare(PROMPT, adapters=adapters, num_inference_steps=STEPS, height=height, width=width,
                              seed=seed, output_type="latent")

    with pytest.raises(InvalidRequest, match="share steps, guidance, size"):
        engine.run([prepared("32x32", 0), prepared("48x32", 1)])
    # The worker merges only equal sizes: 48x32, 32x64, 48x32 queued -> one batch of the two 48x32.
    # The first job waits up to max_batch_delay_s for companions; the other two are queued at once.
    worker = Worker(lambda: engine, max_batch_delay_s=2.0)
    worker.start()
    try:
        jobs = [Job(prepared(size, seed)) for seed, size in enumerate(("48x32", "32x64", "48x32"))]
        for job in jobs:
            worker.submit(job)
        results = [job.future.result(timeout=300) for job in jobs]
    finally:
        worker.stop(drain_timeout_s=30)
    assert worker.batches == 1
    assert [r.size for r in results] == ["48x32", "32x64", "48x32"]
    for (size, seed), result in zip((("48x32", 0), ("32x64", 1), ("48x32", 2)), results):
        theirs = reference(model_dir, adapters, size, 1, seed, engine.defaults["guidance_scale"])
        torch.testing.assert_close(result.images, theirs, atol=TOLERANCE, rtol=0)
    assert engine.recompiles == 0


def test_adapter_memory_is_shared_across_sizes(flux, bucketed, sdxl):
    """The writer an engine with several sizes holds is byte for byte the one a single-size engine
    would hold: the same writer installed on a fresh copy of the denoiser."""
    for model_dir, engine in (flux, bucketed, sdxl):
        assert len(engine.served_sizes) > 1
        denoiser = type(engine.denoiser).from_pretrained(model_dir / engine.family.denoiser)
        single = install_writer(engine.config.replace(sizes=()), denoiser, engine.family.name, [])
        assert engine.writer.nbytes == single.nbytes > 0
        assert engine.describe()["slot_bytes"] == single.describe()["slot_bytes"]


# ---------------------------------------------------------------------------- Flux: rank buckets x two sizes


def test_rank_buckets_at_every_size_equal_plain_diffusers(bucketed, tmp_path):
    """Every bucket at every size, in a shuffled order, with random adapters of random ranks in
    random slots: each request runs the smallest bucket that holds it, at the size asked, equals
    plain diffusers there, and compiles nothing (1 or 2 images: one chunk or two)."""
    model_dir, engine = bucketed
    assert engine.writer.rank_buckets == (*BUCKETS, TARGET_RANK)
    assert engine.describe()["sizes"] == list(FLUX_SIZES[:2])
    linears = dict(engine.ceiling.modules)
    rng = random.Random("sizes-buckets")
    ranks = {4: range(1, 5), TARGET_RANK: range(5, TARGET_RANK + 1)}  # bucket -> the largest ranks it serves
    schedule = [(bucket, size) for bucket in engine.writer.rank_buckets for size in FLUX_SIZES[:2]]
    rng.shuffle(schedule)
    for i, (bucket, size) in enumerate(schedule):
        slots = ["identity", "style"]
        rng.shuffle(slots)
        slot_ranks = {slots[0]: rng.choice(ranks[bucket])}  # the request's largest rank picks its bucket
        if rng.random() < 0.8:
            slot_ranks[slots[1]] = rng.randint(1, slot_ranks[slots[0]])
        adapters = {}
        for slot, rank in slot_ranks.items():
            sd = random_lora(linears, rank, seed=100 + 2 * i + (slot == "style"))
            alpha = rng.choice([rank, 2 * rank])
            adapters[slot] = (save_diffusers_lora(tmp_path / f"{i}-{slot}", "flux", sd, rank=rank, alpha=alpha),
                              round(rng.uniform(0.3, 1.3), 2))
        n, seed = rng.randint(1, 2), rng.randrange(1000)
        result = generate(engine, adapters, size, n, seed)
        assert (result.size, result.swap.rank_bucket) == (size, bucket), f"case {i}"
        theirs = reference(model_dir, adapters, size, n, seed, engine.defaults["guidance_scale"])
        diff = (result.images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"case {i}, bucket {bucket} at {size} x {n}: max |engine - diffusers| = {diff}"
    assert engine.recompiles == 0
    engine.writer.check_intact()


# ---------------------------------------------------------------------------- SDXL: two sizes, CFG on and off


def test_sdxl_sizes_with_and_without_cfg_equal_plain_diffusers(sdxl):
    model_dir, engine = sdxl
    assert engine.describe()["sizes"] == list(SDXL_SIZES)
    rng = random.Random("sizes-sdxl")
    cfg = engine.defaults["guidance_scale"]
    schedule = [(SDXL_SIZES[0], cfg, BATCH), (SDXL_SIZES[0], 1.0, 1),
                (SDXL_SIZES[1], cfg, BATCH + 1), (SDXL_SIZES[1], 1.0, BATCH - 1)]
    rng.shuffle(schedule)
    for size, guidance, n in schedule:
        adapters, seed = random_adapters(rng, model_dir), rng.randrange(1000)
        result = generate(engine, adapters, size, n, seed, guidance_scale=guidance)
        theirs = reference(model_dir, adapters, size, n, seed, guidance)
        diff = (result.images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"{size}, guidance {guidance}, {n} images: max |engine - diffusers| = {diff}"
    assert engine.recompiles == 0
