"""The correctness contract (README, "Correctness"): the warm, compiled, hot-swapped engine returns what a fresh
plain diffusers pipeline returns after ``load_lora_weights`` x2 + ``set_adapters``, and compiles
nothing after warm-up (``error_on_recompile`` is on for every request here)."""

import gc
import random
import warnings

import pytest
import torch

from hotlora import Engine
from hotlora.adapters.binding import Binding
from hotlora.engine.pipeline import graph_count
from hotlora.errors import AdapterNotFound, AdapterRejected, InvalidRequest
from hotlora.families import family_named
from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import (
    CORE_FAMILIES, TARGET_RANK, allow_cfg_rounding, engine_reference, family_params, recompiles_are_errors,
)

TOLERANCE = 1e-4  # float32 latents; compiled kernels reorder sums
PROMPT = "a portrait of an astronaut, watercolor"
STEPS = 3
N = 4  # with batch_size 3: one full chunk and a last chunk of 1


@pytest.fixture(scope="module", params=family_params(every=True))
def warm(request, tiny_models):
    family = request.param
    # Beyond the core families one writer state (no rank buckets: tests/integration/test_rank_buckets.py
    # covers those) keeps a compiled engine per family within CI's time; the contract is the same.
    buckets = {} if family in CORE_FAMILIES else {"rank_buckets": ()}
    engine = Engine.from_pretrained(tiny_models[family], target_rank=TARGET_RANK, batch_size=3, compile=True, **buckets)
    with recompiles_are_errors():
        yield family, tiny_models[family], engine
    assert engine.recompiles == 0


def tolerance(engine) -> float:
    """``TOLERANCE`` per forward pass. Under classifier-free guidance each step's prediction is
    ``uncond + g x (cond - uncond)``, so the compiled kernels' rounding in the two passes reaches the
    latents scaled by up to the guidance ``g`` (measured: Sana at guidance 4.5 within 2.9e-4 on an
    AVX-512/AMX Xeon, within 1e-4 on other CPUs)."""
    guidance = engine.defaults["guidance_scale"]
    return TOLERANCE * max(1.0, guidance) if engine.family.cfg != "none" else TOLERANCE


def reference(engine, model_dir, adapters, num_images=N, seed=0):
    return engine_reference(engine, model_dir, adapters, prompt=PROMPT, steps=STEPS, num_images=num_images, seed=seed)


def served(engine, adapters, num_images=N, seed=0):
    result = engine.generate(PROMPT, adapters=adapters, num_images=num_images, num_inference_steps=STEPS,
                             seed=seed, output_type="latent")
    return result.images


