"""bench/families.py's ``wide`` denoisers: the published configuration with one block of each kind and the
tiny model's interface. Built on the meta device against the published model (no weights: seconds), for
every image family with a published configuration: the blocks' Linears are the published model's shapes,
and the model is a small part of the published one."""

import re

import pytest
import torch

from bench.families import IMAGE_FAMILIES_SKIPPED, published_denoiser, wide_config
from hotlora.families import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore:`FluxPosEmbed` is deprecated:FutureWarning",
                                        "ignore:The config attributes:UserWarning")

WIDE = [name for name, family in FAMILIES.items()
        if name not in IMAGE_FAMILIES_SKIPPED and published_denoiser(family) is not None]


BLOCK = re.compile(r"(^|\.)(\w*blocks|layers|\w*refiner)\.\d+\.")  # a repeated block's Linear, by its name


def linear_shapes(model) -> dict[str, tuple[int, int]]:
    return {name: tuple(module.weight.shape) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def test_every_image_family_of_the_plan_has_a_wide_model():
    assert {"flux", "sdxl", "sd15", "sd3", "zimage", "qwenimage", "flux2", "flux2-klein", "chroma"} <= set(WIDE)


@pytest.mark.parametrize("name", WIDE)
def test_the_wide_blocks_are_the_published_ones(name):
    family = FAMILIES[name]
    tiny = getattr(family.build_tiny(0), family.denoiser)
    published = published_denoiser(family)
    cls = type(tiny)
    with torch.device("meta"):
        full = cls.from_config({k: v for k, v in published.items() if not k.startswith("_")})
        wide = cls.from_config(wide_config(dict(tiny.config), published))
    full_shapes = set(linear_shapes(full).values())
    blocks = {n: s for n, s in linear_shapes(wide).items() if BLOCK.search(n)}
    assert blocks, "the wide model has blocks"
    published_share = sum(a * b for s in blocks.values() if s in full_shapes for a, b in [s]) / sum(
        a * b for a, b in blocks.values())
    # Only a UNet's cross-attention keys/values face the tiny text encoder inside the blocks.
    assert published_share > 0.9, {n: s for n, s in blocks.items() if s not in full_shapes}
    biggest = max(linear_shapes(full).values(), key=lambda s: s[0] * s[1])
    assert biggest in set(blocks.values())
    # A transformer keeps one block of each kind; a UNet every level (its widths), one layer a level.
    share = 0.8 if "block_out_channels" in published else 0.2
    assert sum(p.numel() for p in wide.parameters()) < share * sum(p.numel() for p in full.parameters())
    assert getattr(wide.config, "in_channels", None) == getattr(tiny.config, "in_channels", None)
