"""The worker's loop with a stand-in engine (what it runs is tested elsewhere): merging queued
requests into one batch, deadlines, clients that left, and listeners that fail."""

import threading
import time
from types import SimpleNamespace

import pytest

from hotlora.engine.request import CallParams, PreparedRequest
from hotlora.engine.worker import ClientGone, DeadlineExceeded, Job, Worker

WAIT_S = 30


class RecordingEngine:
    """Runs nothing; records what it was asked to run together. ``gate`` holds the first run."""

    store = None
    batch_size = 4

    def __init__(self, mixes: bool):
        self.writer = SimpleNamespace(mixes_requests=mixes)
        self.runs = []
        self.gate = threading.Event()

    def describe(self):
        return {}

    def run(self, work):
        self.gate.wait(WAIT_S)
        batch = [work] if isinstance(work, PreparedRequest) else list(work)
        self.runs.append([r.prompt for r in batch])
        results = [f"images of {r.prompt}" for r in batch]
        return results[0] if isinstance(work, PreparedRequest) else results


def job(prompt, images=1, steps=2, deadline=None) -> Job:
    params = CallParams(num_inference_steps=steps, guidance_scale=3.5, height=32, width=32)
    return Job(PreparedRequest(prompt=prompt, params=params, adapters={}, num_images=images), deadline=deadline)


def started(engine, **options) -> Worker:
    worker = Worker(lambda: engine, max_batch_delay_s=0.2, **options)
    worker.start()
    return worker


def test_queued_requests_with_equal_parameters_share_one_batch_up_to_its_size():
    engine = RecordingEngine(mixes=True)
    worker = started(engine)
    blocker = worker.submit(job("blocker", images=4))
    time.sleep(0.1)  # the worker holds the blocker; the rest queue behind it
    futures = {name: worker.submit(job(name, images=n, steps=s))
               for name, n, s in [("a", 2, 2), ("b", 1, 9), ("c", 2, 2), ("d", 1, 2)]}
    engine.gate.set()
    assert blocker.result(WAIT_S) == "images of blocker"
    assert {name: f.result(WAIT_S) for name, f in futures.items()} == {n: f"images of {n}" for n in futures}
    assert engine.runs[0] == ["blocker"]
    assert ["a", "c"] in engine.runs  # 2 + 2 fill the batch of 4; d waits for the next
    assert ["b"] in engine.runs  # other steps: never merged
    assert worker.batches >= 1
    worker.stop(drain_timeout_s=5)


def test_a_writer_that_cannot_mix_runs_each_request_alone():
    engine = RecordingEngine(mixes=False)
    worker = started(engine)
    engine.gate.set()
    futures = [worker.submit(job(name)) for name in "xyz"]
    assert [f.result(WAIT_S) for f in futures] == ["images of x", "images of y", "images of z"]
    assert all(len(run) == 1 for run in engine.runs)
    worker.stop(drain_timeout_s=5)


def test_deadlines_and_departed_clients_are_answered_without_running():
    engine = RecordingEngine(mixes=False)
    events = []
    worker = started(engine, on_event=lambda name, data: events.append(name))
    blocker = worker.submit(job("blocker"))
    time.sleep(0.1)
    late = worker.submit(job("late", deadline=time.monotonic() + 0.05))
    gone = job("gone")
    gone_future = worker.submit(gone)
    gone.cancelled.set()
    time.sleep(0.2)
    engine.gate.set()
    blocker.result(WAIT_S)
    with pytest.raises(DeadlineExceeded):
        late.result(WAIT_S)
    with pytest.raises(ClientGone):
        gone_future.result(WAIT_S)
    assert ["late"] not in engine.runs and ["gone"] not in engine.runs
    assert "dropped" in events
    worker.stop(drain_timeout_s=5)


def test_a_stopped_run_is_answered_by_why_it_stopped():
    """A run stopped at a step boundary (ClientGone from the engine): DeadlineExceeded for a job whose
    deadline passed, ClientGone for one whose caller left (even past its deadline: nobody reads a 504)."""
    stop = ClientGone("cancelled while running: stopped after step 2 of 4")
    late = job("late", deadline=time.monotonic() - 1)
    assert late.stop_when()()
    assert isinstance(late.stopped(stop), DeadlineExceeded) and "stopped after step 2 of 4" in str(late.stopped(stop))
    late.cancelled.set()
    assert late.stopped(stop) is stop
    in_time = job("in time", deadline=time.monotonic() + 60)
    assert not in_time.stop_when()() and in_time.stopped(stop) is stop
    assert not job("no deadline").stop_when()()


def test_a_failing_listener_cannot_break_the_loop():
    engine = RecordingEngine(mixes=False)

    def listener(name, data):
        raise RuntimeError("metrics backend down")

    worker = started(engine, on_event=listener)
    engine.gate.set()
    assert worker.submit(job("a")).result(WAIT_S) == "images of a"
    assert worker.submit(job("b")).result(WAIT_S) == "images of b"
    worker.stop(drain_timeout_s=5)
