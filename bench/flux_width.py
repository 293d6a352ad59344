"""FLUX.1's transformer at its real width with fewer blocks, saved as a model directory with two adapters:
the real-width rows of the edit task (FluxKontextPipeline) on a machine that cannot hold 12B parameters.

Usage: .venv/bin/python bench/flux_width.py DIR [--layers 1] [--single-layers 2]

then, for the task rows (text-to-image and edit; diffusers' FluxKontextPipeline made with ``from_pipe``)::

    .venv/bin/python bench/tasks.py --model DIR --dtype bfloat16 --size 256 --images 1 --steps 4 \
        --requests 2 --rounds 2 --target-rank 128 --identity DIR/adapters/r32 --style DIR/adapters/r128 \
        --tasks text-to-image,edit --name tasks-flux-width --no-eager

What is real: every Linear's shape (width 3072, 24 heads of 128, 4096-wide text states, the 12288-wide
MLPs), the VAE as published, the scheduler; what is not: the number of blocks (1 + 2 by default against
19 + 38, so a step costs about 1/25 of the published model's) and the text encoders (two random layers of
the real output widths, bench/gpu_flux.py's), random bf16 weights throughout. Per block, the slots' cost
against diffusers' PEFT layers is the published model's; the share of the step outside the blocks is not.

The adapters, in diffusers' layout (``save_lora_weights`` with its ``LoraConfig``): rank 32 on every
Linear of the blocks (identity, as ai-toolkit trains Flux) and rank 128 on the attention projections
(style), float16 as shared files are, each branch about 5% of its layer's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADAPTER_STRENGTH = 0.05
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def block_linears(transformer) -> dict[str, tuple[int, int]]:
    """Every Linear inside the transformer's blocks: name -> (in_features, out_features)."""
    import torch

    return {name: (module.in_features, module.out_features) for name, module in transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "single_transformer_blocks."))}


def save(directory: Path, layers: int, single_layers: int, heads: int = 24, text_width: int = 4096) -> dict[str, str]:
    """The pipeline under ``directory`` (kept if one is there) and its two adapters: {"r32": dir, "r128": dir}.
    ``heads`` / ``text_width`` narrower than published only for the script's own test."""
    import torch

    from bench.gpu_flux import build_full_flux
    from hotlora.families._tiny import random_lora
    from hotlora.tiny import save_diffusers_lora

    directory = Path(directory)
    pipeline = build_full_flux(layers, single_layers, device="cpu", heads=heads, text_width=text_width)
    linears = block_linears(pipeline.transformer)
    if not (directory / "model_index.json").is_file():
        pipeline.save_pretrained(directory)
    adapters = {}
    for name, rank, chosen, seed in (("r32", 32, None, 1),
                                     ("r128", 128, [n for n in linears if n.endswith(ATTENTION)], 2)):
        sd = {k: v.to(torch.float16) for k, v in random_lora(linears, rank, seed, chosen,
                                                              strength=ADAPTER_STRENGTH).items()}
        adapters[name] = str(save_diffusers_lora(directory / "adapters" / name, "flux", sd, rank=rank, alpha=rank))
    return adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=1, help="double-stream blocks (published: 19)")
    parser.add_argument("--single-layers", type=int, default=2, help="single-stream blocks (published: 38)")
    args = parser.parse_args()
    print(json.dumps(save(args.directory, args.layers, args.single_layers), indent=2))


if __name__ == "__main__":
    main()
