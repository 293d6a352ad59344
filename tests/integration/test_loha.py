"""LyCORIS LoHa files served equal to plain diffusers running PEFT's LoHa layers (diffusers itself
reads no LoHa): through the slots when the exact low-rank form (rank r x r) fits the target rank,
in fused and auto modes at any rank, the slots' refusal of a larger one naming fused mode.

Two key forms: SDXL as kohya sd-scripts with LyCORIS writes it (``lora_unet_`` + the U-Net's SGM
block numbers, ``hada_w1_a`` ... and an ``.alpha`` per module), read through diffusers' kohya
converter; Flux with diffusers' dotted module names and no alpha (scale 1).
"""

import copy

import pytest
import torch
from safetensors.torch import save_file

from hotlora import Engine
from hotlora.errors import AdapterFormatError, AdapterRejected
from hotlora.testing import plain_diffusers_reference
from hotlora.trainer_layouts import sd_scripts_sdxl_lora

from ..helpers import TARGET_RANK

TOLERANCE = 1e-4
STEPS = 2
MODULES = {
    "sdxl": ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
             "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k",
             "mid_block.attentions.0.transformer_blocks.0.ff.net.2"),
    "flux": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
             "single_transformer_blocks.0.proj_out"),
}


def loha_factors(denoiser, modules, rank: int, seed: int, tucker: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Random factors of PEFT's own LoHa layers on ``modules`` (their shapes are PEFT's), made
    strong enough to move a tiny model's output. ``tucker``: convs with a kernel get Tucker cores
    (PEFT's ``use_effective_conv2d``, LyCORIS' ``use_tucker``)."""
    from peft import LoHaConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = inject_adapter_in_model(LoHaConfig(r=rank, alpha=rank, target_modules=list(modules), init_weights=False,
                                               use_effective_conv2d=tucker), copy.deepcopy(denoiser))
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in model.state_dict().items():
        if ".hada_" in name:
            module, _, part = name.removesuffix(".default").rpartition(".")
            factors.setdefault(module.removesuffix(".base_layer"), {})[part] = value.detach().float() * 3
    return factors


def kohya_name(module: str, layers_per_block: int) -> str:
    fake = {f"{module}.lora_A.weight": torch.zeros(1, 1), f"{module}.lora_B.weight": torch.zeros(1, 1)}
    return next(k for k in sd_scripts_sdxl_lora(fake, layers_per_block, alpha=1.0)).removesuffix(".lora_down.weight")


def loha_file(path, family, factors, rank: int, layers_per_block: int):
    """The factors as the trainer's file: kohya + LyCORIS for SDXL (alpha 2 x rank, so scale 2),
    diffusers' names for Flux (no alpha: scale 1)."""
    sd = {}
    for module, parts in factors.items():
        name = kohya_name(module, layers_per_block) if family == "sdxl" else f"transformer.{module}"
        sd.update({f"{name}.{part}": value.half() if family == "sdxl" else value for part, value in parts.items()})
        if family == "sdxl":
            sd[f"{name}.alpha"] = torch.tensor(2.0 * rank)
    save_file(sd, str(path))
    return path


def with_peft_loha(factors, rank: int, scale: float, family: str, tucker: bool = False):
    """``prepare`` for plain diffusers: PEFT's LoHa layers on the fresh pipeline's denoiser, holding
    the file's factors (SDXL's as the file stores them, in half precision), at the file's scale
    times the request's (PEFT's alpha / r)."""
    from peft import LoHaConfig, inject_adapter_in_model

    file_scale = 2.0 if family == "sdxl" else 1.0

    def prepare(pipeline):
        denoiser = pipeline.unet if family == "sdxl" else pipeline.transformer
        inject_adapter_in_model(LoHaConfig(r=rank, alpha=rank * file_scale * scale, target_modules=list(factors),
                                           use_effective_conv2d=tucker), denoiser)
        params = dict(denoiser.named_parameters())
        with torch.no_grad():
            for module, parts in factors.items():
                for part, value in parts.items():
                    value = value.half().float() if family == "sdxl" else value
                    params[f"{module}.{part}.default"].copy_(value)
    return prepare


def generate(engine, adapters):
    return engine.generate("a lighthouse", adapters=adapters, num_images=2, num_inference_steps=STEPS, seed=1,
                           output_type="latent").images


