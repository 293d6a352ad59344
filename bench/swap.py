"""Swap cost against the memory-copy limit, and the steady-state cost of carrying adapter slots.

Usage: .venv/bin/python bench/swap.py [--family flux] [--model DIR] [--height H --width W]
                                     [--target-rank 16] [--pack 6] [--runs 5] [--fused-only]

Any local diffusers model directory works (``--model``): the adapters are built for its denoiser
(random weights over every Linear, ``bench.harness.bench_adapters``), and ``--height`` /
``--width`` set the image size (default: the model's). Say which regime a run is in: the tiny
model at 32x32 is launch-bound (kernel launches and Python), a model at thousands of tokens per
image compute-bound; neither predicts a GPU.

1. For ranks 1..target: time to swap both slots from RAM-cached adapters (every ceiling module,
   packed for the slots as the resolver packs them) against one plain ``copy_`` of the same number
   of bytes on the same device. Target: <= 1.5x. On the tiny model, then on real-width Flux
   blocks (``--full-width-rank``), where the adapters are megabytes.
2. Compiled generation of one pack with both slots filled, against the same model compiled with
   no adapter slots at all: the full ceiling with full-rank and quarter-rank requests, the same
   with rank buckets, and an attention-only ceiling. Target: < 10%.
3. Fused mode: the merge of a pair of adapters on every Linear against a plain ``copy_`` of the
   touched weights' bytes, and its pack time next to no slots and slots (``--fused-only`` runs
   just these and writes swap-fused.{json,md}).
Writes bench/results/swap.{json,md}. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    allow_many_compiled_engines, markdown_table, use_repo_compile_cache, write_results,
)
from hotlora.adapters.binding import Binding  # noqa: E402

use_repo_compile_cache()

import torch  # noqa: E402

allow_many_compiled_engines()


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` (synchronised on CUDA)."""
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


