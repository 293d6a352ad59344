"""Rebuilds back off and give up: a worker whose engine cannot be rebuilt answers 503 with the
reason instead of retrying forever while its queue waits. The engine here is a stand-in: this
tests the worker's loop, not generation."""

import threading
import time
from types import SimpleNamespace

import pytest

from hotlora.engine.request import CallParams, PreparedRequest
from hotlora.engine.worker import Job, NotAccepting, Worker
from hotlora.errors import EngineError

WAIT_S = 30  # every wait below is bounded


class FaultyEngine:
    """Fails every generation with an engine fault, as a corrupted GPU would."""

    store = None
    writer = SimpleNamespace(mixes_requests=False)
    batch_size = 1
    recompiles = 0

    def describe(self):
        return {"fake": True}

    def run(self, request):
        raise EngineError("the denoiser produced non-finite values")


def job(prompt: str) -> Job:
    return Job(PreparedRequest(prompt=prompt, params=CallParams(num_inference_steps=1, guidance_scale=1.0, height=32,
                                                                width=32), adapters={}))


def test_failed_rebuilds_back_off_then_give_up_with_503s():
    builds = []
    release = threading.Event()

    def factory():
        builds.append(time.monotonic())
        if len(builds) == 1:
            return FaultyEngine()
        release.wait(WAIT_S) if len(builds) == 2 else None  # hold the first rebuild until a job queues
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker = Worker(factory, max_rebuild_attempts=3, rebuild_backoff_s=0.05)
    worker.start()
    first = worker.submit(job("a"))
    deadline = time.monotonic() + WAIT_S
    while len(builds) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    queued = worker.submit(job("b"))  # waits behind the rebuild
    release.set()

    with pytest.raises(EngineError):
        first.result(timeout=WAIT_S)
    with pytest.raises(NotAccepting, match="3 rebuilds failed in a row.*illegal memory access"):
        queued.result(timeout=WAIT_S)
    assert len(builds) == 1 + 3
    gaps = [b - a for a, b in zip(builds[2:], builds[3:])] + [builds[2] - builds[1]]
    assert min(gaps) >= 0.05  # backed off between attempts
    assert worker.failed and not worker.ready
    with pytest.raises(NotAccepting, match="the engine is down"):
        worker.submit(job("c"))
    worker.stop(drain_timeout_s=1)


def test_a_rebuild_that_succeeds_later_serves_again():
    builds = []

    class Healthy(FaultyEngine):
        def run(self, request):
            return "ok"

    def factory():
        builds.append(1)
        if len(builds) == 1:
            return FaultyEngine()
        if len(builds) == 2:
            raise RuntimeError("transient")
        return Healthy()

    worker = Worker(factory, max_rebuild_attempts=3, rebuild_backoff_s=0.01)
    worker.start()
    with pytest.raises(EngineError):
        worker.submit(job("a")).result(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not worker.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.ready and worker.rebuilds == 1 and worker.failed is None
    assert worker.submit(job("b")).result(timeout=WAIT_S) == "ok"
    worker.stop(drain_timeout_s=1)
