import pytest
import torch

from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.families import family_named
from hotlora.adapters.resolver import AdapterResolver
from hotlora.adapters.format.validate import SlotCeiling, problems_with
from hotlora.errors import AdapterRejected

CEILING = SlotCeiling(modules={"blk.q": (8, 8), "blk.out": (8, 4)}, target_rank=4, family="flux")


def adapter(modules, family="flux"):
    return Adapter(name="t", family=family, layout="diffusers", modules=modules, sha256="0" * 64)


def lora(r, in_f, out_f, fill=None):
    down, up = torch.randn(r, in_f), torch.randn(out_f, r)
    if fill is not None:
        down[0, 0] = fill
    return LoraWeights(down=down, up=up, scaling=1.0)


def test_a_fitting_adapter_passes():
    assert problems_with(adapter({"blk.q": lora(4, 8, 8), "blk.out": lora(1, 8, 4)}), CEILING) == []


@pytest.mark.parametrize(
    "modules, expected",
    [
        ({"blk.q": lora(5, 8, 8)}, "exceeds the engine's target rank 4 in blk.q"),
        ({"other.layer": lora(2, 8, 8)}, "outside the slot ceiling: other.layer"),
        ({"blk.q": lora(2, 6, 8)}, "shape mismatch in blk.q"),
        ({"blk.out": lora(2, 8, 8)}, "base layer is 8 -> 4"),
        ({"blk.q": lora(2, 8, 8, fill=float("nan"))}, "NaN or infinite values in blk.q"),
        ({"blk.q": lora(2, 8, 8, fill=float("inf"))}, "NaN or infinite values in blk.q"),
        ({"blk.q": LoraWeights(torch.ones(2, 8, dtype=torch.int64), torch.ones(8, 2), 1.0)}, "non-floating dtype"),
        ({}, "holds no LoRA modules"),
    ],
)
def test_each_rule_rejects_what_breaks_it(modules, expected):
    found = problems_with(adapter(modules), CEILING)
    assert any(expected in p for p in found), found


def test_a_shape_mismatch_says_the_file_may_be_for_another_base_model():
    """Flux.1's LoRA on Flux.2 klein: the same names (after the converter), other widths."""
    (found,) = problems_with(adapter({"blk.q": lora(2, 6, 8)}), CEILING)
    assert found.startswith("shape mismatch in blk.q") and "widths this flux model's layers do not have" in found
    assert "another base model" in found


def test_wrong_family_is_rejected():
    assert any("sdxl family" in p for p in problems_with(adapter({"blk.q": lora(1, 8, 8)}, "sdxl"), CEILING))


def test_another_familys_lora_is_named_even_where_most_of_its_modules_fit():
    """SD3.5's LoRA on a Flux engine: its joint blocks' names are Flux's too, its ``attn2`` is SD3.5's own."""
    ceiling = SlotCeiling(modules={f"transformer_blocks.0.attn.{m}": (8, 8) for m in ("to_q", "to_k", "to_v")},
                          target_rank=4, family="flux")
    modules = {name: lora(2, 8, 8) for name in [*ceiling.modules, "transformer_blocks.0.attn2.to_q"]}
    found = problems_with(adapter(modules), ceiling)
    assert len(found) == 1 and "1 module(s) outside the slot ceiling" in found[0], found
    assert "looks like a LoRA for the sd3 family" in found[0] and "serves the flux family" in found[0], found


def test_every_problem_is_reported_at_once():
    """What a request meets: the resolver raises one AdapterRejected with every problem."""
    bad = adapter({"blk.q": lora(9, 8, 8, fill=float("nan")), "nowhere": lora(1, 8, 8)})
    resolver = AdapterResolver(("identity",), CEILING, family_named("flux"))
    with pytest.raises(AdapterRejected) as info:
        resolver.resolve({"identity": bad})
    assert len(info.value.problems) == 3
    text = str(info.value)
    assert "blk.q" in text and "nowhere" in text


