"""The lent GPU machine's situation, on the CPU: a Python holding only the image's packages
(bench/device-image.txt, linked from this venv: ``python -m bench.device_env image-env``), the
wheels bench/device-wheels.sh derives, installed by bench/device.sh as it installs them there, then
its preflight and a dry run of one row. A runtime dependency that the wheels do not carry fails
here instead of on the GPU machine (issue #33: pydantic-settings). Needs the package index for the
first download; the wheels stay in .cache/device-wheels for the next run."""

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench import device_deps

REPO = Path(__file__).resolve().parents[2]
ROW = "every_linear"  # two adapters, a pack and the swap rows: most of what the GPU run does


def index_url() -> str:
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                capture_output=True, text=True, check=False).stdout.strip()
    return os.environ.get("PIP_INDEX_URL") or configured or "https://pypi.org/simple/"


def index_reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/pip/", method="HEAD"), timeout=5):
            return True
    except OSError:
        return False


def clean_env(**extra) -> dict:
    """The test process's environment without what points Python at this venv or this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The image-only Python and the wheels, as a developer makes them before the device call."""
    root = tmp_path_factory.mktemp("device")
    built = subprocess.run([sys.executable, "-m", "bench.device_env", "image-env", str(root / "image")], cwd=REPO,
                           capture_output=True, text=True, check=False, env=clean_env())
    assert built.returncode == 0, built.stderr
    python = str(root / "image" / "bin" / "python")
    lacking = subprocess.run([python, "-c", "import pydantic_settings"], capture_output=True, text=True, check=False)
    assert lacking.returncode != 0, "the image has no pydantic-settings: without the wheels, the issue's failure"
    url = index_url()
    if not index_reachable(url):
        pytest.skip(f"the package index {url} is unreachable: bench/device-wheels.sh cannot download the wheels")
    wheels = root / "whl"
    fetched = subprocess.run(["bash", "bench/device-wheels.sh"], cwd=REPO, capture_output=True, text=True, check=False,
                             timeout=600, env=clean_env(VENV_PY=sys.executable, DRY_PYTHON=python, WHEELS_DIR=str(wheels),
                                                        WHEEL_CACHE=str(REPO / ".cache" / "device-wheels")))
    assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    return {"python": python, "wheels": wheels, "root": root, "log": fetched.stdout}


def run_device_sh(repo: Path, device: dict, out: Path, *args: str, model: str = "flux") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/device.sh", "--dry-run", *args], cwd=repo, capture_output=True, text=True,
                          check=False, timeout=600,
                          env=clean_env(PYTHON=device["python"], OUT=str(out), WHEELS_DIR=str(device["wheels"]),
                                        DEVDEPS=str(out.parent / f"{out.name}-deps"), MODEL=model))


def test_the_wheels_carry_the_declared_dependencies(device):
    manifest = json.loads((device["wheels"] / device_deps.MANIFEST).read_text())
    needed = {p["name"]: p for p in manifest["packages"] if p["tier"] == "needed"}
    assert {"pydantic-settings", "pydantic", "pydantic-core", "python-dotenv", "typing-inspection", "annotated-types",
            "diffusers", "peft", "torchao"} <= set(needed)
    assert any(device_deps.wheel_fits(w, device_deps.IMAGE_PYTHON) for w in needed["pydantic-core"]["wheels"])
    assert "pydantic-core==" in device["log"] and "transitive of pydantic" in device["log"]


def test_dry_run_in_the_image_only_python(device):
    out = device["root"] / "out"
    run = run_device_sh(REPO, device, out, "--configs", ROW)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "pydantic-settings: missing ->" in run.stdout and "preflight ok" in run.stdout
    report = json.loads((out / "gpu.json").read_text())
    assert report["configs_done"] == [ROW] and report["done"] is True
    assert report[ROW]["pack_ms"] > 0 and report["swap"] and report["plan_check"]["planned_activation_gib"] > 0
    assert not [k for k in report if k.startswith("error_")], report
    assert (out / "device.log").exists()


def test_the_wan_rows_dry_run_in_the_image_only_python(device):
    """``MODEL=wan``: Wan 2.1 T2V 1.3B's transformer (here one block of two heads) serving one video
    a pack with two adapters, its swap rows; no plan row (calibrated on Flux)."""
    out = device["root"] / "out-wan"
    run = run_device_sh(REPO, device, out, "--configs", ROW, model="wan")
    assert run.returncode == 0, run.stdout[-6000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["args"]["model"] == "wan" and report["args"]["frames"] == 5
    assert report["configs_done"] == [ROW] and report["done"] is True and "plan_check" not in report
    assert report[ROW]["pack_ms"] > 0 and report[ROW]["recompiles"] == 0 and report["swap"]
    assert not [k for k in report if k.startswith("error_")], report


def test_the_families_rows_dry_run_in_the_image_only_python(device):
    """``MODEL=families``: bench/families.py's row for one family (here SD3's tiny model, eager) with its
    swap, slots against no slots and plain diffusers, and mixed batch against one at a time."""
    out = device["root"] / "out-families"
    run = run_device_sh(REPO, device, out, model="families")
    assert run.returncode == 0, run.stdout[-6000:]
    assert "imports of bench.families and its bench modules ok" in run.stdout
    (row,) = json.loads((out / "gpu-families.json").read_text())["rows"]
    assert "error" not in row, row
    assert row["family"] == "sd3" and row["swap_ms"] > 0 and row["mixed_batch"] > 0 and row["diffusers_quarter"] > 0
    assert set(row["recompiles"].values()) == {0}
    assert "| sd3 | tiny |" in (out / "gpu-families.md").read_text()


def test_an_undeclared_dependency_fails_the_preflight(device, tmp_path):
    """The check of the check: hotlora.engine importing a package the venv has (the serve extra's
    fastapi) but the runtime dependencies do not declare stops device.sh before the bench."""
    manifest = json.loads((device["wheels"] / device_deps.MANIFEST).read_text())
    assert "fastapi" not in {p["name"] for p in manifest["packages"]}
    assert "fastapi" not in device_deps.read_image()
    scratch = tmp_path / "repo"
    for part in ("bench", "src"):
        shutil.copytree(REPO / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(REPO / "pyproject.toml", scratch)
    engine = scratch / "src" / "hotlora" / "engine" / "__init__.py"
    engine.write_text(engine.read_text() + "\nimport fastapi  # noqa: E402, F401\n")  # valid whatever the module holds
    out = tmp_path / "out"
    run = run_device_sh(scratch, device, out, "--configs", ROW)
    assert run.returncode == 3, run.stdout[-6000:]
    assert "FAIL hotlora.engine: ModuleNotFoundError: No module named 'fastapi'" in run.stdout
    assert "preflight FAILED" in run.stdout and not (out / "gpu.json").exists()
