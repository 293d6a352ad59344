"""Engine options: attention backends through diffusers' dispatcher, compile artifacts across restarts."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from hotlora import Engine

SRC = str(Path(__file__).resolve().parents[2] / "src")  # this checkout's code, whatever the venv installed


# What an inductor cache keeps that holds no graph: the compiled kernels, one folder per source hash
# (their .cpp and .so). The graph caches (FX graphs, AOT autograd) are what the compile artifacts carry.
GRAPH_CACHES = {"fxgraph", "aotautograd", "locks"}


def start_in_new_process(script: str, tmp_path: Path, name: str, *args: str, kernels_of: str | None = None):
    """``script`` in a new interpreter whose inductor cache holds no graphs, so the compile artifacts
    file is all the processes share of their graphs. ``kernels_of``: an earlier process (by name)
    whose compiled kernels are linked into this one's cache first. A kernel is found by the hash of
    its source, whoever compiled it, so this changes no graph, hit or miss, only whether g++ builds
    the same kernel again (each ~0.8 s on 2 cores, most of these processes' time otherwise)."""
    inductor = tmp_path / f"inductor-{name}"
    if kernels_of is not None:
        for folder in (tmp_path / f"inductor-{kernels_of}").iterdir():
            if folder.is_dir() and folder.name not in GRAPH_CACHES:
                shutil.copytree(folder, inductor / folder.name, copy_function=os.link)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          env=env)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fa3_falls_back_to_native_sdpa_on_a_cpu_with_a_log_line(tiny_models):
    native = Engine.from_pretrained(tiny_models["flux"], target_rank=8, batch_size=2, compile=False)
    logger, collect = logging.getLogger("hotlora.engine.pipeline"), Collect()
    logger.addHandler(collect)
    try:
        wanted = Engine.from_pretrained(tiny_models["flux"], target_rank=8, batch_size=2, compile=False,
                                        attention_backend="fa3")
    finally:
        logger.removeHandler(collect)
    assert wanted.attention_backend == "native" and wanted.describe()["attention_backend"] == "native"
    assert any("falling back to native SDPA" in m for m in collect.messages)
    assert any("_flash_3_hub unavailable" in m for m in collect.messages)
    a = native.generate("a cat", num_images=2, num_inference_steps=2, output_type="latent").images
    b = wanted.generate("a cat", num_images=2, num_inference_steps=2, output_type="latent").images
    torch.testing.assert_close(a, b, atol=0, rtol=0)


START = textwrap.dedent("""
    import json, sys, time
    began = time.perf_counter()
    from hotlora import Engine
    from hotlora.engine.pipeline import graph_count
    # Three rank buckets, none of them 0: the ranks are one symbolic size, so only the first compiles.
    engine = Engine.from_pretrained(sys.argv[1], target_rank=8, batch_size=1, compile=True,
                                    compile_cache_dir=sys.argv[2], rank_buckets=(2, 4))
    print(json.dumps({"loaded": engine.compile_artifacts_loaded, "recompiles": engine.recompiles,
                      "graphs": graph_count(), "skipped": engine.warm.warmup_skipped}))
""")


def test_compile_artifacts_are_saved_after_warm_up_and_loaded_by_the_next_process(tiny_models, tmp_path):
    """Two real processes whose inductor caches hold no graphs (``start_in_new_process``): the second
    starts from the first's artifacts. Each rank bucket is a writer state, but they share their graphs:
    the warm-up passes of buckets 4 and 2 compile nothing after bucket 8's (the record says so, and a
    restart skips them). The tiny SDXL, as in the test below."""

    def start(name, kernels_of=None):
        done = start_in_new_process(START, tmp_path, name, str(tiny_models["sdxl"]), str(tmp_path / "compile"),
                                    kernels_of=kernels_of)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = start("first")
    assert first["graphs"] > 0 and first == {"loaded": False, "recompiles": 0, "graphs": first["graphs"], "skipped": 0}
    saved = list((tmp_path / "compile").glob("compile-artifacts-*.bin"))
    assert len(saved) == 1 and saved[0].stat().st_size > 0
    (record,) = (tmp_path / "compile").glob("warmup-*.json")
    idle = json.loads(record.read_text())["idle"]
    assert {name.split()[0] for name in idle} == {"state=4", "state=2"}  # state=8 compiled
    assert start("second", kernels_of="first") == {"loaded": True, "recompiles": 0, "graphs": first["graphs"], "skipped": len(idle)}


