"""Many sizes from one warm engine: dynamic size dimensions against an engine compiled for one size.

Usage: .venv/bin/python bench/sizes.py [--families flux,sdxl] [--batch 2] [--steps 4] [--rounds 7]
           [--modes dynamic,static] [--sizes WxH,...] [--warm-cache] [--out bench/results] [--name sizes]
       full-size Flux on a GPU (bench/gpu.sh runs it): add --full-flux [--layers N --single-layers M]

Per family, these engines, each warm in its own process; by default each is built with an EMPTY
inductor cache of its own, so the warm-up times are cold compiles and comparable. Separate
processes also keep the engines' graphs apart: engines in one process share the blocks' code
objects, and dynamo's automatic dynamic shapes would turn a "static" engine dynamic once a dynamic
one had run there.

* ``alone``: an engine compiled for one size only (today's single-size engine), one per size: the
  speed a size would have if it were the only one. The baseline of every ratio.
* ``dynamic``: one engine serving every size, the sequence (Flux) / spatial (SDXL) dimensions
  turned dynamic at warm-up (dynamo's automatic dynamic shapes, duck shaping off);
* ``static``: one engine serving every size with one static graph per size and batch shape
  (``torch.compile(dynamic=False)``);
* ``twin``: a second ``alone`` engine for the first size, the control: twin / alone is what two
  identical engines in two processes differ by (process-to-process noise; 1.0 on a perfect machine).

Once all of a family's engines are warm, every size's pack (``--batch`` images in one batch,
``--steps`` steps; the engine's own generate time) is timed on every engine that serves it, round
after round, in a shuffled order each round, so drift and other load hit them alike. Reported per
size: each engine's median pack time, and its ratio to ``alone`` as the median of the per-round
ratios with their interquartile range (the noise). The goal for ``dynamic`` is <= 1.05x: "met" when
the upper quartile is at most 1.05, "missed" when the lower quartile is above it, else "within
noise". Also per engine: dynamo graphs compiled and warm-up seconds. Writes ``--out/--name``.{json,md}.

``--full-flux`` builds the real Flux transformer blocks (width 3072, 24 heads) with random bf16
weights in memory (bench/gpu_flux.py's ``build_full_flux``; no download), ``--layers`` +
``--single-layers`` of them: every block of a type runs the same compiled graph, so fewer blocks
give the same ratio, and several engines fit on one GPU at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = {  # WIDTHxHEIGHT; distinct sequence lengths (Flux) and latent shapes (SDXL), three aspect ratios
    "flux": ["32x32", "48x32", "32x64"],
    "sdxl": ["64x64", "96x64", "64x128"],
}
GOAL = 1.05  # dynamic over alone, per size (issue 16)
MARK = "@@sizes "  # protocol lines on a child's stdout; anything else printed there is ignored
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- child: one warm engine


def serve(spec: dict) -> None:
    """In a fresh process: build and warm one engine, say so, then time one pack per stdin line."""
    import torch

    from hotlora.config import parse_size
    from hotlora.engine.pipeline import graph_count

    engine = build_engine(spec)
    say({"graphs": graph_count(), "warmup_s": round(engine.warmup_s, 1), "dynamic_sizes": engine.dynamic_sizes})
    torch._dynamo.config.error_on_recompile = True  # a pack that compiles would time the compiler
    for line in sys.stdin:
        height, width = parse_size(json.loads(line)["size"])
        result = engine.generate("a cat", num_images=spec["batch"], num_inference_steps=spec["steps"],
                                 height=height, width=width, output_type="latent")
        say({"pack_ms": round(sum(result.timings.generate_ms), 2), "recompiles": engine.recompiles})


def build_engine(spec: dict):
    from hotlora import Engine
    from hotlora.families import family_named

    # An instance attribute over the family's declared ``dynamic_sizes``: this process builds one engine.
    family_named(spec["family"]).dynamic_sizes = spec["mode"] != "static"
    options = {"target_rank": 8, "batch_size": spec["batch"], "compile": spec["compile"], "sizes": spec["sizes"]}
    if not spec.get("full"):
        return Engine.from_pretrained(spec["model"], **options)
    from bench.gpu_flux import _record_finite, build_full_flux

    pipeline = build_full_flux(**spec["full"], device=spec["device"])
    pipeline.set_progress_bar_config(disable=True)
    engine = Engine(pipeline, family_named("flux"), **options)
    _record_finite(engine)  # random weights may overflow: the figures wanted here are times
    return engine


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


class Child:
    """A warm engine in its own process, answering one timed pack per request."""

    def __init__(self, label: str, spec: dict, tmp: Path, warm_cache: bool):
        self.label, self.sizes, self.recompiles = label, spec["sizes"], None
        env = dict(os.environ)
        if not warm_cache:  # an empty cache of its own: a cold compile, nothing shared with the others
            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp, prefix="inductor-")
        self.log = tempfile.TemporaryFile("w+", dir=tmp)
        # -m from the repository root: the child imports bench.gpu_flux for --full-flux.
        self.process = subprocess.Popen([sys.executable, "-m", "bench.sizes", "--child", json.dumps(spec)], cwd=REPO,
                                        env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log)
        self.ready = self._read()  # blocks until warm, so builds run one at a time, uncontended

    def pack_ms(self, size: str) -> float:
        self.process.stdin.write(json.dumps({"size": size}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        self.recompiles = answer["recompiles"]
        return answer["pack_ms"]

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.log.seek(0)
        raise SystemExit(f"engine {self.label} stopped:\n{self.log.read()[-4000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        self.log.close()


# ---------------------------------------------------------------------------- parent: side by side


def build(family: str, sizes: list[str], base: dict, args, tmp: Path, engines: dict[str, Child]) -> None:
    """Into ``engines``: the family's engines, warm (``alone SIZE`` per size, the twin, then every mode
    over all sizes), added as each becomes ready so the caller can stop the ones built before a failure."""
    for size in sizes:
        engines[f"alone {size}"] = Child(f"alone {size}", {**base, "mode": "alone", "sizes": [size]}, tmp,
                                         args.warm_cache)
    engines["twin"] = Child("twin", {**base, "mode": "alone", "sizes": sizes[:1]}, tmp, args.warm_cache)
    for mode in modes_of(args):
        engines[mode] = Child(mode, {**base, "mode": mode, "sizes": sizes}, tmp, args.warm_cache)


def interleaved(engines: dict[str, Child], sizes: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per engine and size, one pack time per round; within a round the order is shuffled."""
    rng = random.Random(0)
    for child in engines.values():  # one untimed pack per size first: a shape's first call pages things in
        for size in child.sizes:
            child.pack_ms(size)
    times: dict[str, dict[str, list[float]]] = {label: {s: [] for s in c.sizes} for label, c in engines.items()}
    for _ in range(rounds):
        for size in sizes:
            serving = [label for label, child in engines.items() if size in child.sizes]
            rng.shuffle(serving)
            for label in serving:
                times[label][size].append(engines[label].pack_ms(size))
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def verdict(q1: float, q3: float) -> str:
    if q3 <= GOAL:
        return "met"
    return "missed" if q1 > GOAL else "within noise"