# Conv LoRA: fused mode's ceiling lists the Conv2d layers with their weight shapes; slots have none.
FUSED = SlotCeiling(modules={"blk.q": (8, 8)}, target_rank=4, family="sdxl", any_rank=True,
                    convs={"res.conv1": (6, 4, 3, 3), "res.skip": (6, 4, 1, 1)})


def conv_lora(r, in_c, out_c, k=3):
    return LoraWeights(down=torch.randn(r, in_c, k, k), up=torch.randn(out_c, r, 1, 1), scaling=1.0)


def test_conv_lora_fits_a_ceiling_with_those_convs():
    good = adapter({"res.conv1": conv_lora(8, 4, 6), "res.skip": conv_lora(2, 4, 6, k=1), "blk.q": lora(9, 8, 8)},
                   family="sdxl")
    assert problems_with(good, FUSED) == []


@pytest.mark.parametrize("weights, expected", [
    (conv_lora(2, 4, 6, k=1), "base conv weight is (6, 4, 3, 3)"),  # the down conv lacks the layer's kernel
    (conv_lora(2, 5, 6), "base conv weight is (6, 4, 3, 3)"),
    (LoraWeights(torch.randn(2, 4, 3, 3), torch.randn(6, 2, 3, 3), 1.0), "base conv weight"),  # up must be 1x1
    (lora(2, 36, 6), "base conv weight"),  # 2-D factors for a conv layer
])
def test_conv_lora_of_the_wrong_shape_is_rejected(weights, expected):
    found = problems_with(adapter({"res.conv1": weights}, family="sdxl"), FUSED)
    assert any("shape mismatch" in p and expected in p for p in found), found


def test_a_loha_on_a_conv_layer_has_its_factors_flattened_over_the_kernel():
    flat = lora(2, 36, 6)  # A [r, 4 * 3 * 3], B [6, r]: a LyCORIS LoHa's exact form on res.conv1
    loha = Adapter(name="t", family="sdxl", layout="lycoris-loha", modules={"res.conv1": flat}, sha256="0" * 64)
    assert problems_with(loha, FUSED) == []
    wrong = Adapter(name="t", family="sdxl", layout="lycoris-loha", modules={"res.conv1": lora(2, 35, 6)},
                    sha256="0" * 64)
    assert any("shape mismatch" in p and "base conv weight" in p for p in problems_with(wrong, FUSED))


def test_slots_refuse_conv_lora_naming_the_mode_that_serves_it():
    found = problems_with(adapter({"res.conv1": conv_lora(2, 4, 6), "blk.q": lora(2, 8, 8)}, family="sdxl"),
                          SlotCeiling(modules={"blk.q": (8, 8)}, target_rank=4, family="sdxl"))
    assert len(found) == 1 and "conv LoRA on 1 layer(s) (res.conv1)" in found[0] and "fused mode" in found[0], found
    # 4-D factors on a Linear of the ceiling are a shape mismatch, not conv LoRA.
    found = problems_with(adapter({"blk.q": conv_lora(2, 8, 8, k=1)}, family="sdxl"), FUSED)
    assert any("shape mismatch in blk.q" in p for p in found), found


# SD1.x's slots: Linears, and the attentions' 1x1 projections held as Linears over the channels.
POINTWISE = SlotCeiling(modules={"blk.q": (8, 8)}, target_rank=4, family="sd15", pointwise={"attn.proj_in": (4, 8)})


def test_slots_take_a_1x1_conv_lora_on_the_projections_they_hold():
    assert problems_with(adapter({"attn.proj_in": conv_lora(3, 4, 8, k=1), "blk.q": lora(2, 8, 8)}, family="sd15"),
                         POINTWISE) == []