RESTART = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from hotlora import Engine
    from hotlora.engine import pipeline, warmup

    if sys.argv[3] == "killed":  # killed right after the first writer state's artifacts are saved
        save = pipeline.CompileArtifacts.save
        pipeline.CompileArtifacts.save = lambda self, **how: (save(self, **how), os._exit(3))
    engine = Engine.from_pretrained(sys.argv[1], target_rank=8, batch_size=3, compile=True,
                                    compile_cache_dir=sys.argv[2], rank_buckets=(0,))  # 2 states
    misses = counters["aot_autograd"]["autograd_cache_miss"]
    warm = engine.warm
    torch._dynamo.config.error_on_recompile = True
    for state in warm.writer.warmup_states():  # every shape warm-up covers, as requests run it
        warm.writer.enter(state)
        for batch in (3, 2, 1):
            with warm.section():
                warmup._run(warm, batch, *warm.served_sizes[0], warm.defaults["guidance_scale"])
    second = None
    if sys.argv[3] == "restart":  # a second engine in this process finds the first one's graphs: no record
        torch._dynamo.config.error_on_recompile = False  # its warm-up adds graphs to the same code objects
        again = Engine.from_pretrained(sys.argv[1], target_rank=8, batch_size=3, compile=True,
                                       compile_cache_dir=sys.argv[2] + "-second", rank_buckets=(0,))
        second = {"skipped": again.warm.warmup_skipped,
                  "records": len(list(Path(sys.argv[2] + "-second").glob("warmup-*.json")))}
    print(json.dumps({"loaded": engine.compile_artifacts_loaded, "skipped": warm.warmup_skipped,
                      "misses": misses, "recompiles": engine.recompiles, "second": second}))
""")


def test_a_warm_up_killed_half_way_leaves_its_states_and_a_restart_skips_passes_that_compile_nothing(
        tiny_models, tmp_path):
    """Real processes whose inductor caches hold no graphs (``start_in_new_process``), so the artifacts
    file is all they share of them. The tiny SDXL: the warm-up and its artifacts are no family's own,
    and it compiles in half Flux's time."""

    def start(name, kernels_of=None):
        return start_in_new_process(RESTART, tmp_path, name, str(tiny_models["sdxl"]), str(tmp_path / "compile"),
                                    name, kernels_of=kernels_of)

    killed = start("killed")
    assert killed.returncode == 3, killed.stderr[-2000:]
    (saved,) = (tmp_path / "compile").glob("compile-artifacts-*.bin")
    half = saved.stat().st_size
    assert half > 0 and not list((tmp_path / "compile").glob("warmup-*.json"))  # the record needs a whole warm-up

    def finished(name, kernels_of):
        done = start(name, kernels_of)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    successor = finished("successor", kernels_of="killed")  # the first state from the file, the second compiled
    assert successor["loaded"] and successor["skipped"] == 0 and successor["misses"] > 0 and not successor["second"]
    assert successor["recompiles"] == 0 and saved.stat().st_size > half  # and the file completed
    (record,) = (tmp_path / "compile").glob("warmup-*.json")
    idle = json.loads(record.read_text())["idle"]
    # Batch 3 after batch 2 compiles nothing (the batch dimension is dynamic by then), in both states.
    assert all(any(name.startswith(f"state={state} ") and "batch=3" in name for name in idle) for state in (8, 0))
    restart = finished("restart", kernels_of="successor")
    assert restart == {"loaded": True, "skipped": len(idle), "misses": 0, "recompiles": 0,
                       "second": {"skipped": 0, "records": 0}}


def held_bytes(pipeline) -> int:
    """Bytes of every distinct storage the pipeline's modules hold (parameters and buffers)."""
    seen, total = set(), 0
    for component in pipeline.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for tensor in [*component.parameters(), *component.buffers()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def test_the_engine_holds_the_model_and_its_slots_and_nothing_else(tiny_models):
    """The article's fuse_qkv lesson: no hidden copies of weights (4 GB held for nothing)."""
    from diffusers import DiffusionPipeline

    base = held_bytes(DiffusionPipeline.from_pretrained(str(tiny_models["sdxl"]), local_files_only=True))
    slots = Engine.from_pretrained(tiny_models["sdxl"], target_rank=8, batch_size=2, compile=False)
    assert held_bytes(slots.pipeline) == base + slots.writer.nbytes
    mixed = Engine.from_pretrained(tiny_models["sdxl"], target_rank=8, batch_size=2, compile=False, mixed=True)
    selector = mixed.writer.selector.index
    assert held_bytes(mixed.pipeline) == base + mixed.writer.nbytes + selector.untyped_storage().nbytes()
