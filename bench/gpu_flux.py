"""Full-size Flux on a GPU with no network: random bf16 weights, the engine's figures at production size.

Usage (bench/device.sh runs it on a lent GPU; see docs/benchmarks.md):
    python -m bench.gpu_flux [--height 1024 --width 1536 --steps 30 --pack 6 --rank 128]
                             [--budget-s 420] [--out DIR] [--configs every_linear,no_slots,...]
                             [--repeats N] [--layers N --single-layers M --heads H --text-width W]
                             [--bucket-rank N] [--no-compile] [--device cpu]

Builds a Flux pipeline with the real transformer architecture (19 double + 38 single blocks, width
3072; fewer with --layers/--single-layers/--heads) and random bf16 weights in memory (no download),
small random text encoders with the real embedding widths (T5 4096, CLIP 768) and the Flux VAE.
Then, one configuration at a time, each on a freshly built model with the same seeded weights, in
this order (the most valuable figures first; --configs picks and orders others):
  1. every_linear: both slots on every Linear, filled with two random rank-R adapters: compiled
     pack time (the figure to set against the seed article's 40.6 s on an H100), then the swap of
     both slots for rank 1..R against one plain copy_ of the same bytes (bench/swap.py's
     measurement), then the memory plan's activation line against the CUDA allocator's peak for
     one decoded pack (plan_check, bench/gpu_rows.py);
  2. no_slots: the compiled model with no adapter slots (the baseline: every row's overhead_pct);
  3. fused_kept (bf16, eager, adapter_mode="auto", rank-16 slots): for adapters of delta RMS 0.1%,
     0.3% and 1% of each layer's weight RMS on every Linear, the fraction of the weight delta a bf16
     merge keeps (fused_kept), the path auto mode takes, the plan's time, and the output effect of
     one image served fused against the same served through the slots (bench/gpu_rows.py);
  4. float8_base / int8_base: every_linear on a torchao-quantized base (base_quantization float8:
     row-wise FP8, CUDA only, skipped with a message elsewhere; int8_weight_only): pack time, swap,
     the denoiser's bytes, CUDA peak, and the adapters' effect kept against every_linear's bf16 base
     (one more image without adapters);
  5. every_linear_rank_bucket: slots of rank R with one rank bucket at --bucket-rank (default R/4,
     the engine's default bucket) and adapters of that rank: the pack time a low-rank request gets;
  6. fused: adapter_mode="fused" (no LoRA layers: the two rank-R adapters merged into the weights,
     restored from a pristine copy on the device): pack time against no_slots, then the fused swap
     (every Linear restored and re-merged) against one copy_ of the touched weights' bytes;
  7. attention_only: both slots on the attention projections only;
  8. eager_every_linear: every_linear without compile (compile speedup and warm-up against eager);
  9. fused_host: fused with the pristine copy in pinned host memory (fused_restore="host"): the
     swap then also brings W0 over the bus.
Every configuration records its build and warm-up (compile) times, pack time and CUDA peak.

``--model wan`` (``MODEL=wan bash bench/device.sh``): the same rows on Wan 2.1 T2V 1.3B's transformer
as published (``hotlora.fullsize.wan21_t2v_1_3b``: 30 blocks, 12 heads of 128; ``--layers`` /
``--heads`` fewer), its VAE and UniPC flow scheduler, random bf16 weights, a two-layer random UMT5 of
the real width; a pack is ``--pack`` videos of ``--frames`` frames (device.sh: one video, 480x832,
81 frames, 30 steps, true CFG: two forwards a step): every_linear (with its swap rows), no_slots,
every_linear_rank_bucket, attention_only, eager_every_linear. No plan row (the activation model is
calibrated on Flux), no fused or quantized rows.

Timing: CUDA is synchronised at every measurement boundary (torch.cuda.synchronize before the
clock starts and before it is read). ``pack_ms`` is the engine's own per-chunk generate time (summed);
``wall_ms`` is the whole ``Engine.generate`` call timed here (request resolution, swap, generation,
finite check), both medians over --repeats packs.

Budget: before each configuration and before each measurement inside one (build, warm-up, every
pack, every swap rank) the expected time, from what was measured so far, is checked against what
is left of --budget-s, and, once the row's first pack is measured, of the row's own share of it
(ROW_SHARE); a measurement that would not fit is skipped and says so. --out/gpu.json is
rewritten after every measurement (atomically), so a run killed from outside keeps what it measured.
Random weights: the engine's non-finite-output check is recorded (``finite``) instead of raising,
since overflowing random activations say nothing about timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

RESULTS_NAME = "gpu.json"
# The most valuable figures first: a run cut short keeps them. every_linear's pack time with two
# rank-R adapters is the one to set against the seed's 40.6 s (H100), then its swap rows; no_slots
# next, for the overhead (every row's overhead_pct is derived whenever both exist).
CONFIG_ORDER = ("every_linear", "no_slots", "fused_kept", "float8_base", "int8_base", "every_linear_rank_bucket", "fused",
                "attention_only", "eager_every_linear", "fused_host")
# --model wan (Wan 2.1 T2V 1.3B, one video a pack): the rows that measure the slots themselves; the
# fused, FP8/int8 and plan rows are Flux's questions, answered there.
WAN_CONFIG_ORDER = ("every_linear", "no_slots", "every_linear_rank_bucket", "attention_only", "eager_every_linear")
# The most of --budget-s one row may spend: once its first pack is measured, the row's further
# measurements (more packs, swap ranks, the plan check, effect images) stop at its share and the
# time goes to the rows after it.
ROW_SHARE = {"every_linear": 0.6, "fused_kept": 0.3}
DEFAULT_ROW_SHARE = 0.45
QUANTIZED = {"float8_base": "float8", "int8_base": "int8_weight_only"}
FUSED = ("fused", "fused_host")
SLOW_EAGER = 1.6  # eager pack time over compiled, for the budget only (a guess until measured)


def sync() -> None:
    """Wait for queued CUDA work: called on both sides of every timed region."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_full_flux(layers: int, single_layers: int, device: str = "cuda", heads: int = 24, text_width: int = 4096):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from hotlora.families._tiny import clip_tokenizer, t5_tokenizer

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 12B parameters: never materialise them in float32
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(num_layers=layers, num_single_layers=single_layers,
                                                 num_attention_heads=heads, joint_attention_dim=text_width,
                                                 guidance_embeds=True)
            text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                                        num_attention_heads=12, vocab_size=600, projection_dim=768,
                                                        bos_token_id=512, eos_token_id=2, pad_token_id=513))
            text_encoder_2 = T5EncoderModel(T5Config(vocab_size=160, d_model=text_width, d_kv=64,
                                                     d_ff=text_width * 5 // 2, num_layers=2,
                                                     num_heads=max(1, text_width // 64), decoder_start_token_id=0,
                                                     pad_token_id=0, eos_token_id=1))
            vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                                block_out_channels=[128, 256, 512, 512], layers_per_block=2, use_quant_conv=False,
                                use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    finally:
        torch.set_default_dtype(previous)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer(),
                        transformer=transformer)


