"""Fused mode (engine/writers/fused.py): the correctness contract with the adapters merged into the
weights. The compiled engine equals a fresh plain diffusers pipeline (``load_lora_weights`` +
``set_adapters``) within float32 noise, for ranks above the slots' target and layers outside a
narrow ``target_modules``, compiles nothing after warm-up (``error_on_recompile``), and "no
adapters" after any sequence of swaps is the base weights bit for bit.

CI time is tight: ONE compiled engine per family for the whole file, 2 steps, batch size 2, and
30 random swaps for the exactness check (not hundreds: each swap is a handful of copies and GEMMs,
and the property checked, restore-by-copy, does not depend on the count)."""

import hashlib
import random

import pytest
import torch

from hotlora import Engine
from hotlora.errors import AdapterRejected, InvalidRequest
from hotlora.testing import (
    kohya_flux_lora,
    random_lora,
    save_diffusers_lora,
    save_kohya_sdxl_lora,
    save_peft_lora,
)

from ..helpers import TARGET_RANK, recompiles_are_errors, engine_reference

TOLERANCE = 1e-4  # float32 latents; compiled kernels reorder sums
PROMPT = "a portrait of an astronaut, watercolor"
STEPS = 2
N = 2  # the compiled batch size: one chunk
SWAPS = 30
# A slots engine with this ceiling would refuse every adapter below that touches anything else.
NARROW = {"flux": r"transformer_blocks\.0\.attn\.to_q", "sdxl": r".*attn1\.to_q"}


@pytest.fixture(scope="module", params=["flux", "sdxl"])
def fused(request, tiny_models):
    family = request.param
    engine = Engine.from_pretrained(tiny_models[family], adapter_mode="fused", target_rank=TARGET_RANK,
                                    target_modules=NARROW[family], batch_size=N, compile=True)
    with recompiles_are_errors():
        yield family, tiny_models[family], engine
    assert engine.recompiles == 0


def reference(engine, model_dir, adapters, num_images=N, seed=0):
    return engine_reference(engine, model_dir, adapters, prompt=PROMPT, steps=STEPS, num_images=num_images, seed=seed)


def generate(engine, adapters, num_images=N, seed=0):
    return engine.generate(PROMPT, adapters=adapters, num_images=num_images, num_inference_steps=STEPS, seed=seed,
                           output_type="latent")


