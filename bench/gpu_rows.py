"""The rows of bench/gpu_flux.py beyond pack time (kept apart: one module each under 400 lines):
fused mode's swap against a copy of the touched bytes, the bf16 ``fused_kept`` row (what a full-width
bf16 merge keeps of adapters of controlled strength, auto mode's choice, and the output effect
fused against unfused), a quantized base's effect kept against the bf16 base, and the random
adapters and finiteness recording they share."""

from __future__ import annotations

import json
import statistics
import time
import traceback

import torch

from bench.gpu_flux import Report, sync

MAGNITUDES = (0.001, 0.003, 0.01)  # delta RMS / weight RMS, as tests/integration/test_precision.py
KEPT_RANK = 16
EFFECT_STEPS = 4  # denoising steps of the fused_kept row's eager effect packs


def record_finite() -> list[bool]:
    """Random weights may overflow, and the figures wanted here are times: the engine's finiteness
    check (``hotlora.engine.guard.check_finite``, which would refuse the pack) records instead of
    raising. Each pack's finiteness goes into the returned list."""
    from hotlora.engine import guard

    seen: list[bool] = []
    guard.check_finite = lambda images, resolved, pipeline: seen.append(bool(torch.isfinite(images).all()))
    return seen


def effect(out: torch.Tensor, base: torch.Tensor, ref: torch.Tensor, ref_base: torch.Tensor) -> dict:
    """Share of the reference's effect kept, and the error relative to it (docs/benchmarks.md,
    "Precision"), float64; None when either side is not finite (random weights)."""
    wanted, got = (ref - ref_base).flatten().double(), (out - base).flatten().double()
    if not (torch.isfinite(wanted).all() and torch.isfinite(got).all()) or float(wanted @ wanted) == 0:
        return {"kept": None, "error": None}
    return {"kept": round(float(got @ wanted / (wanted @ wanted)), 4),
            "error": round(float((got - wanted).norm() / wanted.norm()), 4)}


def fused_swap_measurements(engine, request, label: str, args, report: Report, fits) -> None:
    """Fused mode's swap at full size: two requests with the same two adapters in opposite slots
    (scales 0.8 / 0.6, so every Linear is restored and re-merged each time), alternated, against one
    copy_ of the touched weights' bytes from where W0 lives (device memory, or pinned host memory
    for fused_host). The first swap of each request builds its plan (prepare()'s work) and is
    timed apart. Recorded as ``swap_fused`` / ``swap_fused_host``; a failure costs no other figure."""
    from hotlora.adapters.binding import Binding

    try:
        writer = engine.writer
        (a, _), (b, _) = request["identity"], request["style"]
        requests = [{"identity": Binding(a, 0.8), "style": Binding(b, 0.6)}, {"identity": Binding(b, 0.8), "style": Binding(a, 0.6)}]
        touched = [engine.denoiser.get_submodule(m).weight for m in a.modules]
        nbytes = sum(w.nbytes for w in touched)
        row = {"rank": f"2 x r{a.rank}", "modules": len(a.modules), "bytes": nbytes, "restore": writer.restore}
        sync()
        began = time.perf_counter()
        for r in requests:
            writer.prepare(r)
        sync()
        row["prepare_ms"] = round((time.perf_counter() - began) * 1000 / 2, 1)
        # A swap takes about as long as a copy per byte times the GEMM work: ask for 4 x the pack's swap.
        if not fits("fused swap", 4 * args.swap_repeats * max(row["prepare_ms"] / 1000, 0.05)):
            report.save(f"skipped_swap_{label}", "time budget")
            return
        swaps = []
        for i in range(args.swap_repeats):
            sync()
            began = time.perf_counter()
            writer.swap(requests[i % 2])
            sync()
            swaps.append((time.perf_counter() - began) * 1000)
        pin = writer.restore == "host" and torch.cuda.is_available()
        source = torch.ones(nbytes, dtype=torch.uint8, device="cpu" if writer.restore == "host" else writer.device,
                            pin_memory=pin)
        target = torch.empty(nbytes, dtype=torch.uint8, device=writer.device)
        copies = []
        for _ in range(args.swap_repeats):
            sync()
            began = time.perf_counter()
            target.copy_(source, non_blocking=True)
            sync()
            copies.append((time.perf_counter() - began) * 1000)
        row["swap_ms"] = round(statistics.median(swaps), 2)
        row["copy_ms"] = round(statistics.median(copies), 2)
        row["swap_over_copy"] = round(row["swap_ms"] / row["copy_ms"], 2)
        row["plan_cached"] = writer.describe()["plan_cache_bytes"] > 0
        del source, target
        writer.swap({})
        report.save(f"swap_{label}", row)
    except Exception:  # noqa: BLE001 - the pack figures of this configuration stay valid
        report.save(f"error_swap_{label}", traceback.format_exc())


