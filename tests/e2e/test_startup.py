"""A start-up that cannot succeed ends `hotlora serve` with a non-zero exit and the reason, so an
orchestrator shows a failed container instead of one whose /readyz stays false forever."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from ..helpers import free_port

EXIT_TIMEOUT_S = 300  # importing torch and diffusers, loading a tiny model: well under this


def serve(model, port) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hotlora.cli", "serve", "--model", str(model), "--port", str(port),
                             "--no-compile"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def processes_marked(marker: str) -> list[int]:
    """Live processes (this user's) whose environment holds ``marker``: a server's children inherit it."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone, or another user's
            pass
    return found


def test_a_model_no_family_serves_exits_before_listening(tmp_path):
    """Refused after the engine process was spawned ahead (it imports while the server checks):
    that child ends with the server, not left behind."""
    model = tmp_path / "tiny-cogvideox"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "CogVideoXPipeline",
                                                       "transformer": ["diffusers", "CogVideoXTransformer3DModel"]}))
    marker = f"HOTLORA_TEST_MARKER={uuid.uuid4().hex}"
    name, value = marker.split("=")
    done = subprocess.run([sys.executable, "-m", "hotlora.cli", "serve", "--model", str(model), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
                          env={**os.environ, name: value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CogVideoXPipeline is not a pipeline hotlora serves" in done.stderr
    assert "video pipeline" in done.stderr and "hotlora families" in done.stderr
    assert processes_marked(marker) == []


def test_an_engine_that_fails_to_start_ends_the_server_with_exit_1(tiny_models, tmp_path):
    """The model's files are read once the server listens (so /healthz answers during a long
    warm-up); a failure there ends the process."""
    import shutil

    model = tmp_path / "broken"
    shutil.copytree(tiny_models["flux"], model)
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    port = free_port()
    process = serve(model, port)
    try:
        output = process.communicate(timeout=EXIT_TIMEOUT_S)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, output
    assert "listening on http://" in output  # it failed after it listened: the engine's start, not a check before
    assert "spawned ahead" in output  # the engine process spawned as the server started is the one given the model
    assert "error: start-up failed: ModelLoadError" in output and "broken" in output


def test_a_jobs_dir_that_cannot_be_written_exits_before_listening(tiny_models, tmp_path):
    """A read-only root filesystem with no volume for jobs (the image's first smoke run) would
    otherwise fail every job on its first write: refused at start-up, naming the setting."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "hotlora.cli", "serve", "--model", str(tiny_models["flux"]),
                           "--port", str(free_port()), "--no-compile", "--jobs-dir", str(blocker / "jobs")],
                          capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "jobs_dir" in done.stderr and "HOTLORA_JOBS_DIR" in done.stderr and "cannot be written" in done.stderr
    assert "listening on http://" not in done.stdout + done.stderr
