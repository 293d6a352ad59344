"""Peak memory per configuration, each in a fresh process (peak RSS; CUDA peak on a GPU).

Usage: .venv/bin/python bench/memory.py [--family flux] [--pack 6]
Writes bench/results/memory.{json,md}. The engine's held bytes are also checked exactly, against
the plain model plus its slots, by tests/integration/test_engine_options.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import json, resource, sys, torch
config, model, pack = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if config.get("plain"):
    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe("a portrait", num_images_per_prompt=pack, num_inference_steps=4, output_type="latent",
         height=config["size"], width=config["size"])
else:
    from hotlora import Engine
    from hotlora.engine.stepcache import StepCache
    options = {k: v for k, v in config.items() if k not in ("label", "size", "step_cache")}
    if config.get("step_cache"):
        options["step_cache"] = StepCache(threshold=0.9, warmup_steps=2)
    engine = Engine.from_pretrained(model, target_rank=8, batch_size=pack, **options)
    adapters = {"identity": (model + "/adapters/identity-diffusers", 1.0), "style": (model + "/adapters/style-diffusers", 0.8)}
    engine.generate("a portrait", adapters=adapters, num_images=pack, num_inference_steps=4, output_type="latent")
peak = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
if torch.cuda.is_available():
    peak["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
print(json.dumps(peak))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="flux")
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    from bench.harness import markdown_table, write_results
    from hotlora.testing import TINY_SIZE, save_tiny_model

    size = TINY_SIZE[args.family]
    configs = [
        {"label": "plain diffusers pipeline", "plain": True},
        {"label": "engine, eager", "compile": False},
        {"label": "engine, compiled", "compile": True},
        {"label": "engine, compiled, mixed batches", "compile": True, "mixed": True},
        {"label": "engine, compiled, step cache", "compile": True, "step_cache": True},
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / args.family, args.family)
        for config in configs:
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({**config, "size": size}), str(model),
                                   str(args.pack)], capture_output=True, text=True, timeout=900)
            result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-300:]}
            rows.append({"config": config["label"], **result})
            print(rows[-1], flush=True)
    table = markdown_table(["configuration", "peak RSS (MiB)"],
                           [[r["config"], r.get("peak_rss_mib", r.get("error"))] for r in rows])
    write_results(args.out, "memory", {"args": vars(args), "rows": rows}, table, str(vars(args)))


if __name__ == "__main__":
    main()