def swap_rows(engine, target_rank: int, repeats: int, ranks=None) -> list[dict]:
    """Both slots swapped at each of ``ranks`` (default 1, 2, 4, ... target_rank) against a copy_ of their bytes."""
    from hotlora.adapters.format.convert import Adapter, LoraWeights
    from hotlora.testing import random_lora

    # The packed layout's modules: those a model keeps in another dtype (Wan's float32 time embedder
    # in bf16) are written module by module, which is not the path measured here.
    apart = set(getattr(engine.writer, "apart", ()))
    linears = {m: shape for m, shape in engine.ceiling.modules.items() if m not in apart}
    device = next(engine.denoiser.parameters()).device
    dtype = next(engine.denoiser.parameters()).dtype
    rows = []
    for rank in ranks or [2 ** i for i in range(target_rank.bit_length()) if 2 ** i <= target_rank]:
        pair = []
        for seed in (1, 2):
            sd = random_lora(linears, rank, seed=seed)
            modules = {m: LoraWeights(sd[f"{m}.lora_A.weight"].to(dtype), sd[f"{m}.lora_B.weight"].to(dtype), 1.0)
                       for m in linears}
            adapter = Adapter(f"r{rank}-{seed}", engine.family.name, "diffusers", modules, sha256=f"{rank}-{seed}")
            if device.type == "cuda":
                modules = {m: LoraWeights(w.down.pin_memory(), w.up.pin_memory(), 1.0) for m, w in modules.items()}
                adapter = Adapter(adapter.name, adapter.family, "diffusers", modules, sha256=adapter.sha256)
            engine.writer.prepare({"identity": Binding(adapter, 1.0)})  # what Engine.prepare does on a request's thread
            pair.append(adapter)
        state = {"i": 0}

        def swap():
            state["i"] += 1
            a, b = (pair[0], pair[1]) if state["i"] % 2 else (pair[1], pair[0])
            report = engine.writer.swap({"identity": Binding(a, 0.9), "style": Binding(b, 0.7)})
            assert report.packed_writes == 2, "the bench measures the packed path"

        nbytes = 2 * pair[0].nbytes  # both slots
        # Two sources, alternated like the swap's two adapters: the same bytes, the same working
        # set, so neither side gets a cache the other does not.
        sources = [torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def copy():
            state["i"] += 1
            target.copy_(sources[state["i"] % 2], non_blocking=True)

        swap_ms = timed(swap, repeats)
        copy_ms = timed(copy, repeats)
        rows.append({"rank": rank, "bytes": nbytes, "swap_ms": round(swap_ms, 3), "copy_ms": round(copy_ms, 3),
                     "swap_over_copy": round(swap_ms / copy_ms, 2)})
    return rows


def fused_swap_rows(model: Path, ranks, repeats: int, restore: str = "auto") -> list[dict]:
    """Fused mode: time to merge a pair of adapters on every Linear (alternating two pairs, so every
    swap restores and re-merges every layer) against one plain ``copy_`` of the touched weights'
    bytes on the device (what a swap must at least write). Eager engine: a swap never runs the model.
    ``restore``: where the pristine weights live ("host": copied over to the weights on every swap)."""
    from hotlora import Engine
    from hotlora.adapters.format.convert import Adapter, LoraWeights
    from hotlora.testing import random_lora

    engine = Engine.from_pretrained(model, adapter_mode="fused", fused_restore=restore, batch_size=1, compile=False)
    linears = dict(engine.ceiling.modules)
    device = next(engine.denoiser.parameters()).device
    rows = []
    for rank in ranks:
        pairs = []
        for seed in (1, 2, 3, 4):
            sd = random_lora(linears, rank, seed=seed)
            modules = {m: LoraWeights(sd[f"{m}.lora_A.weight"], sd[f"{m}.lora_B.weight"], 1.0) for m in linears}
            pairs.append(Adapter(f"r{rank}-{seed}", engine.family.name, "diffusers", modules, sha256=f"{rank}-{seed}"))
        requests = [{"identity": Binding(pairs[0], 0.9), "style": Binding(pairs[1], 0.7)},
                    {"identity": Binding(pairs[2], 0.9), "style": Binding(pairs[3], 0.7)}]
        for request in requests:
            engine.writer.prepare(request)  # what Engine.prepare does on a request's thread
        state = {"i": 0}

        def swap():
            state["i"] += 1
            engine.writer.swap(requests[state["i"] % 2])

        weights = [engine.denoiser.get_submodule(m).weight for m in linears]
        nbytes = sum(w.nbytes for w in weights)
        # The copy from where W0 lives: device memory, or (host restore) pinned host memory.
        host = engine.writer.restore == "host"
        sources = [torch.ones(nbytes, dtype=torch.uint8, device="cpu" if host else device,
                              pin_memory=host and device.type == "cuda") for _ in range(2)]
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def copy():
            state["i"] += 1
            target.copy_(sources[state["i"] % 2])

        swap_ms, copy_ms = timed(swap, repeats), timed(copy, repeats)
        rows.append({"rank": f"2 x r{rank}", "modules": len(linears), "bytes": nbytes, "restore": engine.writer.restore,
                     "swap_ms": round(swap_ms, 3), "copy_ms": round(copy_ms, 3),
                     "swap_over_copy": round(swap_ms / copy_ms, 2), "pristine_bytes": engine.writer.pristine_bytes})
    engine.writer.swap({})
    return rows


def full_width_pipeline():
    """Real Flux blocks (width 3072, one double and one single block, random weights built in
    memory) in the engine's dtype for this device: an adapter over them is megabytes."""
    from bench.gpu_flux import build_full_flux
    from hotlora.engine.device import default_device, default_dtype

    device = default_device()
    return build_full_flux(1, 1, device).to(default_dtype(device))


def with_own_transformer(base):
    """A pipeline sharing ``base``'s encoders and VAE, with its own copy of the transformer (the
    engine adds slots to it)."""
    import copy

    from diffusers import FluxPipeline

    pipeline = FluxPipeline(**{**base.components, "transformer": copy.deepcopy(base.transformer)})
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def full_width_rows(base, target_rank: int, repeats: int) -> list[dict]:
    """The swap rows on real-width Flux blocks."""
    from hotlora import Engine
    from hotlora.families import family_named

    engine = Engine(with_own_transformer(base), family_named("flux"), target_rank=target_rank, batch_size=1,
                    compile=False, height=64, width=64, defaults={"num_inference_steps": 1})
    return swap_rows(engine, target_rank, repeats)


def full_width_overhead_rows(base, target_rank: int, runs: int) -> list[dict]:
    """The steady-state cost on real-width Flux blocks (one double, one single, width 3072; 64x64
    images, so ~530 tokens with the text): slots on every Linear with full-rank and quarter-rank
    adapters, the same with a rank bucket, attention only, against no slots. One set of weights,
    a copy of the transformer per engine, runs interleaved."""
    from bench.gpu_rows import adapters as _adapters
    from hotlora import Engine
    from hotlora.families import family_named

    low = max(1, target_rank // 4)
    configs = [  # (label, engine options, adapter rank)
        ("no slots", {"slots": ()}, 0),
        # Explicit: no rank buckets (the default adds 0 and rank/4), so each row measures what it names.
        ("2 slots, every Linear", {"rank_buckets": ()}, target_rank),
        ("2 slots, every Linear", {"rank_buckets": ()}, low),
        (f"2 slots, every Linear, rank bucket {low}", {"rank_buckets": (low,)}, low),
        ("2 slots, attention only", {"target_modules": r".*attn.*", "rank_buckets": ()}, target_rank),
    ]
    engines, requests = {}, {}
    for label, options, rank in configs:
        if label not in engines:
            engines[label] = Engine(with_own_transformer(base), family_named("flux"), target_rank=target_rank, batch_size=2, height=64,
                                    width=64, defaults={"num_inference_steps": 2}, **options)
        if rank:
            requests[(label, rank)] = dict(zip(("identity", "style"), ((a, 0.8) for a in _adapters(engines[label], rank))))
    samples = {(label, rank): [] for label, _, rank in configs}
    buckets_run = {}
    for _ in range(runs):
        for label, _, rank in configs:
            result = engines[label].generate("a portrait", adapters=requests.get((label, rank), {}), num_images=2,
                                             num_inference_steps=2, output_type="latent")
            samples[(label, rank)].append(sum(result.timings.generate_ms))
            buckets_run[(label, rank)] = result.swap.rank_bucket if rank else "-"
    base_ms = statistics.median(samples[("no slots", 0)])
    return [{"config": label, "request": f"2 x r{rank}" if rank else "-", "rank_bucket": buckets_run[(label, rank)],
             "pack_ms": round(statistics.median(v), 1), "overhead_pct": round(100 * (statistics.median(v) / base_ms - 1), 1),
             "slot_bytes": engines[label].writer.nbytes, "recompiles": engines[label].recompiles}
            for (label, rank), v in samples.items()]


def overhead_rows(model: Path, target_rank: int, pack: int, steps: int, runs: int, fused_only: bool = False,
                  size: dict | None = None) -> list[dict]:
    """Compiled pack time against the same model with no slots: the full ceiling with a request
    that needs the full rank and one that needs a quarter of it, the same with rank buckets, and
    an attention-only ceiling. ``size``: height and width (default: the model's)."""
    from hotlora import Engine
    from bench.harness import bench_adapters

    low = max(1, target_rank // 4)
    adapters = bench_adapters(model, target_rank, tempfile.mkdtemp(prefix="swap-adapters-"))  # for this model
    requests = {
        f"r{low} + r{target_rank}": {"identity": (adapters["identity"], 1.0), "style": (adapters["style"], 0.8)},
        f"r{low} + r{low}": {"identity": (adapters["identity"], 1.0), "style": (adapters["style-low"], 0.8)},
    }
    full, small = requests
    buckets = tuple(sorted({low, target_rank // 2}))
    configs = [  # (label, engine options, request)
        ("no slots", {"slots": ()}, None),
        ("2 slots, every Linear", {"rank_buckets": ()}, full),  # explicit: no buckets (the default has some)
        ("2 slots, every Linear", {"rank_buckets": ()}, small),
        (f"2 slots, every Linear, rank buckets {','.join(map(str, buckets))}", {"rank_buckets": buckets}, small),
        ("2 slots, attention only", {"target_modules": r".*attn.*", "rank_buckets": ()}, full),
        ("fused (adapters merged into the weights)", {"adapter_mode": "fused"}, full),
    ]
    if fused_only:
        configs = [c for c in configs if c[0] in ("no slots", "2 slots, every Linear", "fused (adapters merged into the weights)")]
    engines = {}
    for label, options, _ in configs:
        if label not in engines:
            engines[label] = Engine.from_pretrained(model, target_rank=target_rank, batch_size=pack, **(size or {}),
                                                    **options)
    loaded = {}  # read and converted once per configuration, like the RAM cache would
    for label, _, request in configs:
        engine = engines[label]
        adapters_here = {}
        if request is not None:
            adapters_here = {slot: (engine.load_adapter(str(path)), scale)
                             for slot, (path, scale) in requests[request].items()}
        if label.endswith("attention only"):  # keep only what the narrower ceiling holds
            adapters_here = {slot: (_restrict(a, engine.ceiling.modules), s) for slot, (a, s) in adapters_here.items()}
        loaded[(label, request)] = adapters_here
    samples = {(label, request): [] for label, _, request in configs}
    buckets_run = {}
    for _ in range(runs):  # interleaved, so every configuration sees the same machine noise
        for label, _, request in configs:
            result = engines[label].generate("a portrait", adapters=loaded[(label, request)], num_images=pack,
                                             num_inference_steps=steps, output_type="latent")
            samples[(label, request)].append(sum(result.timings.generate_ms))
            buckets_run[(label, request)] = result.swap.rank_bucket
    base = statistics.median(samples[("no slots", None)])
    return [{"config": label, "request": request or "-", "rank_bucket": buckets_run[(label, request)],
             "pack_ms": round(statistics.median(v), 1), "overhead_pct": round(100 * (statistics.median(v) / base - 1), 1),
             "slot_bytes": engines[label].writer.nbytes, "recompiles": engines[label].recompiles}
            for (label, request), v in samples.items()]


def _restrict(adapter, modules):
    from hotlora.adapters.format.convert import Adapter

    kept = {m: w for m, w in adapter.modules.items() if m in modules}
    return Adapter(adapter.name, adapter.family, adapter.layout, kept, adapter.sha256 + "-attn", adapter.base_model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="flux")
    parser.add_argument("--target-rank", type=int, default=16)
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", help="a local model directory (default: a tiny model built now); adapters "
                        "are built for it")
    parser.add_argument("--height", type=int, help="image height of the pack rows (default: the model's)")
    parser.add_argument("--width", type=int, help="image width of the pack rows (default: the model's)")
    parser.add_argument("--restore", nargs="+", default=["auto", "host"], choices=["auto", "device", "host"],
                        help="fused mode's pristine-weight sources to time the swap with")
    parser.add_argument("--full-width-rank", type=int, default=64,
                        help="target rank of the swap rows on full-width Flux blocks (0: skip them)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--fused-only", action="store_true",
                        help="only the fused rows (swap vs copy; pack time: no slots, slots, fused): swap-fused.{json,md}")
    args = parser.parse_args()
    from hotlora import Engine
    from hotlora.testing import save_tiny_model

    size = {k: v for k, v in (("height", args.height), ("width", args.width)) if v}
    fused_ranks = (args.target_rank, 2 * args.target_rank, 8 * args.target_rank)

    if args.fused_only:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(args.model) if args.model else save_tiny_model(Path(tmp) / args.family, args.family,
                                                                       target_rank=args.target_rank)
            fused = [row for restore in args.restore
                     for row in fused_swap_rows(model, fused_ranks, repeats=max(20, args.runs), restore=restore)]
            overhead = overhead_rows(model, args.target_rank, args.pack, args.steps, args.runs, fused_only=True,
                                     size=size)
        write_fused_results(args, fused, overhead)
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else save_tiny_model(Path(tmp) / args.family, args.family,
                                                                   target_rank=args.target_rank)
        engine = Engine.from_pretrained(model, target_rank=args.target_rank, batch_size=args.pack)
        swaps = swap_rows(engine, args.target_rank, repeats=max(20, args.runs))
        overhead = overhead_rows(model, args.target_rank, args.pack, args.steps, args.runs, size=size)
        fused = [row for restore in args.restore
                 for row in fused_swap_rows(model, fused_ranks[:2], repeats=max(20, args.runs), restore=restore)]
        del engine
    wide, wide_overhead = [], []
    if args.full_width_rank:
        base = full_width_pipeline()  # built once; each engine gets its own copy of the transformer
        wide = full_width_rows(base, args.full_width_rank, repeats=max(20, args.runs))
        wide_overhead = full_width_overhead_rows(base, args.full_width_rank, args.runs)
        del base
    header = ["model", "rank", "bytes (both slots)", "swap ms", "copy_ ms", "swap / copy"]
    table = markdown_table(header, [
        [model_label, r["rank"], r["bytes"], r["swap_ms"], r["copy_ms"], f"{r['swap_over_copy']}x"]
        for model_label, rows in (("tiny", swaps), ("full-width blocks", wide)) for r in rows])
    table += "\n\n" + markdown_table(
        ["configuration", "request", "rank run", "pack ms", "overhead vs no slots", "slot bytes", "recompiles"],
        [[r["config"], r["request"], r["rank_bucket"], r["pack_ms"], f"{r['overhead_pct']}%", r["slot_bytes"],
          r["recompiles"]] for r in overhead])
    if wide_overhead:
        table += "\n\nFull-width blocks (2 images of 64x64, 2 steps):\n\n" + markdown_table(
            ["configuration", "request", "rank run", "pack ms", "overhead vs no slots", "slot bytes", "recompiles"],
            [[r["config"], r["request"], r["rank_bucket"], r["pack_ms"], f"{r['overhead_pct']}%", r["slot_bytes"],
              r["recompiles"]] for r in wide_overhead])
    table += "\n\nFused mode, swap against a copy of the touched weights:\n\n" + markdown_table(
        ["adapters (every Linear)", "touched bytes", "restore from", "fused swap ms", "copy_ ms", "swap / copy"],
        [[r["rank"], r["bytes"], r["restore"], r["swap_ms"], r["copy_ms"], f"{r['swap_over_copy']}x"] for r in fused])
    write_results(args.out, "swap", {"args": vars(args), "swap": swaps, "swap_full_width": wide, "overhead": overhead,
                   "overhead_full_width": wide_overhead, "fused_swap": fused},
                  table, str(vars(args)))


def write_fused_results(args, fused: list[dict], overhead: list[dict]) -> None:
    table = markdown_table(["adapters (every Linear)", "modules", "touched bytes", "restore from", "fused swap ms",
                            "copy_ ms", "swap / copy"],
                           [[r["rank"], r["modules"], r["bytes"], r["restore"], r["swap_ms"], r["copy_ms"],
                             f"{r['swap_over_copy']}x"] for r in fused])
    table += "\n\n" + markdown_table(
        ["configuration", "request", "pack ms", "overhead vs no slots", "writer bytes", "recompiles"],
        [[r["config"], r["request"], r["pack_ms"], f"{r['overhead_pct']}%", r["slot_bytes"], r["recompiles"]]
         for r in overhead])
    write_results(args.out, "swap-fused", {"args": vars(args), "fused_swap": fused, "overhead": overhead},
                  table, str(vars(args)))


if __name__ == "__main__":
    main()
