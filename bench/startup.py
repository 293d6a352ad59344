"""Process start to ready, with and without the compile artifacts of an earlier process.

Usage: .venv/bin/python bench/startup.py [--family flux] [--runs 2]
Each start is a fresh process with an EMPTY inductor cache directory, so the only thing carried
over is the artifacts file (what a new worker on a shared volume would have). Writes
bench/results/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = """
import sys
from hotlora import Engine
Engine.from_pretrained(sys.argv[1], target_rank=8, batch_size=int(sys.argv[3]), compile=True, compile_cache_dir=sys.argv[2])
"""


def start(model: Path, artifacts: Path, inductor: Path, batch: int) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(model), str(artifacts), str(batch)], check=True, env=env,
                   capture_output=True, timeout=1200)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="flux")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    from bench.harness import markdown_table, write_results
    from hotlora.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_tiny_model(tmp / args.family, args.family)
        cold, warm = [], []
        for run in range(args.runs):
            artifacts = tmp / f"artifacts-{run}"
            cold.append(start(model, artifacts, tmp / f"inductor-cold-{run}", args.batch))  # saves artifacts
            warm.append(start(model, artifacts, tmp / f"inductor-warm-{run}", args.batch))  # loads them
    row = {"without_artifacts_s": round(statistics.median(cold), 1), "with_artifacts_s": round(statistics.median(warm), 1)}
    row["speedup"] = round(row["without_artifacts_s"] / row["with_artifacts_s"], 2)
    table = markdown_table(["start to ready, empty inductor cache", "seconds"],
                           [["without compile artifacts", row["without_artifacts_s"]],
                            ["with the artifacts of an earlier process", row["with_artifacts_s"]],
                            ["ratio", f"{row['speedup']}x"]])
    write_results(args.out, "startup", {"args": vars(args), "row": row}, table, str(vars(args)))


if __name__ == "__main__":
    main()