@pytest.mark.parametrize("weights, expected", [
    (conv_lora(2, 4, 8), "base layer is a 1x1 conv"),  # a 3x3 down conv on a 1x1 layer
    (conv_lora(2, 5, 8, k=1), "base layer is 4 -> 8"),
    (conv_lora(5, 4, 8, k=1), "exceeds the engine's target rank 4"),
])
def test_a_1x1_conv_lora_that_does_not_fit_is_rejected(weights, expected):
    found = problems_with(adapter({"attn.proj_in": weights}, family="sd15"), POINTWISE)
    assert any(expected in p for p in found), found


def test_conv_lora_elsewhere_is_still_refused_naming_fused_mode():
    found = problems_with(adapter({"res.conv1": conv_lora(2, 4, 6), "attn.proj_in": conv_lora(2, 4, 8, k=1)},
                                  family="sd15"), POINTWISE)
    assert len(found) == 1 and "conv LoRA on 1 layer(s) (res.conv1)" in found[0], found


# A two-expert Wan 2.2 model's ceiling: the high-noise expert's modules, and the low-noise one's under transformer_2.
TWO_EXPERTS = SlotCeiling(modules={"blk.q": (8, 8), "transformer_2.blk.q": (8, 8)}, target_rank=4, family="wan")
ONE_EXPERT = SlotCeiling(modules={"blk.q": (8, 8)}, target_rank=4, family="wan")


def test_a_slots_high_and_low_noise_files_are_one_pair_adapter():
    """``{"ref": high, "low_noise": low}``: the low-noise LoRA lands on transformer_2's modules,
    each part unchanged, under one content key of its own (another low-noise file: another key)."""
    resolver = AdapterResolver(("identity",), TWO_EXPERTS, family_named("wan"))
    high, low = adapter({"blk.q": lora(2, 8, 8)}, "wan"), adapter({"blk.q": lora(3, 8, 8)}, "wan")
    low = Adapter(name="low", family="wan", layout="diffusers", modules=low.modules, sha256="1" * 64)
    (binding,) = resolver.resolve({"identity": {"ref": high, "low_noise": low, "scale": 0.5}}).values()
    assert binding.scale == 0.5 and set(binding.adapter.modules) == {"blk.q", "transformer_2.blk.q"}
    assert binding.adapter.modules["transformer_2.blk.q"] is low.modules["blk.q"]
    assert binding.adapter.modules["blk.q"] is high.modules["blk.q"]
    other = Adapter(name="other", family="wan", layout="diffusers", modules=low.modules, sha256="2" * 64)
    (again,) = resolver.resolve({"identity": {"ref": high, "low_noise": other}}).values()
    assert again.adapter.key != binding.adapter.key


def test_a_low_noise_file_is_refused_where_it_has_nowhere_to_go():
    """A one-transformer model (Wan 2.1, or any other family) refuses ``low_noise`` before any
    fetch; a low-noise part that is a pair already is refused naming the slot."""
    from hotlora.errors import InvalidRequest

    part = adapter({"blk.q": lora(2, 8, 8)}, "wan")
    for ceiling, family in ((ONE_EXPERT, "wan"), (CEILING, "flux")):
        resolver = AdapterResolver(("identity",), ceiling, family_named(family))
        with pytest.raises(InvalidRequest, match=r"\[identity\] low_noise .* one denoiser"):
            resolver.specs({"identity": {"ref": "high.safetensors", "low_noise": "low.safetensors"}})
    resolver = AdapterResolver(("identity",), TWO_EXPERTS, family_named("wan"))
    pair = adapter({"blk.q": lora(2, 8, 8), "transformer_2.blk.q": lora(2, 8, 8)}, "wan")
    with pytest.raises(InvalidRequest, match=r"\[identity\] .*not one expert's LoRA"):
        resolver.resolve({"identity": {"ref": part, "low_noise": pair}})
    with pytest.raises(InvalidRequest, match="low_noise reference is empty"):
        resolver.specs({"identity": {"ref": "high.safetensors", "low_noise": " "}})
