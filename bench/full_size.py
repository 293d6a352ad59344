"""A real architecture served end to end on the CPU, against plain diffusers: SDXL, or SD1.5
(``--family sd15``).

Usage: PYTHONPATH=src .venv/bin/python bench/full_size.py [--family sdxl] [--dtype bfloat16] [--steps 2] [--work .cache/fullsize]

1. Builds (once) the full-size model from its published configuration with random weights, and a
   kohya sd-scripts rank-32 LoRA (U-Net + the text encoders) and a diffusers rank-128 one
   (``python -m hotlora.fullsize.FAMILY build``), under ``--work`` (``FAMILY/`` and ``FAMILY/adapters/``),
   not in the repository.
2. ``hotlora serve`` in its own process, compiled, at 256x256, a fixed batch size, target rank 128,
   EMPTY inductor cache and compile-artifact folders (cold): start to ready, load and warm-up
   times, then requests that swap the adapters and bring each back: none, kohya, diffusers, kohya,
   diffusers, none. Per request: swap, text-encoder merge, pack (generate) times; the images.
   Peak resident memory of the server process (``VmHWM``).
3. The same server again with a fresh, empty inductor cache but the first one's compile artifacts
   (warm): start to ready and warm-up; one request, which must give the same bytes.
4. Plain diffusers (the model's pipeline class + ``load_lora_weights``, unfused), each dtype in
   its own process (``--reference-dtypes``): the same requests, their pack times and peak memory.
   The float32 reference runs in two phases (text encoders, then U-Net + VAE) so that no process
   holds the 13.9 GB float32 pipeline at once; the arithmetic is diffusers' own either way.
5. Compares: the server against each reference and the references against each other (the
   reference's own dtype noise), in 8-bit levels of the PNG images; writes
   bench/results/full_size.{json,md} (``full_size_sd15`` for SD1.5). ``tests/fullsize`` asserts on
   what ``run`` returns.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path: bench.harness needs the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a lighthouse on a cliff at dawn, oil painting"
SEED = 7
SCALES = {"identity": 0.9, "style": 0.8}
GUIDANCE = 5.0

# --family -> its name in the tables and the hotlora.fullsize module that builds it
FAMILIES = {"sdxl": "SDXL", "sd15": "SD1.5", "sana": "Sana 1600M"}
MODULES = {"sdxl": "sdxl", "sd15": "sd15", "sana": "sana_1600m"}
# Each family's two adapters, (request label, adapter key, slot), as its trainers write them: a kohya
# sd-scripts file (U-Net and text encoders) for the SD families, diffusers' DreamBooth script's
# default targets for Sana (its trainers write diffusers' layout); a diffusers rank-128 one for each.
ADAPTERS = {"sdxl": (("kohya", "kohya-r32", "identity"), ("diffusers", "diffusers-r128", "style")),
            "sd15": (("kohya", "kohya-r32", "identity"), ("diffusers", "diffusers-r128", "style")),
            "sana": (("dreambooth", "dreambooth-r32", "identity"), ("diffusers", "diffusers-r128", "style"))}


def sequence(family: str) -> list[tuple[str, dict[str, str]]]:
    """The requests, in order: (label, {slot: adapter key}). Each adapter comes back once, so its
    bytes can be compared; none comes back at the end."""
    (a, key_a, slot_a), (b, key_b, slot_b) = ADAPTERS[family]
    return [("none", {}), (a, {slot_a: key_a}), (b, {slot_b: key_b}), (a, {slot_a: key_a}), (b, {slot_b: key_b}),
            ("none", {})]


def adapter_path(adapters: Path, key: str) -> Path:
    """kohya's files are one .safetensors; diffusers' ``save_lora_weights`` writes a folder."""
    return adapters / f"{key}.safetensors" if key.startswith("kohya") else adapters / key / "pytorch_lora_weights.safetensors"


def ensure_model(model: Path, family: str = "sdxl") -> tuple[Path, dict[str, Path]]:
    """The model and its two adapters (built by a child process the first time)."""
    paths = {key: adapter_path(model / "adapters", key) for _, key, _ in ADAPTERS[family]}
    if not (model / "model_index.json").is_file() or not all(p.is_file() for p in paths.values()):
        subprocess.run([sys.executable, "-m", f"hotlora.fullsize.{MODULES[family]}", "build", str(model)], check=True,
                       env=child_env())
    return model, paths


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def peak_rss_gib(pid: int) -> float:
    """The peak resident memory so far (the kernel's high-water mark) of the process and its
    descendants (the engine process ``hotlora serve`` spawns), summed: an upper bound of what
    they held at once."""
    total, found = 0, False
    for proc in [pid, *descendants(pid)]:
        try:
            lines = Path(f"/proc/{proc}/status").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total, found = total + int(line.split()[1]), True
    return round(total / 2**20, 2) if found else float("nan")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (/proc/PID/task/TID/children, recursively)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


class Server:
    """``hotlora serve`` as a child process on 127.0.0.1."""

    def __init__(self, model: Path, roots: Path, args, inductor: Path, artifacts: Path, log: Path):
        from bench.harness import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "hotlora.cli", "serve", "--model", str(model), "--port", str(self.port),
                   "--sizes", args.size, "--dtype", args.dtype, "--batch-size", str(args.batch_size),
                   "--target-rank", str(args.target_rank), "--compile", "--compile-cache-dir", str(artifacts),
                   "--local-roots", str(roots), "--cache-dir", str(args.work / "store"),
                   "--max-queue", "4", "--request-timeout-s", "3600"]
        self.log = log
        self.began = time.perf_counter()
        with open(log, "w") as sink:  # the child keeps its own descriptor
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                            env=child_env(TORCHINDUCTOR_CACHE_DIR=str(inductor)))

    def wait_ready(self, timeout_s: float) -> dict:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded: the start-up may not outlast timeout_s
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return self.startup(time.perf_counter() - self.began)
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready in {timeout_s}s; see {self.log}")

    def startup(self, ready_s: float) -> dict:
        """Start-up figures from the server's own log line ``engine ready in Xs: {describe()}``."""
        import re

        text = self.log.read_text()
        engine_s = float(re.search(r"engine ready in ([\d.]+)s", text).group(1))
        warmup_s = float(re.search(r"'warmup_s': ([\d.]+)", text).group(1))
        described = {k: int(v) for k, v in re.findall(r"'(denoiser_bytes|slot_bytes|text_encoder_bytes)': (\d+)", text)}
        # --batch-size auto: the chunk-size measurement's seconds (its last progress line; none when
        # the saved measurement was loaded or the batch size is fixed)
        chunks = re.findall(r"chunk timing \d+/\d+: .*\((\d+)s of", text)
        chunks_s = float(chunks[-1]) if chunks else 0.0
        return {"process_start_to_ready_s": round(ready_s, 1), "engine_build_s": engine_s, "warmup_s": warmup_s,
                "chunk_measurement_s": chunks_s, "load_s": round(engine_s - warmup_s - chunks_s, 1), **described,
                "artifacts_loaded": "loaded compile artifacts" in text}

    def generate(self, adapters: dict[str, str], steps: int, num_images: int) -> tuple[dict, list[bytes]]:
        import base64

        import httpx

        body = {"prompt": PROMPT, "adapters": {slot: {"ref": ref, "scale": SCALES[slot]} for slot, ref in adapters.items()},
                "num_images": num_images, "seed": SEED, "num_inference_steps": steps, "guidance_scale": GUIDANCE,
                "output_format": "png"}
        response = httpx.post(f"{self.url}/v1/generate", json=body, timeout=3600)
        response.raise_for_status()
        out = response.json()
        return out, [base64.b64decode(b) for b in out["images"]]

    def stop(self) -> float:
        """Stops the server; returns its peak resident memory in GiB."""
        peak = peak_rss_gib(self.process.pid)
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return peak


def serve_sequence(server: Server, refs: dict[str, Path], sequence, args) -> list[dict]:
    """Each request of ``sequence`` through the server: its timings, recompiles and PNG bytes."""
    rows = []
    for label, slots in sequence:
        out, images = server.generate({slot: str(refs[key]) for slot, key in slots.items()}, args.steps, args.num_images)
        rows.append({"label": label, "timings": out["timings"], "recompiles": out["recompiles"], "pngs": images})
        print(f"  {label}: {out['timings']} recompiles {out['recompiles']}", flush=True)
    return rows


def run_server(model: Path, refs: dict[str, Path], args, name: str, artifacts: Path, sequence) -> dict:
    """One server process: start (with an empty inductor cache), the requests, stop. Its figures are
    kept in ``work/server-NAME.json`` (``--reuse`` reads them instead of serving again)."""
    saved = args.work / f"server-{name}.json"
    if args.reuse and saved.is_file():
        data = json.loads(saved.read_text())
        for row in data["requests"]:
            row["pngs"] = [bytes.fromhex(h) for h in row.pop("pngs_hex")]
        return data
    inductor = args.work / f"inductor-{name}"
    if args.warm_caches:  # the tests: whatever earlier runs compiled (start-up figures then mean little)
        inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", REPO / ".cache" / "inductor"))
    else:
        subprocess.run(["rm", "-rf", str(inductor)], check=True)  # empty: only the artifacts file carries over
    server = Server(model, model / "adapters", args, inductor, artifacts, args.work / f"server-{name}.log")
    try:
        startup = server.wait_ready(args.ready_timeout_s)
        print(f"{name} server ready: {startup}", flush=True)
        rows = serve_sequence(server, refs, sequence, args)
    finally:
        peak = server.stop()
    saved.write_text(json.dumps({"startup": startup, "peak_rss_gib": peak, "requests": [
        {**{k: v for k, v in r.items() if k != "pngs"}, "pngs_hex": [p.hex() for p in r["pngs"]]} for r in rows]}))
    return {"startup": startup, "requests": rows, "peak_rss_gib": peak}


def run_reference(model: Path, refs: dict[str, Path], args, dtype: str) -> dict:
    """Plain diffusers in its own process (bench/full_size_reference.py); its images and timings."""
    out = args.work / f"reference-{dtype}.json"
    if not (args.reuse and out.is_file()):
        command = [sys.executable, str(REPO / "bench" / "full_size_reference.py"), str(model),
                   json.dumps({label: [str(refs[key]), slot] for label, key, slot in ADAPTERS[args.family]}),
                   dtype, str(args.steps), str(args.num_images), args.size, str(out)]
        subprocess.run(command, check=True, env=child_env(), timeout=args.ready_timeout_s)
    data = json.loads(out.read_text())
    for row in data["requests"]:
        row["pngs"] = [bytes.fromhex(h) for h in row.pop("pngs_hex")]
    return data


def levels(a: list[bytes], b: list[bytes]) -> dict:
    """How far two lists of PNG images are apart, in 8-bit levels: max and mean |a - b|."""
    import io

    import numpy as np
    from PIL import Image

    x = np.stack([np.asarray(Image.open(io.BytesIO(p)), dtype=np.int16) for p in a])
    y = np.stack([np.asarray(Image.open(io.BytesIO(p)), dtype=np.int16) for p in b])
    diff = np.abs(x - y)
    return {"max": int(diff.max()), "mean": round(float(diff.mean()), 3)}


def first(rows: list[dict], label: str) -> dict:
    return next(r for r in rows if r["label"] == label)


def median(values) -> float:
    import statistics

    return round(statistics.median(values), 1)


def compare(served: list[dict], references: dict[str, dict]) -> dict:
    """The server against each reference dtype, the references against each other (the dtype noise
    of diffusers itself) and each adapter's effect on the reference (what a dropped adapter loses)."""
    out: dict = {"server_vs": {}, "reference_noise": {}, "adapter_effect": {}}
    dtypes = list(references)
    for dtype, ref in references.items():
        out["server_vs"][dtype] = {r["label"]: levels(first(served, r["label"])["pngs"], r["pngs"]) for r in ref["requests"]}
        none = first(ref["requests"], "none")["pngs"]
        out["adapter_effect"][dtype] = {r["label"]: levels(r["pngs"], none) for r in ref["requests"] if r["label"] != "none"}
    for a, b in itertools.pairwise(dtypes):
        out["reference_noise"][f"{a}_vs_{b}"] = {r["label"]: levels(r["pngs"], first(references[b]["requests"], r["label"])["pngs"])
                                                 for r in references[a]["requests"]}
    return out


def request_s(row: dict) -> float:
    """A reference request's seconds: prompt encoding (older runs did not time it) and the pack."""
    return row.get("encode_s", 0.0) + row["pack_s"]


def summarize(cold: dict, warm: dict | None, references: dict[str, dict], args) -> dict:
    """Everything measured, as JSON-able figures (the PNG bytes stay out)."""
    rows = cold["requests"]
    labels = dict.fromkeys(r["label"] for r in rows)
    returns = {label: all(r["pngs"] == first(rows, label)["pngs"] for r in rows if r["label"] == label) for label in labels}
    timings = {label: {"swap_ms": [r["timings"]["swap_ms"] for r in rows if r["label"] == label],
                       "text_encoders_ms": [r["timings"]["text_encoders_ms"] for r in rows if r["label"] == label],
                       "generate_ms": [r["timings"]["generate_ms"] for r in rows if r["label"] == label]}
               for label in labels}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "sequence": [r["label"] for r in rows],
              "startup_cold": cold["startup"], "peak_rss_gib_cold": cold["peak_rss_gib"],
              "recompiles": max(r["recompiles"] for r in rows), "same_bytes_on_return": returns, "timings": timings,
              "comparison": compare(rows, references) if references else {},
              "references": {d: {k: v for k, v in ref.items() if k != "requests"} | {
                  "pack_s": {r["label"]: r["pack_s"] for r in ref["requests"]},
                  "encode_s": {r["label"]: r.get("encode_s") for r in ref["requests"]},
                  "adapter_load_s": {r["label"]: r["adapter_load_s"] for r in ref["requests"]}}
                  for d, ref in references.items()}}
    if warm is not None:
        result["startup_warm"], result["peak_rss_gib_warm"] = warm["startup"], warm["peak_rss_gib"]
        result["warm_recompiles"] = max(r["recompiles"] for r in warm["requests"])
        result["warm_same_bytes"] = all(r["pngs"] == first(rows, r["label"])["pngs"] for r in warm["requests"])
    # The pack against plain diffusers' unfused pack (eager, as users run it), same request, each
    # reference dtype: the server's median generate_ms (its pipeline call encodes the prompt, denoises
    # and decodes) over the reference's prompt encoding plus its pipeline call from the embeddings.
    result["pack_ratio_vs_diffusers"] = {
        dtype: {label: round(median(timings[label]["generate_ms"]) / (request_s(first(ref["requests"], label)) * 1000), 2)
                for label in labels if any(r["label"] == label for r in ref["requests"])}
        for dtype, ref in references.items()}
    return result


