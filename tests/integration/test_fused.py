"""Fused mode (engine/writers/fused.py): the correctness contract with the adapters merged into the
weights. The compiled engine equals a fresh plain diffusers pipeline (``load_lora_weights`` +
``set_adapters``) within float32 noise, for ranks above the slots' target and layers outside a
narrow ``target_modules``, and (SDXL) kohya LoCon conv LoRA on the U-Net's convs, compiles nothing
after warm-up (``error_on_recompile``), and "no adapters" after any sequence of swaps is the base
weights bit for bit, whether the pristine weights are kept on the device or on the host.

CI time is tight: ONE compiled engine per family for the whole file, 2 steps, batch size 2. The 200
random swaps call the writer's ``swap`` directly (a handful of GEMMs and copies each, no forward
pass); every 40th goes through a full compiled request. The host-restore and bf16 checks build
eager engines (no compile)."""

import hashlib
import random

import pytest
import torch

from hotlora import Engine
from hotlora.families import family_named
from hotlora.adapters.binding import Binding
from hotlora.errors import AdapterRejected, InvalidRequest
from hotlora.testing import (
    random_conv_lora,
    random_lora,
    save_diffusers_lora,
    save_peft_lora,
    sd_scripts_metadata,
    sd_scripts_sdxl_lora,
)

from ..helpers import TARGET_RANK, recompiles_are_errors, engine_reference, family_params

TOLERANCE = 1e-4  # float32 latents; compiled kernels reorder sums
PROMPT = "a portrait of an astronaut, watercolor"
STEPS = 2
N = 2  # the compiled batch size: one chunk
SWAPS = 200
THROUGH_THE_ENGINE = 40  # every 40th swap is a full compiled request
# A slots engine with this ceiling would refuse every adapter below that touches anything else.
NARROW = {"flux": r"transformer_blocks\.0\.attn\.to_q", "sdxl": r".*attn1\.to_q", "sd15": r".*attn1\.to_q",
          "sd3": r"transformer_blocks\.0\.attn\.to_q"}


@pytest.fixture(scope="module", params=family_params())
def fused(request, tiny_models):
    family = request.param
    engine = Engine.from_pretrained(tiny_models[family], adapter_mode="fused", target_rank=TARGET_RANK,
                                    target_modules=NARROW.get(family, r".*\.to_q"), batch_size=N, compile=True)
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
    prefix = family_named(family).denoiser
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
    # The family's trainer layout (kohya for Flux and the U-Nets, ai-toolkit for SD3), rank 4.
    kohya = family_named(family).trainer_lora(tmp_path / f"{family}-trainer.safetensors", linears,
                                              random_lora(linears, 4, 3), 4, seed=3)
    if kohya is None:  # a family declaring no trainer layout (the generic ones): diffusers' own
        kohya = save_diffusers_lora(tmp_path / f"{family}-trainer", family, random_lora(linears, 4, 3), rank=4, alpha=6)
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


def random_adapters(engine, family, seed: str, count: int = 6):
    """``count`` in-memory adapters of random rank (up to 3x the slots' target) on random subsets of
    the Linears, and on SDXL of the convs too (conv LoRA: 4-D factors)."""
    linears, convs = dict(engine.ceiling.modules), dict(engine.ceiling.convs)
    names, conv_names = sorted(linears), sorted(convs)
    rng = random.Random(seed)
    prefix = family_named(family).denoiser
    adapters = []
    for k in range(count):
        rank = rng.randint(1, 3 * TARGET_RANK)
        sd = random_lora(linears, rank, k, modules=rng.sample(names, rng.randint(1, len(names))))
        if conv_names and k % 2:
            chosen = rng.sample(conv_names, rng.randint(1, len(conv_names)))
            sd.update(random_conv_lora({n: convs[n] for n in chosen}, rank, 100 + k))
        adapters.append(engine.load_adapter({f"{prefix}.{key}": v for key, v in sd.items()}))
    return adapters


