"""The three adapter modes side by side: slots, fused and auto (engine/writers/auto.py), compiled,
tiny Flux and SDXL, bf16 and float32 on the CPU: pack time, swap time, the path auto chose and what
the merge keeps, for a strong adapter (delta RMS 3% of each layer's weight RMS) and a weak one
(0.1%, which a bf16 merge cuts to about half its effect).

Each request alternates between two adapters of the same strength (seeds 7 and 8), so every pack
swaps: ``swap`` is the engine's own ``timings.swap_ms`` (the fused merge or restore, the slot copies,
and in auto mode emptying the other path), ``pack`` its ``total_ms`` without the resolve (adapters
are RAM-cached after the first round). The fused engine serves the weak adapter with
``fused_min_kept=0`` (its default would refuse it) to show what it costs and loses. One process,
medians of ``--runs`` packs per row, modes interleaved round by round (the machine's drift hits all
alike): ratios to read, never asserted. docs/benchmarks.md ("Adapter modes") has the result.

    .venv/bin/python bench/adapter_modes.py [--runs 5] [--pack 2] [--steps 4] [--out bench/results] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results

use_repo_compile_cache()

import torch  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402

allow_many_compiled_engines()

from hotlora import Engine  # noqa: E402
from hotlora.testing import controlled_lora, save_diffusers_lora, save_tiny_model  # noqa: E402

MODES = ("slots", "fused", "auto")
STRENGTHS = {"strong": 0.03, "weak": 0.001}
RANK = 16


def pack(engine, adapter, steps: int, n: int) -> tuple[float, float, str, float | None]:
    result = engine.generate("a portrait", adapters={"identity": (adapter, 1.0)}, num_images=n,
                             num_inference_steps=steps, seed=0, output_type="latent")
    entry = result.adapters["identity"]
    return (result.timings.total_ms - result.timings.resolve_ms, result.timings.swap_ms, entry["mode"],
            entry.get("fused_kept"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pack", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--families", default="flux,sdxl")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--no-compile", action="store_true", help="eager engines (minutes instead of an hour on 2 cores)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hotlora-modes-"))
    rows, data = [], []
    for family in args.families.split(","):
        model = save_tiny_model(root / family, family, target_rank=RANK)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            engines = {mode: Engine.from_pretrained(model, adapter_mode=mode, target_rank=RANK, batch_size=args.pack,
                                                    compile=not args.no_compile, dtype=dtype,
                                                    fused_min_kept=0.0 if mode == "fused" else 0.98)
                       for mode in MODES}
            # the plain model's Linear layers (the engines' denoisers carry LoRA layers of their own)
            plain = DiffusionPipeline.from_pretrained(str(model), local_files_only=True)
            denoiser = plain.transformer if family == "flux" else plain.unet
            adapters = {(strength, seed): save_diffusers_lora(
                            root / f"{family}-{dtype_name}-{strength}-{seed}", family,
                            controlled_lora(denoiser, magnitude, rank=RANK, seed=seed), rank=RANK, alpha=RANK)
                        for strength, magnitude in STRENGTHS.items() for seed in (7, 8)}
            samples: dict[tuple[str, str], list] = {}
            for strength in STRENGTHS:
                for mode, engine in engines.items():  # the first round: fetch, plans, packs (not timed)
                    for seed in (7, 8):
                        pack(engine, adapters[(strength, seed)], args.steps, args.pack)
                for run in range(args.runs):
                    for mode, engine in engines.items():
                        got = pack(engine, adapters[(strength, (7, 8)[run % 2])], args.steps, args.pack)
                        samples.setdefault((mode, strength), []).append(got)
            base_ms = {s: statistics.median(x[0] for x in samples[("slots", s)]) for s in STRENGTHS}
            for (mode, strength), got in samples.items():
                pack_ms, swap_ms = statistics.median(x[0] for x in got), statistics.median(x[1] for x in got)
                kept = got[-1][3]
                row = {"family": family, "dtype": dtype_name, "mode": mode, "adapter": strength,
                       "served": got[-1][2], "pack_ms": round(pack_ms, 1), "vs_slots": round(pack_ms / base_ms[strength], 2),
                       "swap_ms": round(swap_ms, 2), "fused_kept": kept,
                       "device_bytes": engines[mode].describe()["slot_bytes"], "recompiles": engines[mode].recompiles}
                data.append(row)
                rows.append([family, dtype_name, mode, strength, row["served"], f"{pack_ms:.1f}", f"{row['vs_slots']:.2f}",
                             f"{swap_ms:.2f}", "-" if kept is None else f"{kept:.4f}",
                             f"{row['device_bytes'] / 2**20:.1f}", row["recompiles"]])
            del engines
            # after each (family, dtype): a run cut short keeps what it measured
            table = markdown_table(["family", "dtype", "adapter_mode", "adapter", "served", "pack ms", "x slots",
                                    "swap ms", "fused_kept", "writer MiB", "recompiles"], rows)
            write_results(args.out, "adapter_modes", {"runs": args.runs, "pack": args.pack, "steps": args.steps,
                                                      "rows": data}, table,
                          f"`bench/adapter_modes.py --runs {args.runs} --pack {args.pack} --steps {args.steps}"
                          f"{' --no-compile' if args.no_compile else ''}`: {'eager' if args.no_compile else 'compiled'} "
                          "tiny models, every pack swaps (two adapters of one strength alternate); medians.")


if __name__ == "__main__":
    main()
