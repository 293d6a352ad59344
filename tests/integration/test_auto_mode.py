"""Auto mode (engine/writers/auto.py): each request fused when its merge keeps its adapters' effect
(``fused_kept >= fused_min_kept``), else through the slots, in one warm engine.

- bf16, eager, every family: a strong adapter (delta RMS 3% of the weights') is served fused and
  a weak one (0.1%, which a bf16 merge would cut to ~60% of its effect) through the slots; each
  path's latents equal, bit for bit, what the engine of that mode alone gives (an empty slot adds
  exactly zero; restored weights are the base bit for bit), and each is as close to the float32
  reference as plain diffusers' bf16 pipeline doing the same (unfused for the slots, ``fuse_lora``
  for the merge).
- float32, compiled, both families: strong and weak requests alternate with requests without
  adapters, each within 1e-4 of plain diffusers, with zero recompiles (``error_on_recompile``);
  in float32 a merge keeps everything, so the weak adapter is a feather (delta RMS 1e-9 of the
  weights', under half a float32 step). A batch of two requests with the same adapters is one
  forward batch; two requests with different adapters are refused before anything is written.
"""

import pytest
import torch

from hotlora import Engine
from hotlora.families import family_named
from hotlora.errors import InvalidRequest
from hotlora.testing import controlled_lora, random_lora, save_diffusers_lora

from ..helpers import (
    TARGET_RANK, engine_reference, family_params, pipeline_output, recompiles_are_errors, tiny_latent_call,
)

RANK = 16
STEPS = 2
PROMPT = "a portrait"
TOLERANCE = 1e-4  # float32 latents; compiled kernels reorder sums


def latents(engine, family, path=None):
    adapters = {"identity": (str(path), 1.0)} if path is not None else {}
    result = engine.generate(PROMPT, adapters=adapters, num_images=1, seed=0, **tiny_latent_call(family, STEPS)[0])
    return torch.as_tensor(result.images).float().reshape(1, -1), result


def effect(out, base, ref, ref_base):
    """(share of the reference's effect kept, error relative to that effect)."""
    wanted, got = (ref - ref_base).flatten().double(), (out - base).flatten().double()
    return float(got @ wanted / (wanted @ wanted)), float((got - wanted).norm() / wanted.norm())


@pytest.mark.parametrize("family", family_params())
def test_bf16_strong_adapter_fused_weak_adapter_through_slots(tiny_models, tmp_path, family):
    from diffusers import DiffusionPipeline

    model_dir = tiny_models[family]
    pipelines = {dtype: DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
                 for dtype in (torch.float32, torch.bfloat16)}
    denoiser = getattr(pipelines[torch.float32], family_named(family).denoiser)
    paths = {m: save_diffusers_lora(tmp_path / f"m{m}", family, controlled_lora(denoiser, m, rank=RANK, seed=7),
                                    rank=RANK, alpha=RANK) for m in (0.001, 0.03)}
    options = {"target_rank": RANK, "batch_size": 1, "compile": False, "dtype": torch.bfloat16}
    engines = {mode: Engine.from_pretrained(model_dir, adapter_mode=mode, fused_min_kept=0.0 if mode == "fused" else 0.98,
                                            **options) for mode in ("auto", "fused", "slots")}
    auto = engines["auto"]
    assert auto.describe()["writer"] == "auto" and auto.describe()["pristine_bytes"] > 0

    def reference(pipeline, path=None, fuse=False):
        if fuse:  # a bf16 unfuse does not give the weights back: a fresh pipeline for each merge
            pipeline = DiffusionPipeline.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True)
            pipeline.set_progress_bar_config(disable=True)
        if path is not None:
            pipeline.load_lora_weights(str(path), adapter_name="a")
            if fuse:
                pipeline.fuse_lora(components=[family_named(family).denoiser], adapter_names=["a"])
        out = pipeline(prompt=PROMPT, generator=[torch.Generator().manual_seed(0)], **tiny_latent_call(family, STEPS)[1])
        if path is not None and not fuse:
            pipeline.unload_lora_weights()
        return pipeline_output(out).float().reshape(1, -1)

    for pipeline in pipelines.values():
        pipeline.set_progress_bar_config(disable=True)
    base32, base16 = (reference(p) for p in pipelines.values())
    ours_base = latents(auto, family)[0]
    # weak, strong, weak: each path entered from the other one
    for magnitude, path in [(0.001, paths[0.001]), (0.03, paths[0.03]), (0.001, paths[0.001])]:
        out, result = latents(auto, family, path)
        entry = result.adapters["identity"]
        expected = "slots" if magnitude == 0.001 else "fused"
        assert entry["mode"] == expected, (magnitude, entry)
        assert (entry["fused_kept"] < 0.98) == (expected == "slots"), entry  # what the merge keeps (would keep)
        # Exact: the mode's own engine, bit for bit.
        alone, alone_result = latents(engines[expected], family, path)
        assert torch.equal(out, alone), (magnitude, (out - alone).abs().max())
        assert alone_result.adapters["identity"]["mode"] == expected
        # Against plain diffusers doing the same arithmetic in bf16: its unfused pipeline for the
        # slots, its ``fuse_lora`` for a merge (a bf16 merge rounds the weights, not the branch: at
        # a tiny model's noise the two differ by more than either differs from itself).
        ref = reference(pipelines[torch.float32], path)
        theirs = reference(pipelines[torch.bfloat16], path, fuse=expected == "fused")
        kept, error = effect(out, ours_base, ref, base32)
        their_kept, their_error = effect(theirs, base16, ref, base32)
        print(f"\n{family} {magnitude:.1%} auto ({expected}): effect kept {kept:.3f} / relative error {error:.3f}; "
              f"diffusers bf16 {'fused' if expected == 'fused' else 'unfused'} {their_kept:.3f} / {their_error:.3f}; "
              f"merge keeps {entry['fused_kept']:.4f}")
        assert error <= their_error * 1.1 + 2e-3, (magnitude, error, their_error)
        # The share kept is a projection on the wanted effect: it means something only where the
        # effect stands above bf16's noise (diffusers' own error below it); on some tiny models a
        # 0.1% adapter is all noise (its "share" 2.7 with an error of 97, for diffusers too).
        if their_error < 1:
            assert kept >= their_kept - 0.02, (magnitude, kept, their_kept)
    # The weak adapter, fused as fused mode would serve it, loses its effect: what auto avoided.
    lost = effect(latents(engines["fused"], family, paths[0.001])[0], ours_base, reference(pipelines[torch.float32],
                  paths[0.001]), base32)[0]
    print(f"{family} 0.1% fused anyway: effect kept {lost:.3f}")
    assert auto.describe()["batches"] == {"fused": 1, "slots": 2}