def random_requests(adapters, seed: str, count: int):
    rng = random.Random(seed)
    return [{slot: Binding(rng.choice(adapters), rng.choice([0.0, 0.3, 1.0, -0.7]))
             for slot in ("identity", "style") if rng.random() < 0.8} for _ in range(count)]


def test_random_swaps_then_no_adapters_restore_the_base_bit_for_bit(fused, tmp_path):
    family, model_dir, engine = fused
    generate(engine, {})
    base = weights_hash(engine)
    pointers = [(n, p.data_ptr()) for n, p in engine.denoiser.named_parameters()]
    loaded = random_adapters(engine, family, f"swaps-{family}")
    for i, request in enumerate(random_requests(loaded, f"requests-{family}", SWAPS)):
        if i % THROUGH_THE_ENGINE == 0:  # some of them through a full compiled request
            generate(engine, request, num_images=1, seed=i)
        else:
            engine.writer.swap(request)
        if any(scale for _, scale in request.values()):
            assert weights_hash(engine) != base, f"swap {i} merged nothing"
    engine.writer.swap({})
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
    prefix = family_named(family).denoiser
    a = engine.load_adapter({f"{prefix}.{k}": v for k, v in random_lora(linears, 2, 11).items()})
    with pytest.raises(InvalidRequest, match="cannot carry different adapters"):
        engine.writer.bind([{"identity": Binding(a, 1.0)}, {"identity": Binding(a, 0.5)}])
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


@pytest.mark.parametrize("family", family_params())
def test_bfloat16_fused_weights_equal_diffusers_fuse_lora(tiny_models, tmp_path, family):
    """Eager (the weights are what is compared): hotlora's merge vs diffusers' ``fuse_lora``, both in
    bf16, within one bf16 rounding (diffusers rounds the delta, then the sum; hotlora the sum once).
    On SDXL the first adapter also carries conv LoRA on every Conv2d."""
    from diffusers import DiffusionPipeline

    model_dir = tiny_models[family]
    engine = Engine.from_pretrained(model_dir, adapter_mode="fused", batch_size=1, compile=False, dtype=torch.bfloat16)
    linears, convs = dict(engine.ceiling.modules), dict(engine.ceiling.convs)
    assert bool(convs) == any(isinstance(m, torch.nn.Conv2d) for m in engine.denoiser.modules())  # not Flux
    one = save_diffusers_lora(tmp_path / "one", family, {**random_lora(linears, 24, 1), **random_conv_lora(convs, 24, 3)},
                              rank=24, alpha=12)
    two = save_diffusers_lora(tmp_path / "two", family, random_lora(linears, 4, 2, modules=sorted(linears)[::2]),
                              rank=4, alpha=4)
    layers = [*linears, *convs]
    base = {name: engine.denoiser.get_submodule(name).weight.detach().float().clone() for name in layers}
    loaded = {"identity": Binding(engine.load_adapter(str(one)), 0.7), "style": Binding(engine.load_adapter(str(two)), 1.2)}
    engine.writer.swap(loaded)
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True)
    pipeline.load_lora_weights(str(one), adapter_name="one")
    pipeline.load_lora_weights(str(two), adapter_name="two")
    pipeline.set_adapters(["one", "two"], [0.7, 1.2])
    denoiser = family_named(family).denoiser
    pipeline.fuse_lora(components=[denoiser], adapter_names=["one", "two"])
    theirs = getattr(pipeline, denoiser)
    for name in layers:
        ours = engine.denoiser.get_submodule(name).weight.float()
        ref = theirs.get_submodule(name).base_layer.weight.float()
        exact, magnitude = base[name].double(), base[name].double().abs()
        for adapter, scale in loaded.values():
            if name in adapter.modules:
                w = adapter.modules[name]
                up, down = w.up.double().flatten(1), w.down.double().flatten(1)  # a conv: reshaped below
                exact = exact + scale * w.scaling * (up @ down).view(exact.shape)
                magnitude = magnitude + abs(scale * w.scaling) * (up.abs() @ down.abs()).view(exact.shape)
        # hotlora rounds once: within half a bf16 ulp of the exact sum, plus the float32 GEMM's own
        # rounding (a few float32 ulps of the terms: it shows where W0 and the delta nearly cancel).
        slack = 2.0 ** -8 * exact.abs() * 1.01 + 2.0 ** -16 * magnitude + 2.0 ** -126
        assert ((ours.double() - exact).abs() <= slack).all(), name
        # diffusers also rounds A and B (loaded in bf16: errors summed over the rank) and the delta
        # before the sum: within two bf16 ulps of the layer's largest weight.
        assert (ours - ref).abs().max() <= 2.0 ** -6 * ref.abs().max(), name
        assert not torch.equal(ours, base[name])