def table(result: dict) -> str:
    from bench.harness import markdown_table

    cold, t = result["startup_cold"], result["timings"]
    rows = [["load (from_pretrained, slots)", f"{cold['load_s']} s"],
            ["warm-up, cold (empty inductor cache, no artifacts)", f"{cold['warmup_s']} s"],
            ["chunk-size measurement, cold (--batch-size auto)", f"{cold.get('chunk_measurement_s', 0.0)} s"],
            ["process start to ready, cold", f"{cold['process_start_to_ready_s']} s"]]
    if "startup_warm" in result:
        warm = result["startup_warm"]
        rows += [["warm-up from the saved compile artifacts (empty inductor cache)", f"{warm['warmup_s']} s"],
                 ["chunk-size measurement, warm (the saved one is loaded)", f"{warm.get('chunk_measurement_s', 0.0)} s"],
                 ["process start to ready, warm", f"{warm['process_start_to_ready_s']} s"]]
    for label in t:
        rows.append([f"pack, {label} (median generate_ms)", f"{median(t[label]['generate_ms']) / 1000:.1f} s"])
        if label != "none":
            rows.append([f"swap in, {label}: denoiser / text encoders (each time)",
                         f"{t[label]['swap_ms']} ms / {t[label]['text_encoders_ms']} ms"])
    for dtype, ratios in result.get("pack_ratio_vs_diffusers", {}).items():
        for label, ratio in ratios.items():
            rows.append([(f"request {label} (prompt encoding + pack): server ({result['args']['dtype']}, compiled) / plain "
                         f"diffusers {dtype} eager, unfused"),
                         f"{ratio}x"])
    rows += [["peak resident memory, server and engine processes (cold start)", f"{result['peak_rss_gib_cold']} GiB"],
             *([["peak resident memory, server and engine processes (warm start)", f"{result['peak_rss_gib_warm']} GiB"]]
               if "peak_rss_gib_warm" in result else []),
             *[[f"peak resident memory, plain diffusers {d} (two phases)", f"{r['peak_rss_gib']} GiB"]
               for d, r in result["references"].items()],
             ["recompiles after warm-up (all requests)", result["recompiles"]],
             ["same bytes when an adapter comes back", result["same_bytes_on_return"]]]
    for dtype, per_label in result["comparison"].get("server_vs", {}).items():
        rows.append([f"server vs diffusers {dtype}, max / mean levels", {k: f"{v['max']} / {v['mean']}" for k, v in per_label.items()}])
    for pair, per_label in result["comparison"].get("reference_noise", {}).items():
        rows.append([f"diffusers {pair.replace('_vs_', ' vs ')} (its dtype noise)", {k: f"{v['max']} / {v['mean']}" for k, v in per_label.items()}])
    for dtype, per_label in result["comparison"].get("adapter_effect", {}).items():
        rows.append([f"adapter effect on diffusers {dtype} (vs none)", {k: f"{v['max']} / {v['mean']}" for k, v in per_label.items()}])
    return markdown_table([f"full-size {FAMILIES[result['args']['family']]}, CPU", "measured"], rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="a full-size model served on the CPU against plain diffusers")
    p.add_argument("--family", choices=sorted(FAMILIES), default="sdxl")
    p.add_argument("--work", type=Path, default=None,
                   help="model, adapters, logs, caches (default: .cache/fullsize for SDXL, .cache/fullsize-FAMILY)")
    p.add_argument("--model", type=Path, default=None, help="the model folder (default: WORK/FAMILY; built if missing)")
    p.add_argument("--dtype", default="bfloat16", help="the server's dtype")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--num-images", type=int, default=1)
    p.add_argument("--batch-size", default="1", help="a number (fixed: no chunk-size measurement at start-up) or auto")
    p.add_argument("--target-rank", type=int, default=128)
    p.add_argument("--size", default="256x256")
    p.add_argument("--reference-dtypes", default="bfloat16,float32", help="plain diffusers runs, comma-separated")
    p.add_argument("--no-warm", dest="warm", action="store_false", help="skip the restart from the artifacts")
    p.add_argument("--warm-caches", action="store_true",
                   help="keep the inductor cache and compile artifacts of earlier runs (faster; for the tests)")
    p.add_argument("--reuse", action="store_true", help="reuse the servers' and references' saved figures in --work")
    p.add_argument("--ready-timeout-s", type=float, default=3600)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p