def weights_hash(engine) -> str:
    digest = hashlib.sha256()
    for name, p in engine.denoiser.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def pairs(family, linears, tmp_path):
    """Four requests: a rank of 2x the slots' target on every layer next to a PEFT-layout adapter on
    layers outside the narrow ceiling; a kohya adapter next to a scale-0 one; one slot empty; an
    in-memory state dict of rank 2x target + 3."""
    names = sorted(linears)
    rng = random.Random(f"fused-{family}")
    outside = [n for n in names if "to_q" not in n]
    prefix = "transformer" if family == "flux" else "unet"
    big = 2 * TARGET_RANK
    out = []
    sd = random_lora(linears, big, 1)
    peft_sd = random_lora(linears, 3, 2, modules=rng.sample(outside, 12))
    peft = save_peft_lora(tmp_path / f"{family}-peft", peft_sd, rank=3, alpha=6)
    # diffusers' loader misreads a PEFT ``base_model.model.*`` file as another layout: the reference
    # loads the same weights and alpha saved the diffusers way.
    peft_as_diffusers = save_diffusers_lora(tmp_path / f"{family}-peft-ref", family, peft_sd, rank=3, alpha=6)
    out.append({"identity": (save_diffusers_lora(tmp_path / f"{family}-big", family, sd, rank=big, alpha=big / 2), 0.8),
                "style": (peft, 1.3)})
    references = {peft: peft_as_diffusers}
    if family == "flux":
        from safetensors.torch import save_file

        blocks = sum(1 for n in names if n.endswith("attn.to_out.0") and n.startswith("transformer_blocks"))
        kohya = tmp_path / "flux-kohya.safetensors"
        save_file(kohya_flux_lora(linears, blocks, 4, alpha=6.0, seed=3), str(kohya))
    else:
        attention = {k: v for k, v in random_lora(linears, 4, 3).items() if ".attn" in k}
        kohya = save_kohya_sdxl_lora(tmp_path / "sdxl-kohya.safetensors", attention, alpha=2.0)
    zero = save_diffusers_lora(tmp_path / f"{family}-zero", family, random_lora(linears, 2, 4), rank=2, alpha=2)
    out.append({"identity": (kohya, 1.1), "style": (zero, 0.0)})
    subset = save_diffusers_lora(tmp_path / f"{family}-subset", family,
                                 random_lora(linears, 5, 5, modules=rng.sample(names, len(names) // 2)), rank=5, alpha=3)
    out.append({"identity": (subset, 1.0)})
    memory = {f"{prefix}.{k}": v for k, v in random_lora(linears, big + 3, 6).items()}
    one = save_diffusers_lora(tmp_path / f"{family}-one", family, random_lora(linears, 1, 7), rank=1, alpha=1)
    out.append({"identity": (memory, 0.6), "style": (one, 1.5)})
    return [(pair, {slot: (references.get(source, source), scale) if not isinstance(source, dict) else (source, scale)
                    for slot, (source, scale) in pair.items()}) for pair in out]


def test_fused_engine_equals_plain_diffusers(fused, tmp_path):
    family, model_dir, engine = fused
    linears = dict(engine.ceiling.modules)
    assert len(linears) > 1 and engine.ceiling.any_rank  # every Linear, whatever target_modules said
    assert engine.describe()["writer"] == "fused" and engine.describe()["one_adapter_set_per_batch"]
    assert engine.describe()["pristine_bytes"] > 0 and not engine.writer.mixes_requests
    base = generate(engine, {}).images
    torch.testing.assert_close(base, reference(engine, model_dir, {}), atol=TOLERANCE, rtol=0)
    for i, (pair, reference_pair) in enumerate(pairs(family, linears, tmp_path)):
        result = generate(engine, pair)
        theirs = reference(engine, model_dir, reference_pair)
        diff = (result.images - theirs).abs().max().item()
        assert diff <= TOLERANCE, f"pair {i}: max |engine - diffusers| = {diff}"
        # The swap changed what the compiled graph computes (weights are graph inputs, not constants).
        assert (result.images - base).abs().max().item() > 100 * TOLERANCE, f"pair {i}: adapters had no effect"
        assert result.recompiles == 0
        served = {slot: info for slot, info in result.swap.fused.items()}
        for slot, (source, scale) in pair.items():
            if scale == 0.0:
                assert slot not in served  # nothing merged for scale 0
            else:
                assert served[slot]["modules"] >= 1 and served[slot]["rank"] == result.adapters[slot]["rank"]
    assert max(info["rank"] for info in result.swap.fused.values()) > TARGET_RANK
    # The same adapters and scales again: nothing is written.
    again = generate(engine, pair)
    assert again.swap.bytes_copied == 0 and again.swap.modules_written == 0
    torch.testing.assert_close(again.images, result.images, atol=0, rtol=0)


def test_random_swaps_then_no_adapters_restore_the_base_bit_for_bit(fused, tmp_path):
    family, model_dir, engine = fused
    generate(engine, {})
    base = weights_hash(engine)
    pointers = [(n, p.data_ptr()) for n, p in engine.denoiser.named_parameters()]
    linears = dict(engine.ceiling.modules)
    names = sorted(linears)
    rng = random.Random(f"swaps-{family}")
    prefix = "transformer" if family == "flux" else "unet"
    loaded = [engine.load_adapter({f"{prefix}.{k}": v for k, v in
                                   random_lora(linears, rng.randint(1, 3 * TARGET_RANK), k_seed,
                                               modules=rng.sample(names, rng.randint(1, len(names)))).items()})
              for k_seed in range(6)]
    for i in range(SWAPS):
        request = {slot: (rng.choice(loaded), rng.choice([0.0, 0.3, 1.0, -0.7]))
                   for slot in ("identity", "style") if rng.random() < 0.8}
        if i % 10 == 0:  # some of them through a full compiled request
            generate(engine, request, num_images=1, seed=i)
        else:
            engine.writer.bind([request])
        if any(scale for _, scale in request.values()):
            assert weights_hash(engine) != base or i == 0
    engine.writer.bind([{}])
    assert weights_hash(engine) == base
    generate(engine, {"identity": (loaded[0], 1.0)})
    generate(engine, {})  # "no adapters" through the engine
    assert weights_hash(engine) == base
    assert [(n, p.data_ptr()) for n, p in engine.denoiser.named_parameters()] == pointers
    engine.writer.check_intact()
    assert engine.recompiles == 0


def test_one_adapter_set_per_forward_batch_and_validation_still_applies(fused, tmp_path):
    family, model_dir, engine = fused
    linears = dict(engine.ceiling.modules)
    module = sorted(linears)[0]
    in_f, out_f = linears[module]
    prefix = "transformer" if family == "flux" else "unet"
    a = engine.load_adapter({f"{prefix}.{k}": v for k, v in random_lora(linears, 2, 11).items()})
    with pytest.raises(InvalidRequest, match="cannot carry different adapters"):
        engine.writer.bind([{"identity": (a, 1.0)}, {"identity": (a, 0.5)}])
    generate(engine, {})
    before = weights_hash(engine)
    bad = [
        ({f"{prefix}.{module}.lora_A.weight": torch.full((3, in_f), float("nan")),
          f"{prefix}.{module}.lora_B.weight": torch.zeros(out_f, 3)}, "NaN"),
        ({f"{prefix}.{module}.lora_A.weight": torch.zeros(2, in_f + 1),
          f"{prefix}.{module}.lora_B.weight": torch.zeros(out_f, 2)}, "shape mismatch"),
        ({f"{prefix}.not.a.module.lora_A.weight": torch.zeros(2, 4),
          f"{prefix}.not.a.module.lora_B.weight": torch.zeros(4, 2)}, "outside"),
        ({f"{prefix}.{module}.lora_A.weight": torch.full((2, in_f), 1e18),
          f"{prefix}.{module}.lora_B.weight": torch.full((out_f, 2), 1e18)}, "too large"),
    ]
    for sd, message in bad:
        with pytest.raises(AdapterRejected, match=message):
            engine.generate(PROMPT, adapters={"identity": ({**sd}, 1.0), "style": (a, 1.0)}, num_inference_steps=STEPS)
    assert weights_hash(engine) == before  # nothing was merged for a rejected request


def test_freezing_would_bake_the_weights_in_and_is_refused(fused):
    family, model_dir, engine = fused
    import torch._inductor.config as inductor

    assert not inductor.freezing
    with inductor.patch(freezing=True), pytest.raises(RuntimeError, match="freezing"):
        engine.writer.enter("fused")


def test_bfloat16_fused_weights_equal_diffusers_fuse_lora(tiny_models, tmp_path):
    """Eager (the weights are what is compared): hotlora's merge vs diffusers' ``fuse_lora``, both in
    bf16, within one bf16 rounding (diffusers rounds the delta, then the sum; hotlora the sum once)."""
    from diffusers import DiffusionPipeline

    model_dir = tiny_models["flux"]
    engine = Engine.from_pretrained(model_dir, adapter_mode="fused", batch_size=1, compile=False, dtype=torch.bfloat16)
    linears = dict(engine.ceiling.modules)
    one = save_diffusers_lora(tmp_path / "one", "flux", random_lora(linears, 24, 1), rank=24, alpha=12)
    two = save_diffusers_lora(tmp_path / "two", "flux", random_lora(linears, 4, 2, modules=sorted(linears)[::2]),
                              rank=4, alpha=4)
    base = {name: engine.denoiser.get_submodule(name).weight.detach().float().clone() for name in linears}
    loaded = {"identity": (engine.load_adapter(str(one)), 0.7), "style": (engine.load_adapter(str(two)), 1.2)}
    engine.writer.swap(loaded)
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir), torch_dtype=torch.bfloat16, local_files_only=True)
    pipeline.load_lora_weights(str(one), adapter_name="one")
    pipeline.load_lora_weights(str(two), adapter_name="two")
    pipeline.set_adapters(["one", "two"], [0.7, 1.2])
    pipeline.fuse_lora(components=["transformer"], adapter_names=["one", "two"])
    theirs = pipeline.transformer
    for name in linears:
        ours = engine.denoiser.get_submodule(name).weight.float()
        ref = theirs.get_submodule(name).base_layer.weight.float()
        exact = base[name].clone()
        for adapter, scale in loaded.values():
            if name in adapter.modules:
                w = adapter.modules[name]
                exact += scale * w.scaling * (w.up.double() @ w.down.double()).float()
        # hotlora rounds once: within half a bf16 ulp of the exact sum (float32 sums reorder a little).
        assert ((ours - exact).abs() <= 2.0 ** -8 * exact.abs() * 1.01 + 2.0 ** -126).all(), name
        # diffusers also rounds A and B (loaded in bf16: errors summed over the rank) and the delta
        # before the sum: within two bf16 ulps of the layer's largest weight.
        assert (ours - ref).abs().max() <= 2.0 ** -6 * ref.abs().max(), name
        assert not torch.equal(ours, base[name])
