import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A deliberate, persistent inductor cache so repeated runs skip most of the compile work.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor compiles C++ kernels in a pool of subprocesses, one per core, in every process that compiles;
# pytest-xdist's workers already share the cores, so beyond each worker's share that pool only adds
# processes (each importing torch) competing for them. Measured on 2 cores, two workers, empty caches:
# the contract tests of four families ran in 205 and 208 s with one compile thread per worker against
# 245 and 273 s with inductor's default of two (the kernels are the same; only where g++ runs differs;
# measured through TORCHINDUCTOR_COMPILE_THREADS, the same config value inside a worker).
# The workers' own compiles only: processes the tests start (servers' engine processes, restarts) keep
# inductor's default, which measured as fast for them (one run each: the engine-process and
# compile-artifact modules in 344 s with the default, 361 s with one thread everywhere).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
    import torch._inductor.config

    torch._inductor.config.compile_threads = max(1, len(os.sched_getaffinity(0)) // _workers)

from .helpers import TARGET_RANK  # noqa: E402


def pytest_configure(config):
    """``make test``'s two processes: tests that share a compiled fixture run in one process, the
    longest sets first (tests/scheduling.py)."""
    from .scheduling import register

    register(config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Every registered family's tiny pipeline, saved once per session (built offline, loaded via
    from_pretrained)."""
    from hotlora.families import FAMILIES
    from hotlora.testing import save_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny_model(root / family, family, target_rank=TARGET_RANK) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_task_models(tiny_models, tmp_path_factory):
    """Each family's tiny model serving every task it declares: its text-to-image one, unless its
    edit checkpoints are another pipeline (Qwen-Image-Edit: ``ModelFamily.build_tiny_edit``)."""
    from hotlora.families import FAMILIES, ModelFamily
    from hotlora.testing import save_tiny_model

    root = tmp_path_factory.mktemp("edit-models")
    return {name: (save_tiny_model(root / name, name, target_rank=TARGET_RANK, edit=True)
                   if type(family).build_tiny_edit is not ModelFamily.build_tiny_edit else tiny_models[name])
            for name, family in FAMILIES.items()}


@pytest.fixture(scope="session", autouse=True)
def many_engines_in_one_process():
    """A test session builds dozens of compiled engines in one process; they share the blocks' code
    objects, so their graphs add up against dynamo's per-code-object recompile limit (8), which a
    server (one engine per process) never reaches. The benchmarks raise it the same way
    (bench/harness.py). ``error_on_recompile`` still fails any request that compiles."""
    import torch

    previous = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    yield
    torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = previous