def run(args) -> dict:
    """The whole measurement (see the module docstring); one full-size process at a time."""
    if args.work is None:  # one folder per family: the saved figures and artifacts (--reuse) are the family's
        args.work = REPO / ".cache" / ("fullsize" if args.family == "sdxl" else f"fullsize-{args.family}")
    args.work = args.work.resolve()  # the server resolves adapter refs as absolute paths under its roots
    args.work.mkdir(parents=True, exist_ok=True)
    model, refs = ensure_model((args.model or args.work / args.family).resolve(), args.family)
    dtypes = [d for d in args.reference_dtypes.split(",") if d]
    # The server's own dtype first (a wrong reference fails in minutes, not after the compile).
    references = {d: run_reference(model, refs, args, d) for d in dtypes if d == args.dtype}
    artifacts = args.work / "compile-artifacts"
    if not args.warm_caches and not (args.reuse and (args.work / "server-cold.json").is_file()):
        subprocess.run(["rm", "-rf", str(artifacts)], check=True)  # cold: compiled from scratch, artifacts saved
    cold = run_server(model, refs, args, "cold", artifacts, sequence(args.family))
    references |= {d: run_reference(model, refs, args, d) for d in dtypes if d != args.dtype}
    references = {d: references[d] for d in dtypes}
    warm = run_server(model, refs, args, "warm", artifacts, sequence(args.family)[:1]) if args.warm else None
    return summarize(cold, warm, references, args)


def main() -> None:
    args = parser().parse_args()
    from bench.harness import write_results

    result = run(args)
    name = "full_size" if args.family == "sdxl" else f"full_size_{args.family}"
    write_results(args.out, name, result, table(result),
                  f"The real {FAMILIES[args.family]} architecture (random weights), `hotlora serve --dtype {args.dtype} --sizes {args.size} "
                  f"--batch-size {args.batch_size} --target-rank {args.target_rank} --compile`, {args.steps} steps, "
                  f"{args.num_images} image(s), guidance 5, against plain diffusers (unfused LoRA). "
                  f"`PYTHONPATH=src .venv/bin/python bench/full_size.py --family {args.family}`")


if __name__ == "__main__":
    main()
