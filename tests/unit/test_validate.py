import pytest
import torch

from hotlora.adapters.formats import Adapter, LoraWeights
from hotlora.adapters.families import family_named
from hotlora.adapters.resolver import AdapterResolver
from hotlora.adapters.validate import SlotCeiling, problems_with
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


def test_wrong_family_is_rejected():
    assert any("sdxl family" in p for p in problems_with(adapter({"blk.q": lora(1, 8, 8)}, "sdxl"), CEILING))


def test_every_problem_is_reported_at_once():
    """What a request meets: the resolver raises one AdapterRejected with every problem."""
    bad = adapter({"blk.q": lora(9, 8, 8, fill=float("nan")), "nowhere": lora(1, 8, 8)})
    resolver = AdapterResolver(("identity",), CEILING, family_named("flux"))
    with pytest.raises(AdapterRejected) as info:
        resolver.resolve({"identity": bad})
    assert len(info.value.problems) == 3
    text = str(info.value)
    assert "blk.q" in text and "nowhere" in text
