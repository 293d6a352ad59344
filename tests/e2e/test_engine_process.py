"""The engine in its own process, through a real server: killed (SIGKILL, SIGSEGV) or stopped
(SIGSTOP: a stall) mid-request and while idle, the server stays up, answers every request (served,
or 503 with Retry-After naming the engine restart; none hangs), starts a new engine process and
serves the same pixels as before."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..helpers import generate, metric, pixels

WAIT_S = 300  # every wait below is bounded
STALL_S = 20.0  # the server's stall deadline here: far above a tiny step, even on a loaded machine


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory, start_server):
    tmp = tmp_path_factory.mktemp("engine-process")
    adapters = tiny_models["flux"] / "adapters"
    server = start_server(tiny_models["flux"], tmp, roots=(adapters,), engine_stall_timeout_s=STALL_S,
                          engine_spare_process=True)
    return server, adapters


def engine_pid(url) -> int:
    return httpx.get(f"{url}/readyz", timeout=10).json()["engine"]["engine_pid"]


def serving_pid(url) -> int | None:
    """The engine process /readyz reports ready, from ONE answer; None while it is not ready."""
    ready = httpx.get(f"{url}/readyz", timeout=10)
    return ready.json()["engine"]["engine_pid"] if ready.status_code == 200 else None


def wait_ready(url, old_pid: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ready = httpx.get(f"{url}/readyz", timeout=10)
        if ready.status_code == 200 and ready.json()["engine"]["engine_pid"] != old_pid:
            return ready.json()["engine"]["engine_pid"]
        time.sleep(0.2)
    raise AssertionError("the engine process never came back")


def good(adapters):
    return (str(adapters / "identity-diffusers"), 1.0), (str(adapters / "style-kohya.safetensors"), 0.6)


def test_the_engine_runs_in_a_child_process_of_the_server(served):
    server, adapters = served
    pid = engine_pid(server.url)
    assert pid != os.getpid()
    with open(f"/proc/{pid}/stat") as stat:
        assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # its parent: this test's server
    assert generate(server.url, *good(adapters), n=2, seed=3).status_code == 200


def in_flight_then(server, adapters, act, requests=6):
    """``requests`` concurrent generations (long enough to be running or queued), ``act()`` once the
    engine has started on them, then every answer."""
    with ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(generate, server.url, *good(adapters), n=3, seed=i, num_inference_steps=40)
                   for i in range(requests)]
        deadline = time.monotonic() + WAIT_S
        while httpx.get(f"{server.url}/readyz", timeout=10).json()["queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        act()
        return [f.result(timeout=WAIT_S) for f in futures]  # none hangs: each has an answer


def assert_answered(answers):
    failed = [a for a in answers if a.status_code != 200]
    assert failed, "the engine died with nothing in flight"
    for answer in failed:
        assert answer.status_code == 503, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        assert "engine process" in answer.json()["error"] and "restart" in answer.json()["error"]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSEGV"])
def test_an_engine_killed_mid_request_costs_a_restart_not_the_server(served, how):
    server, adapters = served
    expected = pixels(generate(server.url, *good(adapters), n=2, seed=11))
    pid = engine_pid(server.url)
    restarts = metric(server.url, 'hotlora_engine_restarts_total{cause="signal"}')

    answers = in_flight_then(server, adapters, lambda: os.kill(pid, getattr(signal, how)))
    assert_answered(answers)
    assert httpx.get(f"{server.url}/healthz").status_code == 200  # the server never went down

    new = wait_ready(server.url, pid)
    assert (pixels(generate(server.url, *good(adapters), n=2, seed=11)) == expected).all()
    assert metric(server.url, 'hotlora_engine_restarts_total{cause="signal"}') == restarts + 1
    assert how in httpx.get(f"{server.url}/readyz").json()["last_engine_exit"]
    assert new != pid


def test_an_engine_that_dies_while_idle_is_noticed_at_once(served):
    server, adapters = served
    pid = engine_pid(server.url)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # not at the next request: the watcher sees the exit
    while serving_pid(server.url) == pid:  # status and pid from one answer: the death may land between two
        assert time.monotonic() < deadline, "/readyz stayed true with its engine dead"
        time.sleep(0.05)
    wait_ready(server.url, pid)
    assert generate(server.url, *good(adapters), n=1, seed=1).status_code == 200


def test_a_spare_engine_process_replaces_one_that_dies(served):
    """A spare child (its imports done) waits beside each warm engine process; the one that died is
    replaced by it, and the new engine process gets a spare of its own."""
    server, adapters = served
    pid = engine_pid(server.url)
    spare = server.serving.next_engine_process.pid
    assert spare is not None and spare != pid
    os.kill(pid, signal.SIGKILL)
    assert wait_ready(server.url, pid) == spare
    follower = server.serving.next_engine_process.pid
    assert follower is not None and follower not in (pid, spare)
    assert generate(server.url, *good(adapters), n=1, seed=1).status_code == 200


def test_a_stalled_engine_is_killed_after_the_deadline_and_replaced(served):
    server, adapters = served
    pid = engine_pid(server.url)
    stalls = metric(server.url, 'hotlora_engine_restarts_total{cause="stall"}')

    began = time.monotonic()
    answers = in_flight_then(server, adapters, lambda: os.kill(pid, signal.SIGSTOP), requests=3)
    assert time.monotonic() - began >= STALL_S  # killed for its silence, not before
    assert_answered(answers)
    wait_ready(server.url, pid)
    assert metric(server.url, 'hotlora_engine_restarts_total{cause="stall"}') == stalls + 1
