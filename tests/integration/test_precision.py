"""The bf16 precision contract (docs/benchmarks.md, "Precision: what bf16 keeps of an adapter").

Adapters of controlled strength (delta RMS 0.1%, 0.3%, 1% and 3% of each layer's weight RMS, every
Linear, rank 16) against a float32 unfused diffusers reference:

- **slots** (LoRA branches beside the bf16 weights) lose nothing a bf16 model does not already
  lose: the engine's distance to the float32 reference is plain diffusers' bf16 *unfused*
  pipeline's, and so is the share of the adapter's effect it keeps;
- **fused** mode measures, per request, the fraction of the intended weight delta its bf16 merge
  carries (``fused_kept``, checked here against the weights themselves), reports it, and refuses
  a request below ``fused_min_kept`` before anything is written. In float32 the merge keeps it all.

Eager engines (what is compared is arithmetic, not graphs), 2 steps, one image: a few seconds per
family. The figures are printed (run with ``-s``), not asserted as targets beyond the contract.
"""

import hashlib

import pytest
import torch

from hotlora import Engine
from hotlora.families import family_named
from hotlora.errors import AdapterRejected
from hotlora.testing import controlled_lora, save_diffusers_lora

from ..helpers import PackRequest, bank_layouts, family_params, generate_batch, pipeline_output, tiny_latent_call

RANK = 16
MAGNITUDES = (0.001, 0.003, 0.01, 0.03)
STEPS = 2
PROMPT = "a portrait"


@pytest.fixture(scope="module", params=family_params())
def adapters(request, tiny_models, tmp_path_factory):
    """(family, model dir, {magnitude: (path, PEFT state dict)})."""
    from diffusers import DiffusionPipeline

    family = request.param
    tmp = tmp_path_factory.mktemp(f"precision-{family}")
    pipeline = DiffusionPipeline.from_pretrained(str(tiny_models[family]), local_files_only=True)
    denoiser = getattr(pipeline, family_named(family).denoiser)
    made = {}
    for magnitude in MAGNITUDES:
        sd = controlled_lora(denoiser, magnitude, rank=RANK, seed=7)
        made[magnitude] = (save_diffusers_lora(tmp / f"m{magnitude}", family, sd, rank=RANK, alpha=RANK), sd)
    return family, tiny_models[family], made


def engine_latents(engine, family, path=None):
    adapters = {"identity": (str(path), 1.0)} if path is not None else {}
    result = engine.generate(PROMPT, adapters=adapters, num_images=1, seed=0, **tiny_latent_call(family, STEPS)[0])
    return torch.as_tensor(result.images).float().reshape(1, -1), result


def pipeline_latents(pipeline, family):
    generator = [torch.Generator().manual_seed(0)]
    out = pipeline(prompt=PROMPT, generator=generator, **tiny_latent_call(family, STEPS)[1])
    return pipeline_output(out).float().reshape(1, -1)


def effect(out, base, ref, ref_base):
    """(share of the reference's effect kept, error relative to that effect)."""
    wanted, got = (ref - ref_base).flatten().double(), (out - base).flatten().double()
    return float(got @ wanted / (wanted @ wanted)), float((got - wanted).norm() / wanted.norm())


def reference_pipelines(model_dir) -> dict:
    """Plain diffusers in float32 (the reference) and in bf16 (what a bf16 model keeps), by dtype."""
    from diffusers import DiffusionPipeline

    pipelines = {dtype: DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
                 for dtype in (torch.float32, torch.bfloat16)}
    for pipeline in pipelines.values():
        pipeline.set_progress_bar_config(disable=True)
    return pipelines


def diffusers_effect(pipelines, family, path, base32, base16, scale=1.0):
    """(the float32 reference's latents with the adapter at ``path``, diffusers' bf16 unfused ``effect``
    against it), each pipeline loading it unfused at ``scale`` and unloading it after."""
    outs = {}
    for dtype, pipeline in pipelines.items():
        pipeline.load_lora_weights(str(path), adapter_name="a")
        pipeline.set_adapters(["a"], [scale])
        outs[dtype] = pipeline_latents(pipeline, family)
        pipeline.unload_lora_weights()
    ref = outs[torch.float32]
    return ref, effect(outs[torch.bfloat16], base16, ref, base32)


