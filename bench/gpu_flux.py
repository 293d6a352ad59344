"""Full-size Flux on a GPU with no network: random bf16 weights, the engine's figures at production size.

Usage (bench/gpu.sh runs it): python bench/gpu_flux.py [--height 1024 --width 1536 --steps 30 --pack 6 --rank 128]
                              [--budget-s 420] [--layers N --single-layers M] [--bucket-rank N]

Builds a Flux pipeline with the real transformer architecture (19 double + 38 single blocks, width
3072; fewer with --layers/--single-layers) and random bf16 weights in memory (no download), small
random text encoders with the real embedding widths (T5 4096, CLIP 768) and the Flux VAE. Then,
side by side in one process, as far as the time budget allows (results are written after every
step, so a cut-off run still leaves numbers):
  1. swap of both slots (rank 1..R, every Linear) against one plain copy_ of the same bytes;
  2. compiled pack with both slots filled against the same compiled model with no slots
     (steady-state adapter cost), for every Linear and for attention only, and with
     --bucket-rank N for every Linear with a rank bucket N and rank-N adapters;
  3. eager against compiled pack time, and the compile warm-up.
Never run yet: no session so far had a GPU. Check bench/results/gpu.json after the first run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path("bench/results/gpu.json")


def build_full_flux(layers: int, single_layers: int, device: str = "cuda"):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from hotlora.testing import _clip_tokenizer, _t5_tokenizer

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 12B parameters: never materialise them in float32
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(num_layers=layers, num_single_layers=single_layers, guidance_embeds=True)
            text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                                        num_attention_heads=12, vocab_size=600, projection_dim=768,
                                                        bos_token_id=512, eos_token_id=2, pad_token_id=513))
            text_encoder_2 = T5EncoderModel(T5Config(vocab_size=160, d_model=4096, d_kv=64, d_ff=10240, num_layers=2,
                                                     num_heads=64, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
            vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                                block_out_channels=[128, 256, 512, 512], layers_per_block=2, use_quant_conv=False,
                                use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    finally:
        torch.set_default_dtype(previous)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=_clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=_t5_tokenizer(),
                        transformer=transformer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pack", type=int, default=6)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--layers", type=int, default=19)
    parser.add_argument("--single-layers", type=int, default=38)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script with tiny sizes")
    parser.add_argument("--bucket-rank", type=int, default=0,
                        help="also run every Linear with a rank bucket at this rank (besides --rank) and adapters "
                             "of this rank, after the no-slots run (0: off)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_flux.py needs a CUDA device (or --device cpu for a smoke test)")
    from hotlora import Engine
    from hotlora.adapters.families import family_named

    began = time.monotonic()
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {"args": vars(args), "device": device, "torch": torch.__version__, "steps_done": []}

    def save(step: str, data) -> None:
        report[step] = data
        report["steps_done"].append(step)
        report["elapsed_s"] = round(time.monotonic() - began, 1)
        if torch.cuda.is_available():
            report["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2))
        print(json.dumps({step: data}), flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - began)

    def pack_ms(engine, adapters) -> float:
        result = engine.generate("a portrait", adapters=adapters, num_images=args.pack, num_inference_steps=args.steps,
                                 height=args.height, width=args.width, output_type="latent")
        return sum(result.timings.generate_ms)  # the pipeline call returns host tensors: synchronised

    flux = family_named("flux")
    configs = [  # (label, engine options): each on a freshly built model with the same seeded weights
        ("every_linear", {}),
        ("attention_only", {"target_modules": r".*attn.*"}),
        ("no_slots", {"slots": ()}),
        *([("every_linear_rank_bucket", {"rank_buckets": (args.bucket_rank,)})] if args.bucket_rank else []),
        ("eager_every_linear", {"compile": False}),
    ]
    for label, options in configs:
        if left() < 90:
            save(f"skipped_{label}", "time budget spent")
            continue
        build = time.monotonic()
        pipeline = build_full_flux(args.layers, args.single_layers, args.device)
        pipeline.set_progress_bar_config(disable=True)
        built_s = time.monotonic() - build
        warm = time.monotonic()
        engine = Engine(pipeline, flux, target_rank=args.rank, batch_size=args.pack, height=args.height,
                        width=args.width, **{"compile": True, **options})
        row = {"build_s": round(built_s, 1), "warmup_s": round(time.monotonic() - warm, 1),
               "transformer_params_b": round(sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9, 2),
               "slot_bytes": engine.slots.nbytes}
        request = {}
        if engine.slots.slot_names:
            adapter_rank = args.bucket_rank if options.get("rank_buckets") else args.rank
            request = {slot: (adapter, 0.8) for slot, adapter in zip(("identity", "style"), _adapters(engine, adapter_rank))}
            if label == "every_linear":
                from bench.swap import swap_rows  # the same measurement as on the CPU

                save("swap", swap_rows(engine, args.rank, repeats=10))
        row["pack_ms"] = round(pack_ms(engine, request), 1)
        row["rank_run"] = engine.slots.bucket if engine.slots.slot_names else 0
        row["recompiles"] = engine.recompiles
        save(label, row)
        del engine, pipeline, request
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    base = report.get("no_slots", {}).get("pack_ms")
    if base:
        for label in ("every_linear", "attention_only", "every_linear_rank_bucket"):
            if label in report:
                report[label]["overhead_pct"] = round(100 * (report[label]["pack_ms"] / base - 1), 1)
    save("done", True)


def _adapters(engine, rank: int):
    from hotlora.adapters.formats import Adapter, LoraWeights

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
        out.append(Adapter(f"random-{seed}", "flux", "diffusers", modules, sha256=f"gpu-random-{seed}"))
    return out


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/inductor").resolve()))
    main()
