"""The article's ablation table on our stack: where the per-pack time goes, lever by lever.

Usage: .venv/bin/python bench/ablation.py [--model DIR] [--family flux] [--height H --width W]
                                         [--pack 6] [--steps 4] [--runs 3] [--only LABEL ...]

Any local diffusers model directory works: the adapter pairs are built for its denoiser (random
weights over every Linear). ``--height/--width`` default to the model's hotlora.json, else its own.
The regime matters more than the model: the tiny model at 32x32 is launch-bound (kernel launches
and Python dominate), a model at thousands of tokens per image compute-bound; the ratios differ
between them and neither predicts a GPU.

Configurations (per-pack time; each request uses a different adapter pair, as in production):
  naive            plain diffusers, eager; per request load_lora_weights x2 + set_adapters,
                   images one at a time, unload_lora_weights
  + batched pack   the same, the whole pack in one call
  + compile        the same, regionally compiled (every load changes the model: it recompiles)
  + hot-swapped    hotlora's engine: compiled once, slots swapped in place, batched (the full engine)
  + fused          the same engine in fused mode: no LoRA layers, each request's pair merged into the weights
  + step cache     the full engine with cache-dit DBCache
  full - compile, full - batching   leave-one-out from the full engine
Plus the seed article's recipe run literally (enable_lora_hotswap, placeholders, set_adapters,
compile_repeated_blocks(fullgraph=True), hotswap loads + set_adapters per request) in a fresh
process: what breaks and the graph count per request.
Writes bench/results/ablation.{json,md}; ratios against naive from the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results,
)

use_repo_compile_cache()

import torch  # noqa: E402

PROMPT = "a portrait in watercolor"


def adapter_pairs(model: Path, count: int, rank: int) -> list[tuple[Path, Path]]:
    """``count`` distinct (identity, style) pairs in diffusers layout, saved next to the model."""
    from bench.harness import denoiser_layers
    from hotlora.testing import random_lora, save_diffusers_lora

    family, linears = denoiser_layers(model)  # from the config: no weights loaded
    out = Path(tempfile.mkdtemp(prefix="ablation-"))
    return [(save_diffusers_lora(out / f"id{i}", family, random_lora(linears, rank, 10 + i), rank, rank),
             save_diffusers_lora(out / f"st{i}", family, random_lora(linears, rank, 50 + i), rank, rank))
            for i in range(count)]


def plain_pipeline(model: Path, compiled: bool):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(model), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if compiled:
        denoiser = getattr(pipeline, "transformer", None) or pipeline.unet
        denoiser.compile_repeated_blocks(fullgraph=False)
    return pipeline


def naive_pack(pipeline, pair, pack: int, steps: int, batched: bool, size: dict) -> None:
    pipeline.load_lora_weights(str(pair[0]), adapter_name="identity")
    pipeline.load_lora_weights(str(pair[1]), adapter_name="style")
    pipeline.set_adapters(["identity", "style"], [1.0, 0.8])
    if batched:
        pipeline(PROMPT, num_images_per_prompt=pack, num_inference_steps=steps, output_type="latent",
                 generator=[torch.Generator().manual_seed(i) for i in range(pack)], **size)
    else:
        for i in range(pack):
            pipeline(PROMPT, num_images_per_prompt=1, num_inference_steps=steps, output_type="latent",
                     generator=torch.Generator().manual_seed(i), **size)
    pipeline.unload_lora_weights()


def measure(run_pack, pairs, runs: int) -> dict:
    from hotlora.engine.pipeline import graph_count

    times, graphs = [], graph_count()
    for i in range(runs):
        began = time.perf_counter()
        run_pack(pairs[i % len(pairs)])
        times.append((time.perf_counter() - began) * 1000)
    # The first request pays for whatever compiles; the median shows the steady state.
    return {"pack_ms": round(statistics.median(times), 1), "first_pack_ms": round(times[0], 1),
            "new_graphs": graph_count() - graphs}


def article_recipe(model: Path, pairs_json: str, rank: int, steps: int, pack: int) -> dict:
    """The seed article's recipe, literally, on this stack (fresh process: clean dynamo state)."""
    from diffusers import DiffusionPipeline

    from hotlora.engine.pipeline import graph_count

    pairs = json.loads(pairs_json)
    pipeline = DiffusionPipeline.from_pretrained(str(model), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    denoiser = getattr(pipeline, "transformer", None) or pipeline.unet
    report = {"requests": []}
    pipeline.enable_lora_hotswap(target_rank=rank)
    pipeline.load_lora_weights(pairs[0][1], adapter_name="style_lora")
    pipeline.load_lora_weights(pairs[0][0], adapter_name="avatar_lora")
    pipeline.set_adapters(["avatar_lora", "style_lora"], [1.0, 0.8])
    denoiser.compile_repeated_blocks(fullgraph=True, dynamic=True)
    pipeline(PROMPT, num_images_per_prompt=pack, num_inference_steps=steps, output_type="latent")
    report["graphs_after_warmup"] = graph_count()
    for i, (identity, style) in enumerate(pairs[1:] + pairs[:1]):
        entry = {"request": i + 1}
        try:
            pipeline.load_lora_weights(identity, hotswap=True, adapter_name="avatar_lora")
            pipeline.load_lora_weights(style, hotswap=True, adapter_name="style_lora")
            pipeline.set_adapters(["avatar_lora", "style_lora"], [1.0, 0.5 + 0.1 * i])  # each style its own scale
            pipeline(PROMPT, num_images_per_prompt=pack, num_inference_steps=steps, output_type="latent")
            entry["ok"] = True
        except Exception as exc:  # what breaks is the finding
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        entry["graphs"] = graph_count()
        report["requests"].append(entry)
        if not entry["ok"]:
            break
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--family", default="flux")
    parser.add_argument("--height", type=int, help="default: the model's hotlora.json, else the pipeline's")
    parser.add_argument("--width", type=int)
    parser.add_argument("--only", nargs="+", metavar="LABEL",
                        help="run only the rows whose label starts with one of these (naive always runs: the "
                             "ratios are against it), e.g. --only '+ hot' '+ fused'; skips the article recipe")
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--cache-threshold", type=float, default=0.9,
                        help="random-weight models need a high threshold for the step cache to skip anything")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--article-only", nargs=2, metavar=("MODEL", "PAIRS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.article_only:
        print(json.dumps(article_recipe(Path(args.article_only[0]), args.article_only[1], args.rank, args.steps, args.pack)))
        return

    from hotlora import Engine
    from hotlora.testing import save_tiny_model

    tmp = tempfile.mkdtemp()
    model = Path(args.model) if args.model else save_tiny_model(Path(tmp) / args.family, args.family)
    pairs = adapter_pairs(model, max(3, args.runs), args.rank)
    article = {"error": "skipped (--only)"} if args.only else None
    done = None if args.only else subprocess.run([sys.executable, __file__, "--rank", str(args.rank), "--steps", str(args.steps), "--pack",
                           str(args.pack), "--article-only", str(model), json.dumps([[str(a), str(b)] for a, b in pairs])],
                          capture_output=True, text=True, timeout=1800)
    if done is not None:
        article = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-500:]}

    # From here several compiled models share block code objects in one process.
    torch._dynamo.reset()
    allow_many_compiled_engines()
    rows = {}
    eager = plain_pipeline(model, compiled=False)
    defaults = json.loads((model / "hotlora.json").read_text()) if (model / "hotlora.json").is_file() else {}
    size = {k: defaults[k] for k in ("height", "width") if k in defaults}
    size.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v})

    def wanted(label: str) -> bool:
        return not args.only or label == "naive" or any(label.startswith(prefix) for prefix in args.only)

    rows["naive"] = measure(lambda p: naive_pack(eager, p, args.pack, args.steps, False, size), pairs, args.runs)
    if wanted("+ batched pack"):
        rows["+ batched pack"] = measure(lambda p: naive_pack(eager, p, args.pack, args.steps, True, size), pairs,
                                         args.runs)
    if wanted("+ compile"):
        compiled = plain_pipeline(model, compiled=True)
        rows["+ compile (adapters reloaded)"] = measure(
            lambda p: naive_pack(compiled, p, args.pack, args.steps, True, size), pairs, args.runs)

    def engine_pack(engine):
        return lambda p: engine.generate(PROMPT, adapters={"identity": (str(p[0]), 1.0), "style": (str(p[1]), 0.8)},
                                         num_images=args.pack, num_inference_steps=args.steps, output_type="latent")

    from hotlora.engine.stepcache import StepCache

    for label, kwargs in (("+ hot-swapped slots (full engine)", {}),
                          ("+ fused (adapters merged into the weights)", {"adapter_mode": "fused"}),
                          (f"+ step cache (dbcache {args.cache_threshold})",
                           {"step_cache": StepCache(threshold=args.cache_threshold, warmup_steps=2)}),
                          ("full - compile", {"compile": False}), ("full - batching", {"batch_size": 1}),
                          # the chunk size measured at warm-up (issue: choose the batch by measurement)
                          ("full, batch auto", {"batch_size": "auto", "max_batch_size": args.pack})):
        if not wanted(label):
            continue
        options = {"target_rank": args.rank, "batch_size": args.pack, "compile": True, **size, **kwargs}
        began = time.perf_counter()
        engine = Engine.from_pretrained(model, **options)
        ready_s = time.perf_counter() - began
        rows[label] = {**measure(engine_pack(engine), pairs, args.runs), "ready_s": round(ready_s, 1),
                       "recompiles": engine.recompiles, "chunks": engine.chunks}
    base = rows["naive"]["pack_ms"]
    for row in rows.values():
        row["speedup_vs_naive"] = round(base / row["pack_ms"], 2)
    lines = [markdown_table(
        ["configuration", "pack ms (median)", "speedup vs naive", "first request ms", "new graphs during the runs"],
        [[k, v["pack_ms"], f"{v['speedup_vs_naive']}x", v["first_pack_ms"], v["new_graphs"]] for k, v in rows.items()])]
    lines += ["", "Article recipe, literally:", ""]
    if "requests" in article:
        lines.append(f"- graphs after warm-up: {article['graphs_after_warmup']}")
        lines += [f"- request {r['request']}: {'ok' if r['ok'] else r['error']}, graphs {r['graphs']}" for r in article["requests"]]
    else:
        lines.append(f"- could not run: {article['error']}")
    write_results(args.out, "ablation", {"args": vars(args), "rows": rows, "article_recipe": article},
                  "\n".join(lines), str(vars(args)))


if __name__ == "__main__":
    main()