def compare(times: dict, modes: list[str], sizes: list[str]) -> dict:
    """Per size and mode: median pack ms, and the per-round ratios to that size's alone engine."""
    out = {}
    for size in sizes:
        alone = times[f"alone {size}"][size]
        row = {"alone_ms": round(statistics.median(alone), 2), "alone_ms_range": [min(alone), max(alone)]}
        for mode in [*modes, "twin"]:
            if size not in times.get(mode, {}):
                continue
            ratios = [mine / base for mine, base in zip(times[mode][size], alone)]
            q1, median, q3 = quartiles(ratios)
            row[mode] = {"ms": round(statistics.median(times[mode][size]), 2), "ratio": round(median, 3),
                         "ratio_iqr": [round(q1, 3), round(q3, 3)], "ratios": [round(r, 3) for r in ratios]}
            if mode == "dynamic":
                row[mode]["goal"] = verdict(q1, q3)
        out[size] = row
    return out


def run_family(family: str, sizes: list[str], base: dict, args, tmp: Path) -> dict:
    engines: dict[str, Child] = {}
    try:
        build(family, sizes, base, args, tmp, engines)
        times = interleaved(engines, sizes, args.rounds)
    finally:
        for child in engines.values():
            child.close()
    return {"sizes": sizes, "pack_ms": times, "per_size": compare(times, modes_of(args), sizes),
            "engines": {label: {**c.ready, "sizes": c.sizes, "recompiles": c.recompiles}
                        for label, c in engines.items()}}


