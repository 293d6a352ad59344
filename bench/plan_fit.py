"""What fits where: ``hotlora plan`` of every built-in full-size model (hotlora.fullsize) on an
H100 80 GB, H200 141 GB, L40S 48 GB and A10G 24 GB, slots at rank 128, for a bf16, an int8 and an
FP8 base, as one markdown table.

Usage::

    PYTHONPATH=src .venv/bin/python bench/plan_fit.py [--rank 128] [--batch 1] [--sizes 1024x1024]
                                                      [--models flux-dev,sdxl,...] [--out DIR]

Each model is planned at its family's default size (the published models' size: 1024x1024 for
most, 512x512 for SD 1.5), or at each size its module lists in ``PLAN_SIZES`` (Wan: 480p and
720p, one row each), unless ``--sizes`` is given, one image per chunk unless ``--batch``,
on CUDA in bf16 (``plan_memory(name, EngineConfig(...), device="cuda", budget=...)``, what
``hotlora plan NAME --gpu ...`` runs). Nothing is allocated: the parts are built on the meta
device; a minute or two on a CPU for the whole table. Writes ``bench/results/plan_fit.{md,json}``.

A model whose family does not list it in ``full_size_models`` yet is reported as unregistered with
the line its family needs (the modules ship before the families do). Where a family has no
activation coefficients (bench/plan_calibrate.py measures them), the cell is the weights and
buffers only, marked "(weights only)"; where only the VAE decode is (Wan), "(weights and VAE decode
only)". FP8 needs compute capability 8.9 (torchao's float8): the
A10G (Ampere, 8.6) column says so rather than planning it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

import hotlora.fullsize
from hotlora.engine.plan import ACCELERATORS, format_bytes, plan_memory
from hotlora.engine.plan.budget import GB
from hotlora.families import full_size_model
from hotlora.settings import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
# name -> (budget bytes, FP8 supported); A10G is not one of ACCELERATORS (the CLI's --gpu choices).
GPUS = {
    "h100-80gb": (ACCELERATORS["h100-80gb"], True),
    "h200-141gb": (ACCELERATORS["h200-141gb"], True),
    "l40s-48gb": (ACCELERATORS["l40s-48gb"], True),
    "a10g-24gb": (24 * GB, False),
}
BASES = {"bf16": "none", "int8": "int8_weight_only", "fp8": "float8"}


def built_in_models() -> list[tuple[str, str]]:
    """(plan name, module) of every module in hotlora.fullsize that declares a NAME."""
    found = []
    for info in pkgutil.iter_modules(hotlora.fullsize.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"hotlora.fullsize.{info.name}")
        name = getattr(module, "NAME", None) or getattr(module, "SOURCE", None) and info.name
        if name:
            found.append((name, info.name))
    return sorted(found)


def _cell(plan) -> str:
    if plan.fits is False:
        needed = plan.static_bytes - plan.estimated_bytes
        if needed > plan.budget:
            return f"no ({format_bytes(needed)} static)"
        return f"no (peak {format_bytes(plan.required_bytes)})"
    weights_only = any(s.activation_bytes is None for s in plan.sizes)
    # The VAE decode modelled, the denoiser's activations not (Wan): no chunk is claimed either.
    decode_only = not weights_only and any(s.denoiser_bytes is None for s in plan.sizes)
    chunk = min((s.largest_chunk for s in plan.sizes if s.largest_chunk is not None), default=None)
    text = f"yes, {format_bytes(plan.required_bytes)}"
    if chunk is not None and not decode_only:
        text += f", chunk {'64+' if chunk >= 64 else chunk}"
    if weights_only:
        text += " (weights only)"
    if decode_only:
        text += " (weights and VAE decode only)"
    if plan.peak_bytes > plan.budget:
        text += ", tight"
    return text


def _rows(name: str, module: str, sizes: str, args, results: list) -> list[str]:
    """One table row per base for ``name`` served at ``sizes``; each plan is appended to ``results``."""
    cells, rows = [], []
    for base, quantization in BASES.items():
        for gpu, (budget, fp8) in GPUS.items():
            if quantization == "float8" and not fp8:
                cells.append("n/a (no FP8)")
                continue
            config = EngineConfig(target_rank=args.rank, sizes=sizes, batch_size=args.batch,
                                  base_quantization=quantization)
            plan = plan_memory(name, config, device="cuda", budget=budget, budget_name=gpu)
            results.append({"model": name, "module": module, "base": base, "gpu": gpu, **plan.as_dict()})
            cells.append(_cell(plan))
            print(f"{name} {sizes} {base} {gpu}: {plan.verdict}", file=sys.stderr, flush=True)
    for b, base in enumerate(BASES):
        rows.append(f"| {name} | {sizes} | {base} | " + " | ".join(cells[b * len(GPUS):(b + 1) * len(GPUS)]) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="the engine's chunk (batch_size)")
    parser.add_argument("--sizes", help="WIDTHxHEIGHT[,...]; default: each model's PLAN_SIZES (one row each), "
                        "else its family's default size")
    parser.add_argument("--models", help="plan names, comma-separated; default: every built-in model")
    parser.add_argument("--out", default=str(ROOT / "bench/results"), help="where plan_fit.{md,json} go")
    args = parser.parse_args(argv)
    import diffusers

    diffusers.utils.logging.set_verbosity_error()  # "modules ... kept in float32" per meta VAE and U-Net

    models = built_in_models()
    if args.models:
        wanted = args.models.split(",")
        models = [(n, m) for n, m in models if n in wanted]
    rows, results, unregistered = [], [], []
    for name, module in models:
        resolved = full_size_model(name)
        if resolved is None:
            unregistered.append((name, module))
            continue
        family, _ = resolved
        height, width = family.default_size
        # A model whose published resolutions are several (Wan: 480p and 720p) lists them as PLAN_SIZES:
        # one row each, since activations, where modelled, differ per size.
        declared = getattr(importlib.import_module(f"hotlora.fullsize.{module}"), "PLAN_SIZES", None)
        for sizes in [args.sizes] if args.sizes else declared or [f"{width}x{height}"]:
            rows += _rows(name, module, sizes, args, results)
    header = ("| model | size | base | " + " | ".join(GPUS) + " |\n|---|---|---|" + "---|" * len(GPUS))
    lines = [f"Command: `PYTHONPATH=src .venv/bin/python bench/plan_fit.py --rank {args.rank} --batch {args.batch}`"
             f" (meta device, no GPU needed). Slots ({', '.join(EngineConfig().slots)}) at rank {args.rank}; a cell "
             "is whether the warm engine fits the card (nominal capacity) and what it needs without the estimated "
             "adapters in use, with the largest chunk that fits at that size; 'weights only' where the family's "
             "activations are not calibrated yet.", "", header, *rows]
    if unregistered:
        lines += ["", "Not planned (no family lists them in `full_size_models` yet): "
                  + ", ".join(f"`{n}` (hotlora.fullsize.{m})" for n, m in unregistered)]
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_fit.md").write_text(table)
    (out / "plan_fit.json").write_text(json.dumps(results, indent=2, default=str))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