def assert_keeps_what_diffusers_keeps(ours, theirs, label) -> None:
    assert ours[1] <= theirs[1] * 1.05 + 1e-3, (label, ours, theirs)
    assert ours[0] >= theirs[0] - 0.02, (label, ours, theirs)


def test_slots_in_bf16_keep_what_plain_diffusers_unfused_keeps(adapters):
    family, model_dir, made = adapters
    pipelines = reference_pipelines(model_dir)
    slots = Engine.from_pretrained(model_dir, target_rank=RANK, batch_size=1, compile=False, dtype=torch.bfloat16)
    base32, base16 = (pipeline_latents(p, family) for p in pipelines.values())
    ours_base, _ = engine_latents(slots, family)
    print(f"\n{family}: bf16 noise floor |bf16 base - float32 base| / |float32 base| = "
          f"{float((base16 - base32).norm() / base32.norm()):.4f}")
    for magnitude, (path, _) in made.items():
        ref, theirs = diffusers_effect(pipelines, family, path, base32, base16)
        ours = effect(engine_latents(slots, family, path)[0], ours_base, ref, base32)
        print(f"{family} {magnitude:.1%}: effect kept / relative error: diffusers bf16 unfused "
              f"{theirs[0]:.3f} / {theirs[1]:.3f}, hotlora slots bf16 {ours[0]:.3f} / {ours[1]:.3f}")
        assert_keeps_what_diffusers_keeps(ours, theirs, magnitude)


def test_lora_biases_in_bf16_keep_what_plain_diffusers_unfused_keeps(tiny_models):
    """The LoRA-bias path (Wan's slots hold lightx2v's ``.diff_b`` as ``lora_B`` biases) in bf16:
    as close to the float32 reference as plain diffusers' bf16 unfused pipeline, keeping as much of
    the effect, for the bundled lightx2v sample (a bias on every block Linear) at scales 1 and 0.6."""
    import json

    model_dir = tiny_models["wan"]
    folder = model_dir / "adapters"
    path = folder / json.loads((folder / "README.json").read_text())["style-lightx2v"]
    pipelines = reference_pipelines(model_dir)
    slots = Engine.from_pretrained(model_dir, target_rank=RANK, batch_size=1, compile=False, dtype=torch.bfloat16)
    assert slots.describe()["lora_biases"] is True
    base32, base16 = (pipeline_latents(p, "wan") for p in pipelines.values())
    ours_base, _ = engine_latents(slots, "wan")
    for scale in (1.0, 0.6):
        ref, theirs = diffusers_effect(pipelines, "wan", path, base32, base16, scale)
        assert (ref - base32).norm() > 10 * (base16 - base32).norm()  # the adapter moves more than bf16 does
        result = slots.generate(PROMPT, adapters={"style": (str(path), scale)}, num_images=1, seed=0,
                                **tiny_latent_call("wan", STEPS)[0])
        ours = effect(torch.as_tensor(result.images).float().reshape(1, -1), ours_base, ref, base32)
        print(f"\nwan lightx2v (biases) at {scale}: effect kept / relative error: diffusers bf16 unfused "
              f"{theirs[0]:.4f} / {theirs[1]:.4f}, hotlora slots bf16 {ours[0]:.4f} / {ours[1]:.4f}")
        assert_keeps_what_diffusers_keeps(ours, theirs, scale)


