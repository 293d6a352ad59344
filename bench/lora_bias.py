"""What holding LoRA biases costs per step: a Wan transformer at its published width (Wan 2.1 1.3B:
dim 1536, FFN 8960, one block) with the slots' PEFT LoRA layers on every block Linear, compiled,
with ``lora_bias`` off (every family but Wan) and on (Wan: ``ModelFamily.lora_biases``, for
lightx2v's ``.diff_b``), against the same model without LoRA layers; side by side in one run,
interleaved, median of --runs.

Usage: .venv/bin/python bench/lora_bias.py [--tokens 1560] [--rank 64] [--runs 7] [--out bench/results]

``--tokens``: the video tokens of a forward (1560: one latent frame of 480x832 after the 1x2x2
patch); the text is 512 tokens of T5 width as the pipeline pads it. float32 (this CPU's fast path).
The bias costs one add of [tokens, out] per Linear; inductor may fuse it into the LoRA up-projection.
Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, markdown_table, use_repo_compile_cache, write_results  # noqa: E402

use_repo_compile_cache()


def build(with_lora: bool, lora_bias: bool, rank: int, seed: int = 0):
    import torch
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from hotlora.fullsize.wan21_t2v_1_3b import COMPONENTS

    config = {k: v for k, v in COMPONENTS["transformer"].items() if not k.startswith("_")}
    torch.manual_seed(seed)
    model = WanTransformer3DModel.from_config({**config, "num_layers": 1}).eval()
    if with_lora:
        linears = [n for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)]
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=linears, lora_bias=lora_bias,
                                     lora_dropout=0.0), adapter_name="slots")
        with torch.no_grad():  # a live adapter: random factors (and bias), as a request's would be
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.normal_(std=0.01)
    model.compile(fullgraph=True)
    return model


def inputs(tokens: int):
    import torch

    width = tokens // 30  # 480 / 8 / 2 = 30 latent rows after the patch
    hidden = torch.randn(1, 16, 1, 60, 2 * width)
    return {"hidden_states": hidden, "timestep": torch.tensor([500]), "encoder_hidden_states": torch.randn(1, 512, 4096),
            "return_dict": False}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1560)
    parser.add_argument("--rank", type=int, default=64, help="the LoRA layers' rank (the slots' rows: 2 x target rank)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--name", default="lora-bias")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    ways = {"no LoRA layers": build(False, False, args.rank), "LoRA, no bias": build(True, False, args.rank),
            "LoRA + bias": build(True, True, args.rank)}
    feed = inputs(args.tokens)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for model in ways.values():  # compile and warm each
        model(**feed)
        model(**feed)
    for _ in range(args.runs):
        for way, model in ways.items():
            start = time.perf_counter()
            model(**feed)
            times[way].append(time.perf_counter() - start)
    median = {way: statistics.median(t) for way, t in times.items()}
    rows = [(way, f"{median[way] * 1000:.1f}", f"{median[way] / median['no LoRA layers']:.3f}",
             f"{median[way] / median['LoRA, no bias']:.3f}") for way in ways]
    table = markdown_table(["model (one Wan 2.1 1.3B block, compiled)", "forward ms (median)", "vs no LoRA layers",
                            "vs LoRA without bias"], rows)
    write_results(args.out, args.name, {"args": vars(args), "median_s": median, "runs_s": times}, table,
                  f"One Wan 2.1 1.3B block at its published width, {args.tokens} video tokens + 512 text tokens, "
                  f"LoRA rank {args.rank} on every block Linear, float32, compiled (fullgraph), median of {args.runs} "
                  f"interleaved runs.")


if __name__ == "__main__":
    main()