def reference(model, engine, prepare):
    return plain_diffusers_reference(model, {}, prompt="a lighthouse", num_images=2, num_inference_steps=STEPS,
                                     guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
                                     width=engine.width, seed=1, prepare=prepare)


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_a_loha_is_served_equal_to_plain_diffusers_with_peft_loha(tiny_models, tmp_path, family):
    model = tiny_models[family]
    slots = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False)
    per_block = slots.denoiser.config.get("layers_per_block", 0) if family == "sdxl" else 0
    small_factors = loha_factors(slots.denoiser, MODULES[family], rank=2, seed=0)  # exact rank 4
    big_factors = loha_factors(slots.denoiser, MODULES[family], rank=3, seed=1)  # exact rank 9 > 8
    small = loha_file(tmp_path / "small.safetensors", family, small_factors, 2, per_block)
    big = loha_file(tmp_path / "big.safetensors", family, big_factors, 3, per_block)

    base = generate(slots, {})
    ours = generate(slots, {"identity": (str(small), 0.8)})
    theirs = reference(model, slots, with_peft_loha(small_factors, 2, 0.8, family))
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (theirs - base).abs().max().item() > 100 * TOLERANCE  # the LoHa moved the output
    loaded = slots.load_adapter(str(small))
    assert loaded.layout == "lycoris-loha" and loaded.rank == 4
    assert set(loaded.modules) == set(MODULES[family])
    with pytest.raises(AdapterRejected, match="exact low-rank form of a LyCORIS LoHa: fused mode"):
        generate(slots, {"identity": (str(big), 1.0)})

    for mode in ("fused", "auto"):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False, adapter_mode=mode)
        for path, factors, rank, scale in ((big, big_factors, 3, 0.7), (small, small_factors, 2, 1.0)):
            got = generate(engine, {"identity": (str(path), scale)})
            want = reference(model, engine, with_peft_loha(factors, rank, scale, family))
            assert (got - want).abs().max().item() <= TOLERANCE, (mode, rank)
        torch.testing.assert_close(generate(engine, {}), base, atol=TOLERANCE, rtol=0)  # the base restored


@pytest.mark.parametrize("tucker", [False, True], ids=["flattened", "tucker"])
def test_a_loha_on_conv_layers_is_served_fused_and_refused_by_the_slots(tiny_models, tmp_path, tucker):
    """LyCORIS' ``conv_dim`` LoHa on SDXL's resnet convs and a Linear, in kohya names, its conv factors
    flattened over the kernel or Tucker-decomposed (``use_tucker``: a core per factor): fused mode
    equals PEFT's LoHa ``Conv2d`` layers; slots and auto name fused mode."""
    model = tiny_models["sdxl"]
    fused = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False, adapter_mode="fused")
    modules = ("down_blocks.0.resnets.0.conv1", "up_blocks.1.resnets.1.conv_shortcut", MODULES["sdxl"][0])
    factors = loha_factors(fused.denoiser, modules, rank=2, seed=2, tucker=tucker)
    # flattened over the 3x3 kernel as LyCORIS stores it, or a [r, r, 3, 3] core; a 1x1 conv never has a core
    assert (factors[modules[0]]["hada_w1_b"].ndim, "hada_t1" in factors[modules[0]]) == (2, tucker)
    assert tuple(factors[modules[0]].get("hada_t2", torch.zeros(2, 2, 3, 3)).shape) == (2, 2, 3, 3)
    assert "hada_t1" not in factors[modules[1]]
    path = loha_file(tmp_path / "conv.safetensors", "sdxl", factors, 2, fused.denoiser.config["layers_per_block"])
    base = generate(fused, {})
    got = generate(fused, {"identity": (str(path), 0.9)})
    want = reference(model, fused, with_peft_loha(factors, 2, 0.9, "sdxl", tucker))
    assert (got - want).abs().max().item() <= TOLERANCE
    assert (want - base).abs().max().item() > 100 * TOLERANCE
    torch.testing.assert_close(generate(fused, {}), base, atol=TOLERANCE, rtol=0)
    for mode in ("slots", "auto"):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False, adapter_mode=mode)
        with pytest.raises(AdapterRejected, match="LoHa's conv layers are served in fused mode"):
            generate(engine, {"identity": (str(path), 1.0)})


