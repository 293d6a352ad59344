"""bench/families.py's ``wide`` denoisers: the published configuration with one block of each kind and the
tiny model's interface. Built on the meta device against the published model (no weights: seconds), for
every image family with a published configuration: the blocks' Linears are the published model's shapes,
a transformer keeps one block of each kind, the model is a small part of the published one, and it takes
the very inputs the tiny pipeline hands its own denoiser (on the meta device: shapes only)."""

import re
from functools import partial

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

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
    # The published blocks' biggest Linear is kept (Sana's biggest of all, the shared adaLN projection
    # 2240 -> 6 x 2240, sits outside its blocks).
    biggest = max((s for n, s in linear_shapes(full).items() if BLOCK.search(n)), key=lambda s: s[0] * s[1])
    assert biggest in set(blocks.values())
    # A transformer keeps one block of each kind; a UNet every level (its widths), one layer a level.
    share = 0.8 if "block_out_channels" in published else 0.2
    assert sum(p.numel() for p in wide.parameters()) < share * sum(p.numel() for p in full.parameters())
    repeated = set(getattr(tiny, "_repeated_blocks", None) or family.repeated_blocks)
    if repeated and "block_out_channels" not in published:  # a block-count key bench/families.py misses
        stacks = [n.rpartition(".")[0] for n, m in wide.named_modules() if type(m).__name__ in repeated]
        assert stacks and sorted(stacks) == sorted(set(stacks)), stacks  # one block in every stack
    args, kwargs = denoiser_call(family)  # an interface key bench/families.py misses: shapes disagree
    to_meta = partial(tree_map, lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x)
    try:
        with torch.no_grad():
            out = wide.to(torch.float32)(*to_meta(args), **to_meta(kwargs))
    except RuntimeError as exc:  # an op without a meta kernel (Qwen-Image 2.1's repeat_interleave by a tensor)
        if "meta" not in str(exc):
            raise
        torch.manual_seed(0)
        wide = cls.from_config(wide_config(dict(tiny.config), published)).to(torch.bfloat16)
        to_bf16 = partial(tree_map, lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor)
                          and x.is_floating_point() else x)
        with torch.no_grad():
            out = wide(*to_bf16(args), **to_bf16(kwargs))
    shapes = [t.shape for t in tree_leaves(out)]  # Z-Image returns a list of per-image tensors
    assert shapes == [t.shape for t in tree_leaves(tiny(*args, **kwargs))]


def denoiser_call(family):
    """The positional and keyword arguments of the tiny pipeline's first call to its denoiser."""
    pipeline = family.build_tiny(0)
    pipeline.set_progress_bar_config(disable=True)
    calls = []
    getattr(pipeline, family.denoiser).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    pipeline(prompt="a cat", num_inference_steps=1, output_type="latent", height=32, width=32)
    return calls[0]
