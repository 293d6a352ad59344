"""Video serving costs on the tiny Wan model, with one expert (Wan 2.1's layout), two (Wan 2.2
A14B's, ``variant="two-experts"``) and Wan2.1-I2V's image-to-video layout (``variant="i2v"``: 36
channels in, the image cross-attention's ``add_k_proj`` / ``add_v_proj``, a CLIP image encoder), all
compiled, side by side in one run.

Usage: .venv/bin/python bench/video.py [--rank 8] [--runs 5] [--steps 8] [--no-jobs] [--out bench/results]

1. Swap: both slots rewritten from RAM-cached adapters (``writer.bind``, what a request's swap runs),
   two requests alternated so every swap writes; each expert gets a rank-``--rank`` LoRA per slot, so
   the two-expert engine writes twice the bytes. Ratio: two experts / one.
2. Steady state per denoising step: the median time between consecutive step callbacks of
   ``--steps``-step requests (text encoding, swap and VAE decode are outside every interval), hotlora
   compiled with both slots filled against plain diffusers (``WanPipeline.from_pretrained``,
   ``load_lora_weights`` per adapter, the low-noise expert's with ``load_into_transformer_2=True``,
   ``set_adapters`` once, eager, as users run it) with the same LoRA, the same guidance (true CFG:
   two forwards a step) and frames. Image-to-video against ``WanImageToVideoPipeline`` on the same first
   frame; its per-step cost is also given as a ratio to text-to-video's (one expert).
3. VAE decode per frame: the served pipeline's ``vae.decode`` of latents for 5 and 21 frames.
4. MP4 encode per frame: ``hotlora.server.video.mp4`` (libx264, CRF 18) of the frames a request gave
   (tiny: 16x16) and of 21 smooth random frames at 832x480 (the 480p size the real models serve).
5. The job API's overhead (``--no-jobs`` skips it): one video through ``POST /v1/videos``, polling and
   ``GET .../content`` on a server of the same tiny model against ``engine.generate`` + ``mp4`` here.

The ways take turns run by run (a shared machine's load falls on all of them alike). The tiny model
is launch-bound (kernel launches and Python, 16x16 pixels, two blocks): these are serving overheads,
not a GPU's throughput. Writes bench/results/video.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    REPO, allow_many_compiled_engines, free_port, markdown_table, use_repo_compile_cache, write_results)

use_repo_compile_cache()
PROMPT = "a cat walking in the snow"
MODELS = {"one expert": None, "two experts": "two-experts", "image-to-video": "i2v"}
IMAGE_TO_VIDEO = "image-to-video"


def median_ms(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


def tiny_model(variant: str | None, rank: int) -> Path:
    from hotlora.tiny import save_tiny_model

    model = REPO / ".cache" / "bench" / ("tiny-wan" + (f"-{variant}" if variant else ""))
    if not (model / "model_index.json").is_file():
        save_tiny_model(model, "wan", target_rank=rank, variant=variant)
    return model


def bench_adapters(engine, model: Path, rank: int) -> dict[str, dict]:
    """Two adapters ``a`` and ``b`` of rank ``rank`` on every ceiling Linear of every expert: for
    hotlora one file (a pair file under each expert's prefix where there are two), for diffusers one
    file per expert (diffusers loads each expert's LoRA with its own call)."""
    from hotlora.tiny import random_lora, save_diffusers_lora, save_expert_pair

    experts = list(engine.warm.experts)
    # The engine's ceiling names the second expert's modules "transformer_2.<module>" (its slots are
    # already installed, so the layers cannot be read off the model itself: they are LoRA wrappers).
    ceiling = dict(engine.ceiling.modules)
    others = tuple(f"{name}." for name in experts[1:])
    linears = {name: {m[len(name) + 1:]: shape for m, shape in ceiling.items() if m.startswith(f"{name}.")}
               for name in experts[1:]}
    linears[experts[0]] = {m: shape for m, shape in ceiling.items() if not m.startswith(others)}
    out = model / "bench-adapters"
    made = {}
    for k, seed in (("a", 101), ("b", 202)):
        layers = {name: random_lora(linears[name], rank, seed + i) for i, name in enumerate(experts)}
        files = [save_diffusers_lora(out / f"{k}-{name}", "wan", sd, rank=rank, alpha=rank) for name, sd in layers.items()]
        ours = files[0] if len(experts) == 1 else save_expert_pair(
            out / f"{k}-pair", "wan", {name: (sd, rank, rank) for name, sd in layers.items()})
        made[k] = {"hotlora": ours, "diffusers": files}
    return made


def diffusers_pipeline(model: Path, adapters: dict, scales: dict):
    """Plain diffusers with the same LoRA in the same slots (adapter names), eager: the pipeline the
    model directory names (WanPipeline, or WanImageToVideoPipeline)."""
    import diffusers

    pipeline = diffusers.DiffusionPipeline.from_pretrained(str(model), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    for slot, key in (("identity", "a"), ("style", "b")):
        for i, path in enumerate(adapters[key]["diffusers"]):
            pipeline.load_lora_weights(str(path), adapter_name=slot, **({"load_into_transformer_2": True} if i else {}))
    pipeline.set_adapters(list(scales), list(scales.values()))
    return pipeline


def synthetic_frames(frames: int, height: int, width: int):
    """Smooth random frames (what decoded video looks like to an encoder more than noise does)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, size=(frames, max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC)) for f in small])


def job_overhead(setup, steps: int, frames: int, runs: int, rank: int) -> dict:
    """One video through the job API (a server on the same tiny model, compiled, its engine in its
    own process as ``hotlora serve`` runs it, polled every 10 ms) against the same request made
    directly (``engine.generate`` and ``mp4`` in this process), taking turns."""
    import tempfile
    import threading

    import httpx
    import uvicorn

    from hotlora.server.app import create_app
    from hotlora.server.run import build_serving
    from hotlora.server.video import mp4
    from hotlora.settings import ServerConfig, StoreConfig

    engine, model = setup["engine"], setup["model"]
    adapter = setup["adapters"]["a"]["hotlora"]
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench-video-"))
    config = ServerConfig(model=str(model), target_rank=rank, batch_size=1, compile=True, rank_buckets=(), port=port, jobs_dir=str(tmp / "jobs"),
                          sizes=f"{engine.width}x{engine.height}")
    serving = build_serving(config, StoreConfig(cache_dir=tmp / "cache", local_roots=(model,)))
    server = uvicorn.Server(uvicorn.Config(create_app(serving, config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=120)
    for _ in range(3000):  # the server's engine compiles in its own process first
        try:
            if client.get("/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    fps = engine.family.fps
    body = {"prompt": PROMPT, "seconds": f"{(frames - 1) / fps:g}", "size": f"{engine.width}x{engine.height}",
            "num_inference_steps": steps, "seed": 1, "adapters": {"identity": str(adapter)}}

    def job():
        video = client.post("/v1/videos", json=body)
        video.raise_for_status()
        vid = video.json()["id"]
        while client.get(f"/v1/videos/{vid}").json()["status"] in ("queued", "in_progress"):
            time.sleep(0.01)
        content = client.get(f"/v1/videos/{vid}/content")
        content.raise_for_status()

    def direct():
        made = engine.generate(PROMPT, adapters={"identity": (str(adapter), 1.0)}, num_inference_steps=steps, seed=1,
                               num_frames=frames)
        mp4(made.images[0], fps)

    try:
        job(), direct()  # untimed
        samples = {"job": [], "direct": []}
        for run in range(runs):
            for name in (("job", "direct") if run % 2 == 0 else ("direct", "job")):
                began = time.perf_counter()
                (job if name == "job" else direct)()
                samples[name].append((time.perf_counter() - began) * 1000)
    finally:
        server.should_exit = True
        thread.join(timeout=120)
    return {"job_ms": statistics.median(samples["job"]), "direct_ms": statistics.median(samples["direct"]),
            "samples_ms": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed request (per-step: between callbacks)")
    parser.add_argument("--no-jobs", action="store_true", help="skip the job API's overhead (5.)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    steps = args.steps

    import diffusers
    import torch

    from hotlora import Engine
    from hotlora.adapters.binding import Binding
    from hotlora.server.video import mp4

    allow_many_compiled_engines()
    diffusers.utils.logging.set_verbosity_error()
    scales = {"identity": 0.9, "style": 0.6}
    setups = {}
    for label, variant in MODELS.items():
        model = tiny_model(variant, args.rank)
        began = time.perf_counter()
        engine = Engine.from_pretrained(model, target_rank=args.rank, batch_size=1, compile=True, rank_buckets=(),
                                        **({"tasks": (IMAGE_TO_VIDEO,)} if label == IMAGE_TO_VIDEO else {}))
        warm_s = time.perf_counter() - began
        adapters = bench_adapters(engine, model, args.rank)
        setups[label] = {"model": model, "engine": engine, "adapters": adapters, "warmup_s": warm_s,
                         "diffusers": diffusers_pipeline(model, adapters, scales)}
        print(f"{label}: warm in {warm_s:.1f} s", flush=True)
    first = setups["one expert"]["engine"]
    height, width, guidance = first.height, first.width, first.defaults["guidance_scale"]
    frames = first.rules.frames[0]
    from PIL import Image

    first_frame = Image.fromarray(synthetic_frames(1, 24, 40)[0])  # resized to the served size by the pipeline
    for label, setup in setups.items():  # what each model's requests give beside the prompt
        setup["inputs"] = {"images": (first_frame,), "task": None} if label == IMAGE_TO_VIDEO else {}

    # 1. Swap: both slots, two requests alternated so every bind writes every slot of every expert.
    swap = {}
    for label, setup in setups.items():
        engine = setup["engine"]
        loaded = {k: engine.load_adapter(str(v["hotlora"]), name=f"bench-{k}") for k, v in setup["adapters"].items()}
        requests = [{"identity": Binding(loaded["a"], 0.9), "style": Binding(loaded["b"], 0.6)},
                    {"identity": Binding(loaded["b"], 0.9), "style": Binding(loaded["a"], 0.6)}]
        for request in requests:
            engine.writer.prepare(request)  # what Engine.prepare does on the request's thread
        state = {"i": 0}

        def bind(engine=engine, requests=requests, state=state):
            state["i"] += 1
            engine.writer.bind([requests[state["i"] % 2]])

        bind()
        swap[label] = {"ms": median_ms(bind, 4 * args.runs), "slot_bytes": engine.writer.nbytes}

    # 2. Steady state per step, hotlora compiled against plain diffusers, the ways taking turns: the
    # time between consecutive step callbacks (hotlora's ``progress``, diffusers' ``callback_on_step_end``),
    # so text encoding, swap and decode stay out, and a load spike on this shared machine spoils one
    # interval of many rather than a whole request.
    def ours(setup, marks):
        adapters = {"identity": (str(setup["adapters"]["a"]["hotlora"]), scales["identity"]),
                    "style": (str(setup["adapters"]["b"]["hotlora"]), scales["style"])}
        return lambda: setup["engine"].generate(PROMPT, adapters=adapters, num_inference_steps=steps, seed=1,
                                                num_frames=frames, output_type="latent", **setup["inputs"],
                                                progress=lambda done, total: marks.append(time.perf_counter()))

    def theirs(setup, marks):
        def mark(pipeline, step, timestep, kwargs):
            marks.append(time.perf_counter())
            return kwargs

        return lambda: setup["diffusers"](prompt=PROMPT, negative_prompt="", num_inference_steps=steps, height=height,
                                          width=width, num_frames=frames, guidance_scale=guidance,
                                          generator=torch.Generator().manual_seed(1), output_type="latent",
                                          callback_on_step_end=mark,
                                          **({"image": first_frame} if setup["inputs"] else {}))

    marks = {(label, way): [] for label in setups for way in ("hotlora", "diffusers")}
    ways = {(label, way): (ours if way == "hotlora" else theirs)(setups[label], marks[label, way])
            for label, way in marks}
    for call in ways.values():  # untimed: first-call costs out of the figures
        call()
    intervals = {key: [] for key in ways}
    for run in range(args.runs):
        order = list(ways) if run % 2 == 0 else list(reversed(list(ways)))
        for key in order:
            marks[key].clear()
            ways[key]()
            intervals[key] += [(b - a) * 1000 for a, b in zip(marks[key], marks[key][1:])]
    per_step = {label: {way: {"ms_per_step": statistics.median(intervals[label, way]),
                              "intervals": len(intervals[label, way])} for way in ("hotlora", "diffusers")}
                for label in setups}

    # 3. VAE decode per frame (the served pipeline's VAE; both tiny models share its config).
    vae = first.pipeline.vae
    decode = {}
    for latent_frames in (2, 6):
        out_frames = (latent_frames - 1) * first.pipeline.vae_scale_factor_temporal + 1
        latents = torch.randn(1, vae.config.z_dim, latent_frames, height // first.pipeline.vae_scale_factor_spatial,
                              width // first.pipeline.vae_scale_factor_spatial, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ms = median_ms(lambda: vae.decode(latents, return_dict=False), args.runs)
        decode[out_frames] = {"ms": ms, "ms_per_frame": ms / out_frames}

    # 4. MP4 encode per frame: a request's frames, and 480p frames.
    served = first.generate(PROMPT, num_inference_steps=steps, seed=1, num_frames=frames).images[0]
    encode = {}
    for name, video in ((f"{width}x{height} (a tiny request's)", served), ("832x480", synthetic_frames(21, 480, 832))):
        ms = median_ms(lambda video=video: mp4(video, first.family.fps), args.runs)
        encode[name] = {"frames": len(video), "ms": ms, "ms_per_frame": ms / len(video)}

    jobs = None if args.no_jobs else job_overhead(setups["one expert"], steps, frames, args.runs, args.rank)

    recompiles = {label: setup["engine"].recompiles for label, setup in setups.items()}
    rows = [["swap, both slots (ms)", *(round(swap[label]["ms"], 3) for label in setups),
             f"two / one expert {swap['two experts']['ms'] / swap['one expert']['ms']:.2f}x (slot bytes "
             + " / ".join(f"{swap[label]['slot_bytes']:,}" for label in setups) + ")"]]
    for way in ("hotlora", "diffusers"):
        step_ms = {label: per_step[label][way]["ms_per_step"] for label in setups}
        rows.append([f"{way} per step (ms)", *(round(ms, 2) for ms in step_ms.values()),
                     f"image-to-video / text-to-video {step_ms[IMAGE_TO_VIDEO] / step_ms['one expert']:.2f}x"])
    rows.append(["hotlora compiled / diffusers eager, per step",
                 *(f"{per_step[label]['hotlora']['ms_per_step'] / per_step[label]['diffusers']['ms_per_step']:.2f}x"
                   for label in setups), "both with the same LoRA in two adapters"])
    table = markdown_table(["measure", *setups, "ratio / note"], rows)
    table += "\n\n" + markdown_table(["VAE decode", "ms", "ms per frame"],
                                     [[f"{n} frames at {width}x{height}", round(v["ms"], 2), round(v["ms_per_frame"], 3)]
                                      for n, v in decode.items()])
    table += "\n\n" + markdown_table(["MP4 encode (libx264, CRF 18)", "frames", "ms", "ms per frame"],
                                     [[n, v["frames"], round(v["ms"], 2), round(v["ms_per_frame"], 3)]
                                      for n, v in encode.items()])
    if jobs is not None:
        # The fastest run too: on this shared machine the served runs (two processes) spread widely.
        fastest = {k: min(v) for k, v in jobs["samples_ms"].items()}
        table += "\n\n" + markdown_table(
            ["one video, " + f"{steps} steps, MP4", "ms (median)", "ratio", "ms (fastest)", "ratio"],
            [["direct: engine.generate + mp4()", round(jobs["direct_ms"], 1), "1.00x", round(fastest["direct"], 1),
              "1.00x"],
             ["job API: POST /v1/videos, poll, GET content", round(jobs["job_ms"], 1),
              f"{jobs['job_ms'] / jobs['direct_ms']:.2f}x", round(fastest["job"], 1),
              f"{fastest['job'] / fastest['direct']:.2f}x"]])
    table += (f"\n\nRecompiles after warm-up: {recompiles}. Compile warm-up: "
              + ", ".join(f"{label} {setup['warmup_s']:.0f} s" for label, setup in setups.items())
              + " (the second engine's blocks have the first's shapes: it mostly reads the inductor cache the "
              "first filled).")
    description = (f"Tiny Wan {width}x{height}, {frames} frames, float32, compiled, batch 1, slots at rank {args.rank}; "
                   f"both slots filled with rank-{args.rank} LoRA on every Linear of every expert (image-to-video: "
                   "Wan2.1-I2V's layout, one first frame of 40x24 resized by the pipeline, against diffusers' "
                   "WanImageToVideoPipeline). Swap: median of "
                   f"{4 * args.runs} binds. Per step: median time between consecutive step callbacks over "
                   f"{args.runs} requests of {steps} steps per way, ways taking turns; guidance "
                   f"{guidance} (true CFG, two forwards a step) on both sides. Launch-bound tiny model: serving "
                   "overheads, not GPU throughput.")
    data = {"args": vars(args), "jobs": jobs, "swap": swap, "per_step": per_step, "vae_decode": decode, "mp4_encode": encode,
            "recompiles": recompiles, "warmup_s": {k: s["warmup_s"] for k, s in setups.items()},
            "step_intervals_ms": {" ".join(k): v for k, v in intervals.items()}}
    write_results(args.out, "video", data, table, description)


if __name__ == "__main__":
    main()
