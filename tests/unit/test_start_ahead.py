"""What a start does ahead of its need, so a restart from the compile artifacts waits less: the
engine process spawned before the server's own start-up, and inductor's CPU ISA probe in a thread."""

import subprocess
import sys

import torch

from hotlora.engine import device
from hotlora.engine.process import SpawnedAhead

PROBE = """
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
from hotlora.engine.device import probe_cpu_isa_ahead
before = valid_vec_isa_list.cache_info().currsize
thread = probe_cpu_isa_ahead()
thread.join(timeout=120)
print(before, valid_vec_isa_list.cache_info().currsize, probe_cpu_isa_ahead() is thread)
"""


def test_the_isa_probe_fills_inductors_own_cache_once_per_process():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "True"]  # empty before, filled by the thread, started once


def test_no_isa_probe_where_cuda_compiles(monkeypatch):
    monkeypatch.setattr(device, "_isa_probe", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.probe_cpu_isa_ahead() is None


def test_an_engine_process_spawned_ahead_is_taken_once_and_discarded_if_not():
    ahead = SpawnedAhead()
    process = ahead.take()[0]
    assert ahead.take() is None  # once
    process.kill()
    process.join(timeout=30)

    untaken = SpawnedAhead()
    child = untaken._spawned[0]
    untaken.discard()  # the server refused to start
    assert not child.is_alive() and untaken.take() is None


def test_a_child_that_died_before_it_was_taken_is_not_used():
    ahead = SpawnedAhead()
    child = ahead._spawned[0]
    child.kill()
    child.join(timeout=30)
    assert ahead.take() is None  # EngineProcess.start spawns a new one


IMPORT_AHEAD = """
import json, sys
from pathlib import Path
from hotlora.engine.pipeline import import_pipeline_classes
folder = Path(sys.argv[1])
(folder / "model_index.json").write_text(json.dumps({
    "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
    "text_encoder": ["transformers", "CLIPTextModel"], "safety_checker": [None, None],
    "scheduler": ["os", "system"], "vae": ["diffusers", "NoSuchAutoencoder"]}))
lazy = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion"
print(lazy in sys.modules)
print(import_pipeline_classes("owner/a-hub-id"), import_pipeline_classes(folder / "missing"))
print(" ".join(import_pipeline_classes(folder)))
print(lazy in sys.modules, "transformers.models.clip.modeling_clip" in sys.modules)
"""


def test_the_child_spawned_ahead_imports_what_loading_the_model_would(tmp_path):
    """diffusers imports a pipeline's module and its components' (transformers) lazily, at the load;
    the engine process spawned ahead imports them while the server plans: the names a local
    model_index.json gives, from diffusers and transformers only, nothing for a hub id."""
    done = subprocess.run([sys.executable, "-c", IMPORT_AHEAD, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False", "[] []",
        "diffusers.StableDiffusionPipeline diffusers.UNet2DConditionModel transformers.CLIPTextModel",
        "True True"]
