"""1x1 convs in the slots and banks (a family's ``pointwise_convs``: SD1.x's attention projections,
which kohya sd-scripts' default network wraps). On a toy diffusers model, eager: each writer's output
equals the base convs with the LoRA delta merged, ``B.flatten(1) @ A.flatten(1)`` per 1x1 conv."""

import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.loaders import PeftAdapterMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from hotlora.adapters.binding import Binding
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.adapters.format.validate import problems_with
from hotlora.engine.writers.auto import AutoWriter
from hotlora.engine.writers.banks import BanksWriter
from hotlora.engine.writers.base import ceiling_modules
from hotlora.engine.writers.slots import SlotsWriter

RANK = 3
POINTWISE = r".*proj_(in|out)"


class Toy(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """A 1x1 ``proj_in``, a 3x3 conv, a strided 1x1 conv, a Linear over the channels, a 1x1 ``proj_out``."""

    @register_to_config
    def __init__(self, channels: int = 4, width: int = 6):
        super().__init__()
        self.proj_in = nn.Conv2d(channels, width, 1)
        self.spatial = nn.Conv2d(width, width, 3, padding=1)
        self.down_proj_in = nn.Conv2d(width, width, 1, stride=2)  # matches the pattern; not pointwise
        self.mix = nn.Linear(width, width)
        self.proj_out = nn.Conv2d(width, channels, 1)

    def forward(self, x):
        y = self.spatial(self.proj_in(x))
        y = self.mix(self.down_proj_in(y).movedim(1, -1)).movedim(-1, 1)
        return self.proj_out(y)


def toy() -> Toy:
    torch.manual_seed(0)
    return Toy().eval()


def adapter(seed: int, modules=("proj_in", "mix", "proj_out")) -> Adapter:
    model, g = toy(), torch.Generator().manual_seed(seed)
    weights = {}
    for name in modules:
        layer = getattr(model, name)
        in_f, out_f = (layer.in_channels, layer.out_channels) if isinstance(layer, nn.Conv2d) else (layer.in_features,
                                                                                                   layer.out_features)
        down, up = torch.randn(RANK, in_f, generator=g), torch.randn(out_f, RANK, generator=g)
        if isinstance(layer, nn.Conv2d):  # a conv LoRA's factors, as PEFT and kohya save them
            down, up = down[..., None, None], up[..., None, None]
        weights[name] = LoraWeights(down=down, up=up, scaling=0.5)
    return Adapter(name=f"a{seed}", family="toy", layout="diffusers", modules=weights, sha256=f"{seed:064d}")


def merged(adapter: Adapter, scale: float, x: torch.Tensor) -> torch.Tensor:
    """The toy with the adapter's delta added to its weights: plain arithmetic, no LoRA layers."""
    model = toy()
    with torch.no_grad():
        for name, w in adapter.modules.items():
            weight = getattr(model, name).weight
            weight += (scale * w.scaling * (w.up.flatten(1) @ w.down.flatten(1))).view_as(weight)
    return model(x)


def test_the_ceiling_holds_the_1x1_convs_the_pattern_names_and_no_others():
    held = ceiling_modules(toy(), None, POINTWISE)
    assert held == {"proj_in": (4, 6), "mix": (6, 6), "proj_out": (6, 4)}  # not the 3x3 nor the strided one
    assert list(ceiling_modules(toy(), None)) == ["mix"]


@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_slots_serve_a_conv_lora_on_a_1x1_conv_as_its_merged_weights(scale):
    model, x = toy(), torch.randn(2, 4, 8, 8)
    writer = SlotsWriter(model, "toy", ("identity", "style"), target_rank=4, pointwise=POINTWISE)
    assert set(writer.ceiling.pointwise) == {"proj_in", "proj_out"} and set(writer.ceiling.modules) == {"mix"}
    a = adapter(1)
    assert problems_with(a, writer.ceiling) == []
    writer.prepare({"identity": Binding(a, scale)})
    report = writer.swap({"identity": Binding(a, scale)})
    assert report.packed_writes == 1  # the conv factors packed like a Linear's
    with torch.no_grad():
        torch.testing.assert_close(model(x), merged(a, scale, x), atol=1e-5, rtol=1e-5)
        b = adapter(2, modules=("proj_out",))
        writer.prepare({"style": Binding(b, scale)})
        report = writer.swap({"style": Binding(b, scale)})  # identity emptied
        assert report.per_module_writes == 1  # too sparse to pack: module by module
        torch.testing.assert_close(model(x), merged(b, scale, x), atol=1e-5, rtol=1e-5)


def test_banks_give_each_sample_its_own_conv_lora():
    model, x = toy(), torch.randn(2, 4, 8, 8)
    writer = BanksWriter(model, "toy", ("identity",), 4, entries=3, max_batch=2, pointwise=POINTWISE)
    a, b = adapter(1), adapter(2, modules=("proj_in",))
    writer.bind([{"identity": Binding(a, 1.0)}, {"identity": Binding(b, 0.7)}])
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out[:1], merged(a, 1.0, x[:1]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1:], merged(b, 0.7, x[1:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("min_kept, path", [(0.0, "fused"), (2.0, "slots")])  # 2.0: no merge keeps enough
def test_auto_mode_serves_the_1x1_convs_on_either_path(min_kept, path):
    model, x = toy(), torch.randn(2, 4, 8, 8)
    writer = AutoWriter(model, "toy", ("identity",), 4, min_kept=min_kept, pointwise=POINTWISE)
    assert set(writer.ceiling.pointwise) == {"proj_in", "proj_out"}
    a, bindings = adapter(1), {"identity": Binding(adapter(1), 0.8)}
    assert problems_with(a, writer.ceiling) == []
    writer.prepare(bindings)
    report = writer.bind([bindings])
    assert report.fused["identity"]["mode"] == path
    with torch.no_grad():
        torch.testing.assert_close(model(x), merged(a, 0.8, x), atol=1e-5, rtol=1e-5)
        writer.bind([{}])  # no adapters: the base convs again, whichever path held them
        torch.testing.assert_close(model(x), toy()(x), atol=1e-6, rtol=1e-6)
    base = toy()
    for name in ("proj_in", "mix", "proj_out"):  # the merge undone bit for bit (restored from W0)
        assert torch.equal(model.get_submodule(name).get_base_layer().weight, base.get_submodule(name).weight)