def test_loha_files_that_are_not_served_are_refused_by_name(tiny_models, tmp_path):
    from hotlora.adapters.format.convert import load_adapter
    from hotlora.families import family_named

    flux = family_named("flux")
    name = "transformer.transformer_blocks.0.attn.to_q"
    good = {f"{name}.hada_w1_a": torch.ones(32, 2), f"{name}.hada_w1_b": torch.ones(2, 32),
            f"{name}.hada_w2_a": torch.ones(32, 2), f"{name}.hada_w2_b": torch.ones(2, 32)}
    assert load_adapter(good, flux).modules["transformer_blocks.0.attn.to_q"].rank == 4
    half_tucker = {**good, f"{name}.hada_t1": torch.ones(2, 2, 3, 3)}
    with pytest.raises(AdapterFormatError, match="needs both hada_t1 and hada_t2"):
        load_adapter(half_tucker, flux)
    bad_core = {**half_tucker, f"{name}.hada_t2": torch.ones(3, 2, 3, 3)}
    with pytest.raises(AdapterFormatError, match="do not make one kernel"):
        load_adapter(bad_core, flux)
    missing = {k: v for k, v in good.items() if not k.endswith("hada_w2_b")}
    with pytest.raises(AdapterFormatError, match="missing: hada_w2_b"):
        load_adapter(missing, flux)
    mismatched = {**good, f"{name}.hada_w2_b": torch.ones(2, 16)}
    with pytest.raises(AdapterFormatError, match="do not make one matrix"):
        load_adapter(mismatched, flux)
    tall, wide = torch.ones(2**16, 128), torch.ones(128, 2**16)  # exact rank 16384 on 65536-wide layers: 2^31 elements
    huge = {f"{name}.hada_w1_a": tall, f"{name}.hada_w1_b": wide, f"{name}.hada_w2_a": tall, f"{name}.hada_w2_b": wide}
    with pytest.raises(AdapterFormatError, match="refused before expanding"):
        load_adapter(huge, flux)


def test_auto_mode_refuses_a_loha_above_the_slots_that_a_bf16_merge_would_cut(tiny_models, tmp_path):
    """Above the target rank, auto mode has only the merge: a weak LoHa (its delta mostly under half
    a bf16 step of the weights) is refused by name, nothing written; a strong one is served fused."""
    model = tiny_models["sdxl"]
    engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, compile=False, adapter_mode="auto",
                                    dtype=torch.bfloat16)
    per_block = engine.denoiser.config["layers_per_block"]
    factors = loha_factors(engine.denoiser, MODULES["sdxl"], rank=3, seed=1)  # exact rank 9 > 8
    weak = {m: {**parts, "hada_w1_a": parts["hada_w1_a"] * 1e-3} for m, parts in factors.items()}
    strong = loha_file(tmp_path / "strong.safetensors", "sdxl", factors, 3, per_block)
    weak = loha_file(tmp_path / "weak.safetensors", "sdxl", weak, 3, per_block)
    before = {name: p.detach().clone() for name, p in engine.denoiser.named_parameters()}
    with pytest.raises(AdapterRejected, match="rank 9 exceeds the slots' target rank 8.*auto mode serves it neither"):
        generate(engine, {"identity": (str(weak), 1.0)})
    assert all(torch.equal(before[name], p) for name, p in engine.denoiser.named_parameters())
    result = engine.generate("a lighthouse", adapters={"identity": (str(strong), 1.0)}, num_images=1,
                             num_inference_steps=STEPS, seed=1, output_type="latent")
    assert result.adapters["identity"]["mode"] == "fused"


def test_a_tucker_loha_is_bounded_before_its_kernel_is_expanded():
    """A Tucker core's kernel size multiplies the contraction ``[r, in * kh * kw]`` beyond the file's own
    size: a file of a few MB that would expand to 2^31 elements is refused by name, nothing allocated."""
    from hotlora.adapters.format.convert import load_adapter
    from hotlora.families import family_named

    name = "transformer.transformer_blocks.0.attn.to_q"
    wide = torch.ones(2, 2**19)  # in = 2^19; a 64 x 64 kernel: 2 x 2^19 x 2^12 = 2^32 elements each
    huge = {f"{name}.hada_w1_a": torch.ones(2, 8), f"{name}.hada_w1_b": wide, f"{name}.hada_t1": torch.ones(2, 2, 64, 64),
            f"{name}.hada_w2_a": torch.ones(2, 8), f"{name}.hada_w2_b": wide, f"{name}.hada_t2": torch.ones(2, 2, 64, 64)}
    with pytest.raises(AdapterFormatError, match="refused before expanding"):
        load_adapter(huge, family_named("flux"))