def test_host_restore_writes_the_same_bits_as_device_restore(fused):
    """``fused_restore="host"`` (on a CPU: the host path, unpinned) keeps W0 off the device and copies
    it into the touched weights before each merge. After the same 20 random swaps (Linear and, on
    SDXL, conv LoRA) its weights equal the device-restore engine's bit for bit, and "no adapters"
    is the base again."""
    family, model_dir, engine = fused
    host = Engine.from_pretrained(model_dir, adapter_mode="fused", fused_restore="host", target_rank=TARGET_RANK,
                                  batch_size=1, compile=False)
    assert engine.writer.restore == "device"  # "auto" on a CPU: device memory is host memory
    assert host.writer.restore == "host" and host.writer.nbytes == 0 and host.describe()["restore"] == "host"
    assert host.describe()["pristine_bytes"] == engine.describe()["pristine_bytes"] > 0
    engine.writer.swap({})
    base = weights_hash(host)
    assert base == weights_hash(engine)  # the same model: the comparison below is meaningful
    loaded = random_adapters(engine, family, f"host-{family}")
    for i, request in enumerate(random_requests(loaded, f"host-requests-{family}", 20)):
        device_report, host_report = engine.writer.swap(request), host.writer.swap(request)
        assert host_report.modules_written == device_report.modules_written
        assert weights_hash(host) == weights_hash(engine), f"swap {i}: host and device restore differ"
    host.writer.swap({})
    assert weights_hash(host) == base
    host.writer.check_intact()


# ----------------------------------------------------------------------------- conv LoRA (SDXL)


def kohya_locon_sdxl(unet, convs, linears, path, seed=0):
    """A kohya LoCon file as sd-scripts' ``sdxl_train_network.py --network_module networks.lora
    --network_dim 4 --network_alpha 2 --network_args conv_dim=8 conv_alpha=4`` writes one: rank 4 on the
    transformer blocks' Linears and the ResBlocks' ``emb_layers`` (time_emb_proj) and 1x1
    ``skip_connection`` convs, rank 8 (alpha 4) on the 3x3 convs of the ResBlocks, Downsamples and
    Upsamples, all under SGM block names, with sd-scripts' header metadata. Returns (path, module count)."""
    from safetensors.torch import save_file

    wrapped = {n: s for n, s in convs.items() if ".resnets." in n or "samplers." in n}
    spatial = {n: s for n, s in wrapped.items() if s[2:] != (1, 1)}
    pointwise = {n: s for n, s in wrapped.items() if s[2:] == (1, 1)}
    chosen = [n for n in linears if ".attentions." in n or n.endswith("time_emb_proj")]
    sd = {**random_lora(linears, 4, seed, modules=chosen), **random_conv_lora(spatial, 8, seed + 1),
          **random_conv_lora(pointwise, 4, seed + 2)}
    attention_up = {i for i, block in enumerate(unet.up_blocks) if getattr(block, "attentions", None)}
    kohya = sd_scripts_sdxl_lora(sd, unet.config.layers_per_block, alpha=2.0, conv_alpha=4.0,
                                 up_blocks_with_attention=attention_up)
    save_file(kohya, str(path), metadata=sd_scripts_metadata("sdxl_base_v1-0", 4, 2.0,
                                                             {"conv_dim": "8", "conv_alpha": "4"}))
    return path, len(chosen) + len(wrapped)