def adapters(engine, rank: int):
    """Two random rank-``rank`` adapters on the engine's ceiling (seeds 1 and 2, bf16, up x 0.01)."""
    from hotlora.adapters.format.convert import Adapter, LoraWeights

    dtype = next(engine.denoiser.parameters()).dtype
    pin = torch.cuda.is_available()
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        modules = {}
        for m, (i, o) in engine.ceiling.modules.items():
            down = torch.randn(rank, i, generator=g).to(dtype)
            up = torch.randn(o, rank, generator=g).to(dtype).mul_(0.01)
            modules[m] = LoraWeights(down.pin_memory() if pin else down, up.pin_memory() if pin else up, 1.0)
        out.append(Adapter(f"random-{seed}", engine.family.name, "diffusers", modules, sha256=f"gpu-random-{seed}"))
    return out


def controlled_adapter(denoiser, modules, magnitude: float, rank: int, seed: int):
    """``hotlora.testing.controlled_lora`` on the device (a full-width model's factors are made
    where its weights are): every ceiling Linear, delta RMS ``magnitude`` x the layer's weight RMS."""
    from hotlora.adapters.format.convert import Adapter, LoraWeights

    device = next(denoiser.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (i, o) in modules.items():
        weight = denoiser.get_submodule(name).weight
        down = torch.randn(rank, i, generator=g, device=device)
        up = torch.randn(o, rank, generator=g, device=device)
        factor = magnitude * weight.float().pow(2).mean().sqrt() / (up @ down).pow(2).mean().sqrt()
        out[name] = LoraWeights(down.to(weight.dtype), (up * factor).to(weight.dtype), 1.0)
    return Adapter(f"controlled-{magnitude:g}", "flux", "diffusers", out, sha256=f"gpu-controlled-{magnitude:g}-{seed}")


def latents_of(engine, request: dict, steps: int, height: int, width: int) -> tuple[torch.Tensor, object]:
    """One image, seed 0, as float32 latents on the host (for effect measurements)."""
    sync()
    result = engine.generate("a portrait", adapters=request, num_images=1, num_inference_steps=steps, seed=0,
                             height=height, width=width, output_type="latent")
    sync()
    return torch.as_tensor(result.images)[:1].float().cpu(), result


def fused_kept_rows(engine, args, report: Report, fits) -> None:
    """The bf16 ``fused_kept`` row, on an eager auto-mode engine (``adapter_mode="auto"``): per
    adapter strength (rank 16, every Linear), the fraction of the weight delta a bf16 merge keeps
    (``fused_kept``), the path auto mode chooses under ``fused_min_kept``, the plan's time (with
    the kept measurement), and the output effect: one image at ``EFFECT_STEPS`` steps served fused
    (the floor lowered to 0) against the same served through the slots (unfused: nothing lost),
    with each path's swap time. Saved as ``fused_kept_rows``; a failure costs no other figure."""
    from hotlora.adapters.binding import Binding

    rows = []
    try:
        writer = engine.writer
        floor = writer.min_kept
        steps = min(args.steps, EFFECT_STEPS)
        base, _ = latents_of(engine, {}, steps, args.height, args.width)
        per_pack = None
        for magnitude in MAGNITUDES:
            began = time.monotonic()
            adapter = controlled_adapter(engine.denoiser, engine.ceiling.modules, magnitude, KEPT_RANK, seed=7)
            row = {"magnitude": magnitude, "rank": KEPT_RANK, "adapter_s": round(time.monotonic() - began, 1)}
            sync()
            began = time.perf_counter()
            writer.prepare({"identity": Binding(adapter, 1.0)})  # the plan and its kept measurement
            sync()
            row["prepare_ms"] = round((time.perf_counter() - began) * 1000, 1)
            decided = writer._decide({"identity": Binding(adapter, 1.0)})
            row["auto_serves"], row["fused_kept"] = decided[0], round(decided[1], 5)
            if per_pack is not None and not fits(f"fused_kept {magnitude:g}", 2 * per_pack):
                row["skipped"] = "time budget"
                rows.append(row)
                break
            outs = {}
            for mode, floor_now in (("slots", 2.0), ("fused", 0.0)):  # each path forced by the floor
                writer.min_kept = floor_now
                began = time.monotonic()
                outs[mode], result = latents_of(engine, {"identity": (adapter, 1.0)}, steps, args.height, args.width)
                per_pack = time.monotonic() - began
                row[f"{mode}_swap_ms"] = round(result.timings.swap_ms, 2)
                row[f"{mode}_pack_ms"] = round(sum(result.timings.generate_ms), 1)
            writer.min_kept = floor
            row["effect_fused_vs_unfused"] = effect(outs["fused"], base, outs["slots"], base)
            rows.append(row)
            report.save("fused_kept_rows", rows, quiet=True)
            print(json.dumps({"fused_kept_row": row}), flush=True)
        engine.writer.min_kept = floor
        report.save("fused_kept_rows", rows)
    except Exception:  # noqa: BLE001 - the pack figures stay valid
        report.save("error_fused_kept_rows", traceback.format_exc())


def quantized_effect(engine, label: str, args, report: Report, fits, latents: dict, need_s: float) -> None:
    """A quantized base's effect kept: its pack's first image (seed 0, with the request's adapters,
    ``latents[label]``) and one image without adapters, against the same pair on the bf16 engine
    (``every_linear`` with the same adapters, ``no_slots`` without, from this run). Saved into the
    row as ``effect_vs_bf16`` (and the bases' distance); skipped when those rows did not run."""
    row = report.data.get(label, {})
    try:
        if not all(k in latents for k in ("every_linear", "no_slots", label)):
            row["effect_vs_bf16"] = "skipped: needs the every_linear and no_slots rows of this run"
        elif fits(f"{label} effect", need_s, row):
            quantized_base, _ = latents_of(engine, {}, args.steps, args.height, args.width)
            row["effect_vs_bf16"] = effect(latents[label], quantized_base, latents["every_linear"], latents["no_slots"])
            row["base_distance_vs_bf16"] = round(float((quantized_base - latents["no_slots"]).norm()
                                                       / latents["no_slots"].norm()), 4)
        report.save(label, row)
    except Exception:  # noqa: BLE001 - the pack figures stay valid
        report.save(f"error_effect_{label}", traceback.format_exc())


def plan_activation_check(engine, request: dict, args, report: Report, fits) -> None:
    """``plan_check``: the memory plan's activation model against the GPU (what ``hotlora plan``
    cannot measure on a CPU). One pack of ``args.pack`` images at the served size, 2 steps, decoded
    (the plan's activation line is the larger of one denoiser forward and the VAE decode): the CUDA
    allocator's peak during it above what was allocated before it, against the plan's line for
    flux-dev at the same size and chunk (its widths and token counts are this model's; the number of
    blocks does not enter a per-layer model). The plan models the eager peak; this engine may be
    compiled, which the row records. Without CUDA (a dry run) the plan and the pack still run, so
    the row's code is proven, and nothing is measured."""
    from hotlora.settings import EngineConfig
    from hotlora.engine.plan import plan_memory

    if not fits("plan check"):
        return
    try:
        cuda = torch.cuda.is_available()
        config = EngineConfig(target_rank=args.rank, sizes=f"{args.width}x{args.height}", batch_size=args.pack)
        (planned,) = plan_memory("flux-dev", config, device="cuda" if cuda else "cpu").sizes
        sync()
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        engine.generate("a portrait", adapters=request, num_images=args.pack, num_inference_steps=2, seed=0,
                        height=args.height, width=args.width, output_type="pil")
        sync()
        row = {"size": planned.size, "chunk": planned.chunk, "compiled": engine.compile_mode is not None,
               "planned_activation_gib": round(planned.activation_bytes / 2**30, 3),
               "planned_denoiser_gib": round(planned.denoiser_bytes / 2**30, 3),
               "planned_vae_decode_gib": round(planned.vae_decode_bytes / 2**30, 3)}
        if cuda:
            measured = torch.cuda.max_memory_allocated() - before
            row["measured_peak_above_static_gib"] = round(measured / 2**30, 3)
            row["planned_over_measured"] = round(planned.activation_bytes / max(1, measured), 3)
        else:
            row["measured_peak_above_static_gib"] = "needs CUDA (torch.cuda.max_memory_allocated)"
        report.save("plan_check", row)
    except Exception:  # noqa: BLE001 - a failed check must not cost the rows after it
        report.save("error_plan_check", traceback.format_exc())
