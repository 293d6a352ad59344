"""``make test``'s scheduler (tests/scheduling.py): tests that share a fixture's instance run in one
process, so each expensive fixture (a compiled engine) is built once in the run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ..scheduling import STORE_DURATIONS_ENV

REPO = Path(__file__).resolve().parents[2]

CONFTEST = f"""
import os, sys
import pytest
sys.path.insert(0, {str(REPO)!r})
from tests.scheduling import register


def pytest_configure(config):
    register(config)


def built(what):
    with open(os.path.join(os.path.dirname(__file__), "built.log"), "a") as log:
        log.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{what}}\\n")


@pytest.fixture(scope="session", params=["flux", "sdxl"])
def engine(request):
    built("engine " + request.param)
    return request.param
"""

ONE = """
import pytest
from conftest import built


@pytest.fixture(scope="module", params=["x", "y", "z"])
def per_module(request):
    built("module " + request.param)
    return request.param


@pytest.mark.parametrize("i", range(4))
def test_module_fixture(per_module, i):
    pass


def test_engine(engine):
    pass


def test_free():
    pass
"""

TWO = """
def test_engine_again(engine):
    pass


def test_engine_once_more(engine):
    pass
"""


def test_each_fixture_instance_is_built_once_across_both_processes(tmp_path):
    for name, text in {"conftest.py": CONFTEST, "test_one.py": ONE, "test_two.py": TWO}.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    # Without the recorder's variable: under `make test-durations` this inner run would store its 19
    # tests' times over the record the outer run keeps when it fails.
    env = {k: v for k, v in os.environ.items() if k != STORE_DURATIONS_ENV}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "19 passed" in run.stdout
    builds = [line.split(" ", 1) for line in (tmp_path / "built.log").read_text().splitlines()]
    built = sorted(what for _, what in builds)
    assert built == ["engine flux", "engine sdxl", "module x", "module y", "module z"]
    assert {worker for worker, _ in builds} == {"gw0", "gw1"}  # and the work was shared