def build_full_wan(layers: int, device: str = "cuda", heads: int = 12, text_width: int = 4096):
    """Wan 2.1 T2V 1.3B's transformer as published (``hotlora.fullsize.wan21_t2v_1_3b``: 30 blocks of
    12 heads; fewer with ``layers`` / ``heads`` for a dry run), its VAE and UniPC flow scheduler,
    random bf16 weights, and a two-layer random UMT5 of the real width (the denoiser's ``text_dim``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from hotlora.families._tiny import t5_tokenizer
    from hotlora.fullsize import wan21_t2v_1_3b as published

    def config(values: dict, **changed) -> dict:
        return {k: v for k, v in {**values, **changed}.items() if not k.startswith("_")}

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = WanTransformer3DModel(**config(published.TRANSFORMER, num_layers=layers,
                                                         num_attention_heads=heads, text_dim=text_width))
            tokenizer = t5_tokenizer()
            text_encoder = UMT5EncoderModel(UMT5Config(
                vocab_size=len(tokenizer), d_model=text_width, d_kv=64, d_ff=text_width * 5 // 2, num_layers=2,
                num_heads=max(1, text_width // 64), relative_attention_num_buckets=32, decoder_start_token_id=0,
                pad_token_id=0, eos_token_id=1)).eval()
            vae = AutoencoderKLWan(**config(published.VAE))
    finally:
        torch.set_default_dtype(previous)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**config(published.SCHEDULER)))


class Report:
    """The results file: rewritten whole after every measurement, through a temporary file."""

    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        self.began = time.monotonic()

    def save(self, key: str | None = None, value=None, *, quiet: bool = False, tmp: str = ".tmp") -> None:
        if key is not None:
            self.data[key] = value
            if key not in self.data["steps_done"]:
                self.data["steps_done"].append(key)
        self.data["elapsed_s"] = round(time.monotonic() - self.began, 1)
        if torch.cuda.is_available():
            self.data["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            # What the caching allocator holds: allocated-and-freed memory (e.g. weights made only to be
            # replaced) stays reserved; compare with the plan and with cuda_peak_gib.
            self.data["cuda_reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        derive(self.data)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_suffix(tmp)
        staged.write_text(json.dumps(self.data, indent=2))
        os.replace(staged, self.path)
        if key is not None and not quiet:
            print(json.dumps({key: value}), flush=True)


def derive(data: dict) -> None:
    """Overheads against no_slots and the compile speedup, whenever their inputs exist."""
    base = data.get("no_slots", {})
    for label in ("every_linear", "attention_only", "every_linear_rank_bucket", "eager_every_linear", *FUSED,
                  *QUANTIZED):
        row = data.get(label)
        if not isinstance(row, dict):
            continue
        for key, out in (("pack_ms", "overhead_pct"), ("wall_ms", "overhead_wall_pct")):
            if row.get(key) and base.get(key):
                row[out] = round(100 * (row[key] / base[key] - 1), 1)
    eager, compiled = data.get("eager_every_linear", {}), data.get("every_linear", {})
    if eager.get("pack_ms") and compiled.get("pack_ms") and compiled.get("compiled"):
        eager["compile_speedup"] = round(eager["pack_ms"] / compiled["pack_ms"], 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("flux", "wan"), default="flux",
                        help="flux: Flux.1's transformer; wan: Wan 2.1 T2V 1.3B's (a video of --frames a pack)")
    parser.add_argument("--frames", type=int, default=81, help="--model wan: frames a video (4k + 1)")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: flux 19 double-stream, wan 30)")
    parser.add_argument("--single-layers", type=int, default=38)
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads of 128 (default: flux 24, width 3072; wan 12, width 1536)")
    parser.add_argument("--text-width", type=int, default=4096, help="T5 width = the transformer's joint width")
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench/results",
                        help=f"folder for {RESULTS_NAME} (default: $OUT, else bench/results)")
    parser.add_argument("--configs", default="",
                        help=f"comma-separated, in the order to run (default: {','.join(CONFIG_ORDER)}; "
                             "the rank-bucket one unless --bucket-rank 0)")
    parser.add_argument("--repeats", type=int, default=1, help="packs per configuration, budget permitting")
    parser.add_argument("--swap-repeats", type=int, default=10, help="swaps (and copies) timed per rank")
    parser.add_argument("--no-compile", action="store_true", help="every configuration eager (CPU dry runs)")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script with tiny sizes")
    parser.add_argument("--bucket-rank", type=int, default=-1,
                        help="every_linear_rank_bucket: slots of --rank with one rank bucket at this rank and "
                             "adapters of this rank (default: a quarter of --rank, the engine's default bucket; 0: off)")
    args = parser.parse_args()
    wan = args.model == "wan"
    args.layers = args.layers or (30 if wan else 19)
    args.heads = args.heads or (12 if wan else 24)
    if args.bucket_rank < 0:
        args.bucket_rank = max(1, args.rank // 4)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_flux.py needs a CUDA device (or --device cpu for a smoke test)")
    from hotlora import Engine
    from hotlora.families import family_named

    from bench.gpu_rows import (
        KEPT_RANK, adapters, fused_kept_rows, fused_swap_measurements, plan_activation_check, quantized_effect, record_finite,
    )
    from bench.swap import allow_many_compiled_engines

    allow_many_compiled_engines()
    known = WAN_CONFIG_ORDER if wan else CONFIG_ORDER
    order = [c.strip() for c in args.configs.split(",") if c.strip()] or [
        c for c in known if c != "every_linear_rank_bucket" or args.bucket_rank]
    unknown = sorted(set(order) - set(known))
    if unknown or ("every_linear_rank_bucket" in order and not args.bucket_rank):
        raise SystemExit(f"--configs: unknown {unknown} (known for {args.model}: {', '.join(known)}; the rank-bucket "
                         "one needs --bucket-rank)")

    versions = {}
    for dist in ("diffusers", "peft", "transformers", "accelerate", "huggingface_hub", "safetensors"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:  # noqa: BLE001 - informative only
            versions[dist] = None
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = Report(Path(args.out) / RESULTS_NAME,
                    {"args": vars(args), "device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "versions": versions, "order": order, "steps_done": [], "configs_done": []})
    data = report.data
    report.save()
    # The engine's own progress (quantization, each warm-up pass) in the log, and the running row's stage
    # in the results ("running"): where a row's time went when the time limit cuts it before its figures.
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hotlora").setLevel(logging.INFO)

    def on_term(signum, frame):  # `timeout` in bench/device.sh: say so in the file, then stop
        data["killed"] = f"signal {signum} after {time.monotonic() - report.began:.0f} s (hard time limit)"
        report.save(tmp=".killed.tmp")  # not the file a save it interrupted was writing
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    row_ends = [float("inf")]  # when the running row's share of the budget is spent (monotonic clock)

    def run_left() -> float:
        return args.budget_s - (time.monotonic() - report.began)

    def left() -> float:
        return min(run_left(), row_ends[0] - time.monotonic())

    seen: dict[str, float] = {}  # the latest of each kind of measurement, seconds: the budget's estimates

    def estimate(kind: str, compiled: bool) -> float:
        if kind == "warmup":
            return seen.get("warmup_compiled" if compiled else "warmup_eager", 0.0)
        if kind == "pack":
            if compiled:
                return seen.get("pack_compiled", 0.0)
            return seen.get("pack_eager", SLOW_EAGER * seen.get("pack_compiled", 0.0))
        return seen.get(kind, 0.0)

    missed: list[str] = []  # the last skip's reason

    def fits(what: str, need: float, row: dict | None = None) -> bool:
        """Whether ``need`` seconds (with a 15% margin) fit in what is left; a miss is recorded."""
        if left() >= 1.15 * need and left() > 0:
            return True
        whose = "the row's share of the" if left() < run_left() else "the"
        note = f"{what}: {whose} time budget ({left():.0f} s left, about {need:.0f} s needed)"
        print(f"skipped {note}", flush=True)
        missed[:] = [note]
        if row is not None:
            row.setdefault("skipped", []).append(note)
        return False

    family = family_named(args.model)
    latents: dict[str, torch.Tensor] = {}  # image 0 of a row's first pack: a quantized base's effect kept
    for label in order:
        # Explicit: no rank buckets (the default adds 0 and rank/4), so each row measures what it names.
        options = {"every_linear": {"rank_buckets": ()}, "no_slots": {"slots": ()},
                   "attention_only": {"target_modules": r".*attn.*", "rank_buckets": ()},
                   "every_linear_rank_bucket": {"rank_buckets": (args.bucket_rank,)},
                   "eager_every_linear": {"compile": False, "rank_buckets": ()}, "fused": {"adapter_mode": "fused"},
                   "fused_host": {"adapter_mode": "fused", "fused_restore": "host"},
                   # eager: a handful of one-image packs, no compile to pay for (bench/gpu_rows.py)
                   "fused_kept": {"adapter_mode": "auto", "compile": False, "target_rank": KEPT_RANK, "batch_size": 1},
                   **{name: {"base_quantization": method} for name, method in QUANTIZED.items()}}[label]
        if options.get("base_quantization") == "float8" and args.device != "cuda":
            note = f"{label}: float8 (torchao row-wise FP8) runs on CUDA only; skipped on {args.device}"
            print(f"skipped {note}", flush=True)
            report.save(f"skipped_{label}", note, quiet=True)
            continue
        compiled = options.get("compile", not args.no_compile)
        need = estimate("build", compiled) + estimate("warmup", compiled) + estimate("pack", compiled)
        if label != "no_slots":
            need += estimate("adapters", compiled)
        row_ends[0] = float("inf")  # the share bounds what a row adds after its first pack, not the pack
        row_began, share = time.monotonic(), ROW_SHARE.get(label, DEFAULT_ROW_SHARE) * args.budget_s
        if not fits(f"configuration {label}", need):
            report.save(f"skipped_{label}", missed[-1], quiet=True)
            continue
        row: dict = {"compiled": compiled}
        engine = pipeline = request = None
        try:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            sync()
            began = time.monotonic()
            report.save("running", {"row": label, "stage": "build"})
            pipeline = (build_full_wan(args.layers, args.device, args.heads, args.text_width) if wan else
                        build_full_flux(args.layers, args.single_layers, args.device, args.heads, args.text_width))
            pipeline.set_progress_bar_config(disable=True)
            sync()
            seen["build"] = row["build_s"] = round(time.monotonic() - began, 1)
            row["transformer_params_b"] = round(sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9, 2)
            if not fits("warm-up", estimate("warmup", compiled) + estimate("pack", compiled), row):
                report.save(f"skipped_{label}", row["skipped"][-1])
                continue
            sync()
            began = time.monotonic()
            report.save("running", {"row": label, "stage": "engine start (quantize, warm-up)", "build_s": row["build_s"]})
            engine = Engine(pipeline, family, **{"target_rank": args.rank, "batch_size": args.pack, "height": args.height,
                                                 "width": args.width, "compile": not args.no_compile,
                                                 **({"frames": (args.frames,)} if wan else {}), **options})
            sync()
            row["warmup_s"] = round(time.monotonic() - began, 1)
            seen["warmup_compiled" if compiled else "warmup_eager"] = row["warmup_s"]
            row["compile_mode"] = engine.compile_mode
            row["slot_bytes"] = _writer(engine).nbytes
            row["denoiser_bytes"] = getattr(engine, "denoiser_bytes", None)  # quantized rows: the int8/FP8 weights
            if label in (*FUSED, "fused_kept"):
                row["pristine_bytes"] = engine.describe()["pristine_bytes"]
                row["restore"] = engine.describe()["restore"]
            finite = record_finite()
            data["configs_done"].append(label)
            data.pop("running", None)
            report.save(label, row)  # built and warm: already worth keeping
            if label == "fused_kept":
                row_ends[0] = row_began + share
                fused_kept_rows(engine, args, report, fits)
                continue

            if _writer(engine).slot_names:
                adapter_rank = args.bucket_rank if options.get("rank_buckets") else args.rank
                began = time.monotonic()
                request = {slot: (adapter, 0.8)
                           for slot, adapter in zip(("identity", "style"), adapters(engine, adapter_rank))}
                seen["adapters"] = row["adapters_s"] = round(time.monotonic() - began, 1)
                row["adapter_rank"] = adapter_rank
            samples = []
            for _ in range(max(1, args.repeats)):
                if not fits(f"pack {len(samples) + 1}", estimate("pack", compiled), row):
                    break
                samples.append(_pack(engine, request or {}, args))
                row_ends[0] = row_began + share
                latents.setdefault(label, samples[-1].pop("latents0"))
                seen["pack_compiled" if compiled else "pack_eager"] = samples[-1]["wall_ms"] / 1000
                row["pack_ms"] = round(statistics.median(s["pack_ms"] for s in samples), 1)
                row["wall_ms"] = round(statistics.median(s["wall_ms"] for s in samples), 1)
                row["swap_ms"] = round(statistics.median(s["swap_ms"] for s in samples), 3)
                row["pack_ms_samples"] = [s["pack_ms"] for s in samples]
                row["finite"] = all(finite)
                row["rank_run"] = samples[-1]["rank_bucket"] if _writer(engine).slot_names else 0
                row["recompiles"] = engine.recompiles
                if torch.cuda.is_available():
                    row["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                report.save(label, row, quiet=True)
                print(json.dumps({label: row}), flush=True)
            if label == "every_linear":
                _swap_measurements(engine, args, report, fits)
            if label == "every_linear" and not wan:  # the plan's activation model is calibrated on Flux
                plan_activation_check(engine, request, args, report, lambda what: fits(what, estimate("pack", compiled)))
            if label in FUSED and request:
                fused_swap_measurements(engine, request, label, args, report, fits)
            if label in QUANTIZED and samples:
                quantized_effect(engine, label, args, report, fits, latents, estimate("pack", compiled) / args.pack)
        except Exception as exc:  # noqa: BLE001 - one failed configuration must not cost the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            report.save(f"error_{label}", traceback.format_exc())
            if label not in data["configs_done"]:
                data["configs_done"].append(label)
            report.save(label, row)
        finally:
            if data.pop("running", None) is not None:  # a skipped or failed row says why in its own key
                report.save(quiet=True)
            del engine, pipeline, request
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    report.save("done", True)


def _writer(engine):
    """The engine's adapter writer (``engine.writer``; ``engine.slots`` before the writers refactor)."""
    writer = getattr(engine, "writer", None)
    return writer if writer is not None else engine.slots


