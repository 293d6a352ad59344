"""Engine options: attention backends through diffusers' dispatcher, compile artifacts across restarts."""

import logging
import subprocess
import sys
import textwrap

import torch

from hotlora import Engine


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
    engine = Engine.from_pretrained(sys.argv[1], target_rank=8, batch_size=1, compile=True,
                                    compile_cache_dir=sys.argv[2], rank_buckets=())  # 1 state: CI time
    print(json.dumps({"loaded": engine.compile_artifacts_loaded, "recompiles": engine.recompiles}))
""")


def test_compile_artifacts_are_saved_after_warm_up_and_loaded_by_the_next_process(tiny_models, tmp_path):
    """Two real processes, each with an empty inductor cache: the second starts from the first's artifacts."""

    def start(name):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}"), "PATH": "/usr/bin:/bin",
               "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-c", START, str(tiny_models["flux"]), str(tmp_path / "compile")],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        import json

        return json.loads(done.stdout.strip().splitlines()[-1])

    assert start("first") == {"loaded": False, "recompiles": 0}
    saved = list((tmp_path / "compile").glob("compile-artifacts-*.bin"))
    assert len(saved) == 1 and saved[0].stat().st_size > 0
    assert start("second") == {"loaded": True, "recompiles": 0}


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