def test_kohya_locon_conv_lora_on_sdxl_equals_plain_diffusers(fused, tmp_path):
    family, model_dir, engine = fused
    convs = dict(engine.ceiling.convs)
    if family == "flux":
        assert convs == {}  # the Flux transformer has no Conv2d: nothing to merge into
        return
    if family != "sdxl":
        # sd-scripts numbers U-Net blocks the SGM way for SDXL only (its SD1.x files keep diffusers'
        # names, and diffusers' SGM mapping fails on the tiny SD1.5 U-Net); SD3's one conv (the patch
        # embedding) has no kohya LoCon layout.
        return
    linears = dict(engine.ceiling.modules)
    locon, count = kohya_locon_sdxl(engine.denoiser, convs, linears, tmp_path / "locon.safetensors")
    adapter = engine.load_adapter(str(locon))
    assert adapter.layout == "kohya" and len(adapter.modules) == count
    conv_weights = {m: w for m, w in adapter.modules.items() if m in convs}
    assert {w.down.shape[0] for w in conv_weights.values()} == {4, 8} and all(w.down.ndim == 4 for w in conv_weights.values())
    assert any(m.endswith("downsamplers.0.conv") for m in conv_weights) and any(m.endswith("upsamplers.0.conv") for m in conv_weights)
    # Conv LoRA in the diffusers layout too (metadata: LoraConfig), on half of the convs only.
    conv_only = save_diffusers_lora(tmp_path / "conv-only", "sdxl",
                                    random_conv_lora({n: convs[n] for n in sorted(convs)[::2]}, 3, 9), rank=3, alpha=6)
    base = generate(engine, {}).images
    pair = {"identity": (locon, 0.9), "style": (conv_only, 0.7)}
    result = generate(engine, pair)
    diff = (result.images - reference(engine, model_dir, pair)).abs().max().item()
    assert diff <= TOLERANCE, f"max |engine - diffusers| = {diff}"
    assert (result.images - base).abs().max().item() > 100 * TOLERANCE
    assert result.swap.fused["identity"]["modules"] == count and result.recompiles == 0
    # The convs alone move the compiled model's output: conv weights are graph inputs as well.
    alone = generate(engine, {"style": (conv_only, 1.0)}).images
    assert (alone - base).abs().max().item() > 100 * TOLERANCE
    generate(engine, {})
    assert engine.recompiles == 0


@pytest.mark.parametrize("options", [{}, {"mixed": True}], ids=["slots", "banks"])
def test_slots_and_banks_refuse_conv_lora_and_say_why(tiny_models, tmp_path, options):
    """Slots and banks are Linear LoRA layers compiled into the model: a conv LoRA is refused before
    anything is written, with a message that names the layers and the mode that serves them."""
    from hotlora.engine.writers.fused import conv_modules

    engine = Engine.from_pretrained(tiny_models["sdxl"], target_rank=TARGET_RANK, batch_size=1, compile=False, **options)
    assert engine.ceiling.convs == {}
    locon, _ = kohya_locon_sdxl(engine.denoiser, conv_modules(engine.denoiser), dict(engine.ceiling.modules),
                                tmp_path / "locon.safetensors")
    with pytest.raises(AdapterRejected, match=r"conv LoRA on 23 layer\(s\) .*fused mode") as info:
        engine.generate(PROMPT, adapters={"identity": (str(locon), 1.0)}, num_inference_steps=STEPS)
    assert len(info.value.problems) == 1, info.value.problems  # the Linear parts fit; only the convs do not