def modes_of(args) -> list[str]:
    return [m for m in args.modes.split(",") if m]


def tables(data: dict, modes: list[str]) -> str:
    from hotlora.benchmarking import markdown_table

    speed, warm = [], []
    for family, result in data["families"].items():
        for size, row in result["per_size"].items():
            cells = [family, size, row["alone_ms"]]
            for mode in [*modes, "twin"]:
                r = row.get(mode)
                cells += [r["ms"], f"{r['ratio']:.3f}x ({r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f})"] if r \
                    else ["", ""]
            speed.append([*cells, row["dynamic"]["goal"] if "dynamic" in modes else ""])
        for label, engine in result["engines"].items():
            warm.append([family, label, len(engine["sizes"]), engine["graphs"], engine["warmup_s"],
                         engine["recompiles"]])
    headers = ["family", "size", "alone: pack ms"]
    for mode in [*modes, "twin"]:
        headers += [f"{mode}: pack ms", f"{mode} / alone (IQR)"]
    headers.append(f"dynamic: goal <= {GOAL}x")
    warm_headers = ["family", "engine", "sizes", "graphs compiled", "warm-up s", "recompiles after warm-up"]
    return markdown_table(headers, speed) + "\n\n" + markdown_table(warm_headers, warm)


def describe(args, data: dict) -> str:
    sizes = "; ".join(f"{f}: {', '.join(r['sizes'])}" for f, r in data["families"].items())
    model = (f"Full-size Flux blocks ({args.layers} + {args.single_layers}, {args.heads} heads), random bf16 "
             f"weights, on {args.device}" if args.full_flux else "Tiny models")
    cache = ("one inductor cache (TORCHINDUCTOR_CACHE_DIR), shared: later engines reuse earlier ones' kernels, so "
             "the warm-up seconds are not cold compiles" if args.warm_cache else "an empty inductor cache each")
    return (f"Command: `{' '.join(['python', 'bench/sizes.py', *sys.argv[1:]])}`. {model}"
            f"{'' if args.compile else ', eager (a dry run: the ratios mean nothing)'}. Sizes (WIDTHxHEIGHT) "
            f"{sizes}. A pack is {args.batch} images in one batch at {args.steps} steps (the engine's generate "
            f"time). {args.rounds} rounds, each timing every engine at every size it serves in a shuffled order; "
            f"the ratio is the median of the per-round ratios to the engine compiled for that size alone, "
            f"with their interquartile range in brackets (the noise). Every engine warm in its own process, "
            f"built one after another with {cache}.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="flux,sdxl")
    parser.add_argument("--sizes", help="WIDTHxHEIGHT,... for every family (default: three per family)")
    parser.add_argument("--batch", type=int, default=2, help="compiled batch limit; a timed pack is one full batch")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of a timed pack")
    parser.add_argument("--rounds", type=int, default=7, help="timed packs per engine and size, interleaved")
    parser.add_argument("--modes", default="dynamic,static", help="engines over every size, timed against alone")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use this environment's inductor cache (faster; warm-up times are then not cold)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager engines (a dry run)")
    parser.add_argument("--full-flux", action="store_true", help="the real Flux blocks, random weights (GPU)")
    parser.add_argument("--layers", type=int, default=19)
    parser.add_argument("--single-layers", type=int, default=38)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--text-width", type=int, default=4096)
    parser.add_argument("--device", default="cuda", help="--full-flux only (cpu: a dry run)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="sizes", help="results file name")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve(json.loads(args.child))
        return
    from hotlora.benchmarking import write_results
    from hotlora.testing import save_tiny_model

    families = ["flux"] if args.full_flux else args.families.split(",")
    data = {"args": vars(args), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in families:
            sizes = args.sizes.split(",") if args.sizes else SIZES[family]
            base = {"family": family, "batch": args.batch, "steps": args.steps, "compile": args.compile}
            if args.full_flux:
                base |= {"device": args.device, "full": {"layers": args.layers, "single_layers": args.single_layers,
                                                         "heads": args.heads, "text_width": args.text_width}}
            else:
                base["model"] = str(save_tiny_model(tmp / family, family, target_rank=8))
            data["families"][family] = run_family(family, sizes, base, args, tmp)
    write_results(args.out, args.name, data, tables(data, modes_of(args)), describe(args, data))


if __name__ == "__main__":
    main()