def _pack(engine, request, args) -> dict:
    """One pack, timed between two CUDA synchronisations; also the engine's own per-chunk times."""
    sync()
    began = time.perf_counter()
    result = engine.generate("a portrait", adapters=request, num_images=args.pack, num_inference_steps=args.steps,
                             height=args.height, width=args.width, seed=0, output_type="latent",
                             **({"num_frames": args.frames} if args.model == "wan" else {}))
    sync()
    wall_ms = (time.perf_counter() - began) * 1000
    return {"pack_ms": round(sum(result.timings.generate_ms), 1), "wall_ms": round(wall_ms, 1),
            "swap_ms": result.timings.swap_ms, "rank_bucket": result.swap.rank_bucket,
            "latents0": torch.as_tensor(result.images)[:1].float().cpu()}  # image 0: seed 0


def _swap_measurements(engine, args, report: Report, fits) -> None:
    """bench/swap.py's swap rows (both slots against one copy_ of the same bytes, rank 1, 2, 4..),
    through its own swap_rows, within the budget: ranks up to 16 first (an eighth of the bytes of
    rank 128), then, from their time, the largest top rank expected to fit (ranks up to 16 again:
    swap_rows always starts at 1). A failure here is recorded and costs no other figure."""
    try:
        from bench.swap import swap_rows

        first = min(args.rank, 16)
        if not fits(f"swap ranks 1..{first}", 0):
            report.save("skipped_swap", "time budget")
            return
        began = time.monotonic()
        rows = swap_rows(engine, first, args.swap_repeats)
        spent = time.monotonic() - began
        report.save("swap", rows)
        top = args.rank
        while top > first:  # the time grows with the bytes, so with the sum of the ranks measured
            need = spent * (2 * top - 1) / (2 * first - 1)
            if fits(f"swap ranks 1..{top}", need):
                break
            top //= 2
        if top > first:
            began = time.monotonic()
            rows = swap_rows(engine, top, args.swap_repeats)
            spent += time.monotonic() - began
            report.save("swap", rows)
        report.data["swap_s"] = round(spent, 1)
        if top < args.rank:
            report.save("skipped_swap", f"ranks {2 * top}..{args.rank}: time budget")
    except Exception:  # noqa: BLE001 - the pack figures of this configuration stay valid
        report.save("error_swap", traceback.format_exc())


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/inductor").resolve()))
    main()