def random_pairs(family, model_dir, pipeline_linears, tmp_path):
    """Six adapter pairs: ranks 1..target, scales 0..1.5, random module subsets, alphas != rank;
    one pair in the family's trainer layout (kohya), one with the style slot empty, one given as an in-memory state dict."""
    rng = random.Random(f"contract-{family}")
    names = sorted(pipeline_linears)
    fam = family_named(family)
    prefix = fam.denoiser
    pairs = []
    for k in range(6):
        pair = {}
        for slot in ("identity", "style"):
            rank = rng.randint(1, TARGET_RANK)
            scale = round(rng.uniform(0.0, 1.5), 3)
            seed = rng.randrange(10**6)
            modules = rng.sample(names, rng.randint(max(1, len(names) // 3), len(names)))
            sd = random_lora(pipeline_linears, rank, seed, modules=modules)
            path = tmp_path / f"{family}-{k}-{slot}"
            if slot == "style" and k == 3:
                pair[slot] = (None, 0.0)
            elif slot == "identity" and k == 2 and fam.trainer_lora(path.with_suffix(".safetensors"), pipeline_linears,
                                                                  sd, rank, seed) is not None:
                pair[slot] = (path.with_suffix(".safetensors"), scale)
            elif slot == "identity" and k == 5:
                pair[slot] = ({f"{prefix}.{key}": v for key, v in sd.items()}, scale)
            else:
                alpha = rng.choice([rank, rank * 2, max(1, rank // 2), 3])
                pair[slot] = (save_diffusers_lora(path, family, sd, rank=rank, alpha=alpha), scale)
        pairs.append(pair)
    return pairs


def as_request(pair):
    return {slot: spec for slot, spec in pair.items() if spec[0] is not None}


def test_hot_swapped_engine_equals_plain_diffusers(warm, tmp_path):
    family, model_dir, engine = warm
    linears = dict(engine.ceiling.modules)
    base = served(engine, {})
    torch.testing.assert_close(base, reference(engine, model_dir, {}), atol=tolerance(engine), rtol=0)
    writes = {"packed": 0, "per module": 0}
    for i, pair in enumerate(random_pairs(family, model_dir, linears, tmp_path)):
        result = engine.generate(PROMPT, adapters=as_request(pair), num_images=N, num_inference_steps=STEPS,
                                 output_type="latent")
        ours = result.images
        writes["packed"] += result.swap.packed_writes
        writes["per module"] += result.swap.per_module_writes
        theirs = reference(engine, model_dir, pair)
        diff = (ours - theirs).abs().max().item()
        assert diff <= tolerance(engine), f"pair {i}: max |engine - diffusers| = {diff}"
        scales = [scale for source, scale in pair.values() if source is not None]
        if max(scales) > 0.1:
            # The test can fail: the adapters must visibly move the output.
            assert (theirs - base).abs().max().item() > 100 * TOLERANCE, f"pair {i}: adapters had no effect"
    assert engine.recompiles == 0
    # Both ways into a slot were checked: adapters packed for the slots' layout (one copy per
    # buffer) and the sparse ones left per-module (engine/writers/packing.py).
    assert writes["packed"] > 0 and writes["per module"] > 0, writes


def test_same_images_whatever_the_chunking(warm):
    family, model_dir, engine = warm
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9)}
    pack = served(engine, adapters, num_images=5, seed=7)  # chunks 3 + 2
    torch.testing.assert_close(served(engine, adapters, num_images=2, seed=7), pack[:2], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(served(engine, adapters, num_images=1, seed=11), pack[4:5], atol=TOLERANCE, rtol=0)


def slot_snapshot(engine):
    return [t.detach().clone() for s in engine.writer._slots.values() for t in (*s.down.values(), *s.up.values())]


def test_rejections_leave_the_engine_warm_and_unchanged(warm, tmp_path):
    family, model_dir, engine = warm
    good = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.8),
            "style": (model_dir / "adapters" / "style-diffusers", 1.1)}
    served(engine, good)
    before = slot_snapshot(engine)
    linears = dict(engine.ceiling.modules)
    module = sorted(linears)[0]
    in_f, out_f = linears[module]
    fam = family_named(family)
    prefix = fam.denoiser
    hostile = {
        f"{prefix}.{module}.lora_A.weight": torch.full((TARGET_RANK * 2, in_f), float("nan")),
        f"{prefix}.{module}.lora_B.weight": torch.zeros(out_f, TARGET_RANK * 2),
        f"{prefix}.not.a.module.lora_A.weight": torch.zeros(2, 4),
        f"{prefix}.not.a.module.lora_B.weight": torch.zeros(4, 2),
    }
    wrong_shape = {f"{prefix}.{module}.lora_A.weight": torch.zeros(2, in_f + 1),
                   f"{prefix}.{module}.lora_B.weight": torch.zeros(out_f, 2)}

    # A valid identity next to a hostile style: nothing may be swapped, not even the identity.
    with pytest.raises(AdapterRejected) as info:
        engine.generate(PROMPT, adapters={"identity": good["style"], "style": (hostile, 1.0)})
    text = str(info.value)
    assert "exceeds the engine's target rank" in text and "outside the slot ceiling" in text and "NaN" in text
    assert module in text and "not.a.module" in text

    bad_requests = [
        ({"style": (wrong_shape, 1.0)}, AdapterRejected, "shape mismatch"),
        ({"identity": (tmp_path / "nope.safetensors", 1.0)}, AdapterNotFound, "does not exist"),
        ({"face": (good["identity"][0], 1.0)}, InvalidRequest, "unknown slot"),
        ({"identity": (good["identity"][0], float("nan"))}, InvalidRequest, "finite"),
    ]
    for adapters, error, message in bad_requests:
        with pytest.raises(error, match=message):
            engine.generate(PROMPT, adapters=adapters)
    with pytest.raises(InvalidRequest, match="num_images"):
        engine.generate(PROMPT, adapters=good, num_images=0)

    for a, b in zip(before, slot_snapshot(engine)):
        assert torch.equal(a, b), "a rejected request changed slot weights"
    # The next valid request is still exact.
    torch.testing.assert_close(served(engine, good), reference(engine, model_dir, good), atol=tolerance(engine), rtol=0)


def test_each_check_runs_once_per_request_through_the_python_api(warm, monkeypatch):
    """``engine.generate(prompt, adapters=...)`` builds one GenerationRequest: slots checked once,
    each adapter validated once (the writer's bind per chunk checks nothing again), and the images
    equal what ``prepare(GenerationRequest)`` then ``run`` serve."""
    import hotlora.adapters.resolver as resolver_module
    from hotlora.engine.request import AdapterSpec, GenerationRequest

    family, model_dir, engine = warm
    adapters = {"identity": (str(model_dir / "adapters" / "identity-diffusers"), 0.9),
                "style": AdapterSpec(ref=str(model_dir / "adapters" / "style-diffusers"), scale=0.6)}
    calls, validated = [], []
    real, problems = resolver_module.check_slots, engine.resolver._problems
    monkeypatch.setattr(resolver_module, "check_slots", lambda *a: (calls.append(a), real(*a))[1])
    monkeypatch.setattr(engine.resolver, "_problems", lambda a: (validated.append(a.name), problems(a))[1])
    # num_images > batch_size: several chunks, each bound by the writer.
    first = served(engine, adapters, num_images=4, seed=5)
    assert len(calls) == 1 and len(validated) == 2
    request = GenerationRequest(prompt=PROMPT, adapters=adapters, num_images=4, num_inference_steps=STEPS, seed=5,
                                output_type="latent")
    assert torch.equal(engine.run(engine.prepare(request)).images, first)


def live_tensors() -> int:
    """Tensors the garbage collector knows of. The walk touches every object, deprecated module
    attributes too (``torch.distributed.reduce_op`` warns when looked at): not this test's concern."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_swaps_copy_in_place_without_growth(warm):
    family, model_dir, engine = warm
    adapters = [model_dir / "adapters" / n for n in ("identity-diffusers", "style-diffusers", "identity-peft")]
    loaded = [engine.load_adapter(str(p)) for p in adapters]  # converted once, like the RAM cache will
    for adapter in loaded[:2]:  # two packed for the slots, one left per-module: both paths swap in place
        engine.writer.prepare({"identity": Binding(adapter, 1.0)})
        assert engine.writer.packs.get(adapter) is not None
    engine.writer.swap({"identity": Binding(loaded[0], 1.0), "style": Binding(loaded[1], 0.5)})
    # After the first swap: it runs the rank bucket these adapters need, whatever an earlier test of
    # the module left (the last swap below holds the same ranks, so the same bucket's views).
    params_before = [(n, p.data_ptr(), tuple(p.shape)) for n, p in engine.denoiser.named_parameters()]
    gc.collect()
    tensors_before = live_tensors()
    for i in range(200):
        engine.writer.swap({"identity": Binding(loaded[i % 3], 0.1 + (i % 13) / 10),
                           "style": Binding(loaded[(i + 1) % 3], 1.5 - (i % 7) / 10)})
    gc.collect()
    tensors_after = live_tensors()
    assert tensors_after <= tensors_before
    assert [(n, p.data_ptr(), tuple(p.shape)) for n, p in engine.denoiser.named_parameters()] == params_before
    engine.writer.check_intact()


def test_the_base_is_restored_bit_for_bit(warm, tmp_path):
    """After adapters were served, a request without any gives the very same latents as before, and
    every base weight of the denoiser holds the very same bits."""
    family, model_dir, engine = warm
    base = {name: p.detach().clone() for name, p in engine.denoiser.named_parameters() if "lora_" not in name}
    before = served(engine, {}, num_images=2)
    for pair in random_pairs(family, model_dir, dict(engine.ceiling.modules), tmp_path)[:3]:
        served(engine, as_request(pair), num_images=2)
    assert torch.equal(served(engine, {}, num_images=2), before)
    changed = [name for name, p in engine.denoiser.named_parameters() if name in base and not torch.equal(p, base[name])]
    assert not changed and len(base) > 0, changed[:5]
    assert engine.recompiles == 0


def test_the_recompile_guard_is_live(warm):
    """Canary: a shape the warm-up never saw must trip ``error_on_recompile``, so the zero-recompile
    assertions above are real. (The engine itself refuses such a size before running anything:
    tests/integration/test_robustness.py; here the pipeline is called directly.)"""
    family, model_dir, engine = warm
    graphs = graph_count()
    # Two steps: LTX's scheduler (shift_terminal) divides by zero on a one-step schedule.
    if family_named(family).compile_dynamic:
        # Every dimension is dynamic from the first compile (the prompt's length reaches these
        # denoisers): an unseen size is served by the same graphs, which is what this asserts.
        assert torch._dynamo.config.error_on_recompile
        engine.pipeline(prompt=PROMPT, height=engine.height * 2, width=engine.width, num_inference_steps=2,
                        output_type="latent")
        assert graph_count() == graphs
        return
    try:
        engine.pipeline(prompt=PROMPT, height=engine.height * 2, width=engine.width, num_inference_steps=2,
                        output_type="latent")
    except Exception as exc:
        assert "recompil" in str(exc).lower(), exc
    else:
        # Served by graphs dynamic in the token count: the blocks saw two counts at warm-up (SD1.5's
        # U-Net attends at two resolutions), or an earlier engine in this test process compiled the
        # same block classes at two sizes (dynamo keeps a code object's graphs and what it learnt
        # dynamic for the whole process, across engines). The core families' guard must still trip
        # on a state no warm-up ran: one LoRA layer of a compiled block switched off alone.
        if family in CORE_FAMILIES:
            assert_an_unwarmed_state_trips(engine)
    assert graph_count() == graphs  # refused before compiling: nothing was added


def assert_an_unwarmed_state_trips(engine):
    from peft.tuners.lora import LoraLayer

    denoiser = engine.denoiser
    blocks = [m for m in denoiser.modules() if type(m).__name__ in (getattr(denoiser, "_repeated_blocks", None) or ())]
    layer = next(m for block in blocks or [denoiser] for m in block.modules() if isinstance(m, LoraLayer))
    layer._disable_adapters = not layer._disable_adapters
    try:
        with pytest.raises(Exception, match="(?i)recompil"):
            engine.pipeline(prompt=PROMPT, num_inference_steps=2, output_type="latent")
    finally:
        layer._disable_adapters = not layer._disable_adapters


def test_every_guidance_mode_is_warm_and_exact(warm, request):
    """CFG off (guidance 1) and on (the default) both run warm and equal plain diffusers: under
    true CFG the two take different paths through the pipeline (one pass or two) at the same
    denoiser shapes. A family whose pipeline ignores guidance refuses a request that sets it."""
    from hotlora.testing import plain_diffusers_reference

    family, model_dir, engine = warm
    fam = family_named(family)
    allow_cfg_rounding(request, family)
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9)}
    if not fam.takes_guidance:
        with pytest.raises(InvalidRequest, match="guidance_scale"):
            engine.generate(PROMPT, adapters=adapters, guidance_scale=2.0)
        return
    for guidance in sorted({1.0, fam.default_guidance}):
        ours = engine.generate(PROMPT, adapters=adapters, num_images=2, num_inference_steps=STEPS, seed=3,
                               guidance_scale=guidance, output_type="latent").images
        theirs = plain_diffusers_reference(model_dir, adapters, prompt=PROMPT, num_images=2, num_inference_steps=STEPS,
                                           guidance_scale=guidance, height=engine.height, width=engine.width, seed=3)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)


LENGTHS = ["a", "x y", "one two three", "a red house on a hill under a violet sky, oil", " ".join(["astronaut"] * 30)]


def test_prompts_of_every_length_equal_plain_diffusers(warm, request):
    """Prompt lengths the warm-up never ran (Z-Image and Qwen-Image hand each prompt's own length
    to the denoiser; "one two three" is a caption of exactly 32 tokens on the tiny Z-Image), at
    every guidance whose shapes differ: served without compiling and equal to plain diffusers."""
    from hotlora.testing import plain_diffusers_reference

    family, model_dir, engine = warm
    fam = family_named(family)
    allow_cfg_rounding(request, family)
    adapters = {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9)}
    # A pipeline that pads every prompt to one length (one warm-up prompt) is checked at the two
    # extremes and its default guidance; one that hands lengths on, at every length and guidance.
    lengths_reach_the_denoiser = len(fam.warmup_prompts(engine.pipeline)) > 1
    prompts = LENGTHS if lengths_reach_the_denoiser else [LENGTHS[0], LENGTHS[-1]]
    scales = fam.warmup_guidance_scales(engine.defaults["guidance_scale"]) if lengths_reach_the_denoiser else [None]
    for guidance in scales:
        given = {} if guidance is None else {"guidance_scale": guidance}
        for prompt in prompts:
            ours = engine.generate(prompt, adapters=adapters, num_images=2, num_inference_steps=2, output_type="latent",
                                   **given).images
            theirs = plain_diffusers_reference(model_dir, adapters, prompt=prompt, num_images=2, num_inference_steps=2,
                                               guidance_scale=engine.defaults["guidance_scale"] if guidance is None
                                               else guidance, height=engine.height, width=engine.width, seed=0)
            diff = (ours - theirs).abs().max().item()
            assert diff <= TOLERANCE, f"guidance {guidance}, prompt of {len(prompt)} characters: {diff}"
    assert engine.recompiles == 0