@pytest.mark.parametrize("family", bank_layouts())
def test_mixed_banks_in_bf16_keep_what_plain_diffusers_unfused_keeps(family, tiny_models, tmp_path):
    """Two requests with adapters of different strength (every Linear, packed and sequence-first
    layers included) in one bf16 forward batch of the banks writer: each as close to its float32
    reference, and keeping as much of its adapter's effect, as plain diffusers' bf16 unfused pipeline."""
    model_dir = tiny_models[family]
    pipelines = reference_pipelines(model_dir)
    denoiser = getattr(pipelines[torch.float32], family_named(family).denoiser)
    magnitudes = (0.01, 0.03)
    paths = [save_diffusers_lora(tmp_path / f"m{m}", family, controlled_lora(denoiser, m, rank=RANK, seed=7 + i),
                                 rank=RANK, alpha=RANK) for i, m in enumerate(magnitudes)]
    banks = Engine.from_pretrained(model_dir, target_rank=RANK, batch_size=2, compile=False, dtype=torch.bfloat16,
                                   mixed=True)
    base32, base16 = (pipeline_latents(p, family) for p in pipelines.values())
    ours_base, _ = engine_latents(banks, family)
    results = generate_batch(banks, [PackRequest(PROMPT, {"identity": (str(paths[0]), 1.0)}, seed=0),
                                     PackRequest(PROMPT, {"style": (str(paths[1]), 1.0)}, seed=0)],
                             **tiny_latent_call(family, STEPS)[0])
    assert banks.describe()["mixed"]
    for magnitude, path, result in zip(magnitudes, paths, results):
        ref, theirs = diffusers_effect(pipelines, family, path, base32, base16)
        ours = effect(torch.as_tensor(result.images).float().reshape(1, -1), ours_base, ref, base32)
        print(f"\n{family} {magnitude:.0%} in a mixed batch: effect kept / relative error: diffusers bf16 unfused "
              f"{theirs[0]:.3f} / {theirs[1]:.3f}, hotlora banks bf16 {ours[0]:.3f} / {ours[1]:.3f}")
        assert_keeps_what_diffusers_keeps(ours, theirs, magnitude)


def weights_of(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in engine.writer._params.items()}


def digest(engine) -> str:
    h = hashlib.sha256()
    for name, p in sorted(engine.writer._params.items()):
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def kept_in_weights(before, after, sd) -> float:
    """The same fraction, measured independently: from the weights as they are after the swap
    and the file's own factors (alpha = rank: the delta is B @ A), in float64."""
    carried = total = 0.0
    for name in before:
        if f"{name}.lora_A.weight" not in sd:
            continue
        delta = sd[f"{name}.lora_B.weight"].double() @ sd[f"{name}.lora_A.weight"].double()
        carried += float(((after[name].double() - before[name].double()) * delta).sum())
        total += float((delta * delta).sum())
    return carried / total


def test_fused_mode_reports_what_its_merge_keeps_and_refuses_below_the_floor(adapters):
    family, model_dir, made = adapters
    options = {"adapter_mode": "fused", "batch_size": 1, "compile": False, "target_rank": RANK}
    strict = Engine.from_pretrained(model_dir, dtype=torch.bfloat16, **options)  # fused_min_kept 0.98
    lenient = Engine.from_pretrained(model_dir, dtype=torch.bfloat16, fused_min_kept=0.0, **options)
    exact = Engine.from_pretrained(model_dir, dtype=torch.float32, **options)
    weak_path, weak_sd = made[0.001]

    untouched = digest(strict)
    with pytest.raises(AdapterRejected, match=r"keep \d+\.\d% of its weight delta"):
        engine_latents(strict, family, weak_path)
    assert digest(strict) == untouched  # refused before anything was written

    before = weights_of(lenient)
    _, result = engine_latents(lenient, family, weak_path)
    reported = result.adapters["identity"]["fused_kept"]
    measured = kept_in_weights(before, weights_of(lenient), weak_sd)
    print(f"\n{family}: a 0.1% adapter merged into bf16 weights keeps {reported:.3f} of its delta "
          f"(measured in the weights: {measured:.3f})")
    assert reported == pytest.approx(measured, abs=2e-3)
    assert reported < 0.9  # the loss is real, and reported rather than hidden

    for magnitude, (path, _) in made.items():
        kept = engine_latents(lenient, family, path)[1].adapters["identity"]["fused_kept"]
        print(f"{family} {magnitude:.1%}: fused bf16 merge keeps {kept:.4f}")
    _, strong = engine_latents(strict, family, made[0.03][0])
    assert strong.adapters["identity"]["fused_kept"] >= 0.98  # served fused: nothing worth refusing
    _, full = engine_latents(exact, family, weak_path)
    assert full.adapters["identity"]["fused_kept"] > 0.9999  # float32 keeps it all