@pytest.fixture(scope="module", params=family_params())
def compiled_auto(request, tiny_models, tmp_path_factory):
    family = request.param
    engine = Engine.from_pretrained(tiny_models[family], adapter_mode="auto", target_rank=TARGET_RANK, batch_size=2,
                                    compile=True)
    tmp = tmp_path_factory.mktemp(f"auto-{family}")
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(tiny_models[family]), local_files_only=True)
    denoiser = getattr(pipeline, family_named(family).denoiser)
    linears = dict(engine.ceiling.modules)
    adapters = {
        "strong": save_diffusers_lora(tmp / "strong", family, random_lora(linears, TARGET_RANK, 1), rank=TARGET_RANK,
                                      alpha=TARGET_RANK / 2),
        "other": save_diffusers_lora(tmp / "other", family, random_lora(linears, 3, 2), rank=3, alpha=3),
        # under half a float32 step of its weights: a float32 merge keeps ~none of it
        "feather": save_diffusers_lora(tmp / "feather", family, controlled_lora(denoiser, 1e-9, rank=4, seed=3),
                                       rank=4, alpha=4),
    }
    with recompiles_are_errors():
        yield family, tiny_models[family], engine, adapters
    assert engine.recompiles == 0


def run_compiled(engine, adapters, num_images=2, seed=0):
    return engine.generate(PROMPT, adapters=adapters, num_images=num_images, num_inference_steps=STEPS, seed=seed,
                           output_type="latent")


def test_float32_compiled_alternating_paths_equal_diffusers_without_recompiling(compiled_auto):
    _family, model_dir, engine, a = compiled_auto
    requests = [
        ("fused", {"identity": (a["strong"], 0.8), "style": (a["other"], 1.2)}),
        ("slots", {"identity": (a["feather"], 1.0)}),
        (None, {}),
        ("fused", {"style": (a["strong"], 1.1)}),
        ("slots", {"style": (a["feather"], 0.5)}),
        ("fused", {"identity": (a["strong"], 0.8), "style": (a["other"], 1.2)}),
    ]
    references = {}
    for expected, adapters in requests:
        key = repr(sorted((slot, str(src), scale) for slot, (src, scale) in adapters.items()))
        if key not in references:
            references[key] = engine_reference(engine, model_dir, adapters, prompt=PROMPT, steps=STEPS, num_images=2)
        result = run_compiled(engine, adapters)
        diff = (result.images - references[key]).abs().max().item()
        assert diff <= TOLERANCE, (expected, adapters, diff)
        assert result.recompiles == 0
        assert {entry["mode"] for entry in result.adapters.values()} == ({expected} if expected else set())
    assert engine.describe()["batches"] == {"fused": 3, "slots": 2}


def test_a_batch_of_requests_shares_one_adapter_set(compiled_auto):
    _family, model_dir, engine, a = compiled_auto
    strong = {"identity": (a["strong"], 0.8)}
    together = engine.run([engine.prepare(PROMPT, adapters=strong, num_images=1, num_inference_steps=STEPS, seed=s,
                                          output_type="latent") for s in (0, 1)])
    for seed, result in zip((0, 1), together):
        theirs = engine_reference(engine, model_dir, strong, prompt=PROMPT, steps=STEPS, num_images=1, seed=seed)
        assert (result.images - theirs).abs().max().item() <= TOLERANCE
        assert result.adapters["identity"]["mode"] == "fused"
    # Different adapters (here: different paths) in one forward batch: refused before any write.
    weak = {"identity": (a["feather"], 1.0)}
    with pytest.raises(InvalidRequest, match="one request's adapters at a time"):
        engine.run([engine.prepare(PROMPT, adapters=adapters, num_images=1, num_inference_steps=STEPS,
                                   output_type="latent") for adapters in (strong, weak)])
    after = run_compiled(engine, weak)
    theirs = engine_reference(engine, model_dir, weak, prompt=PROMPT, steps=STEPS, num_images=2)
    assert (after.images - theirs).abs().max().item() <= TOLERANCE
    assert after.adapters["identity"]["mode"] == "slots" and engine.recompiles == 0
