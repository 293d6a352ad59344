"""The worker's side of an engine process that dies: every request in flight or queued is
answered 503 (EngineRestarting, with Retry-After), readiness drops at once, a new engine is built,
restarts are counted by cause and a crash loop backs off. The engine is a stand-in here (the real
process is killed in tests/e2e/test_engine_process.py); what crosses the pipe is checked below too."""

import threading
import time

import pytest

from hotlora.engine import worker as worker_module
from hotlora.engine.process import EngineDied, exit_text
from hotlora.engine.wire import RecordedTrace, error_of, error_record, replay
from hotlora.engine.request import CallParams, PreparedRequest, UnservedShape
from hotlora.engine.worker import EngineRestarting, Job, Worker
from hotlora.errors import AdapterRejected
from hotlora.tracing import Trace

WAIT_S = 30


class FakeProcess:
    """An engine process as the worker sees it: ``run`` blocks until told how it ends."""

    writer = type("W", (), {"mixes_requests": False})()
    batch_size = 1
    recompiles = 0
    started_s = 2.2

    def __init__(self, pid):
        self.pid, self.exit_code, self.on_exit = pid, None, None
        self.running = threading.Event()
        self.verdict = threading.Event()
        self.closed = False

    def describe(self):
        return {"engine_pid": self.pid}

    def run(self, request):
        self.running.set()
        self.verdict.wait(WAIT_S)
        self.exit_code = -9
        raise EngineDied(f"the engine process {self.pid} {exit_text(-9)}; an engine restart follows", cause="signal")

    def close(self):
        self.closed = True


def job(prompt="a") -> Job:
    return Job(PreparedRequest(prompt=prompt, params=CallParams(num_inference_steps=1, guidance_scale=1.0, height=32,
                                                                width=32), adapters={}))


def wait_for(predicate):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_death_mid_request_answers_running_and_queued_requests_then_rebuilds():
    engines = []

    def factory():
        engines.append(FakeProcess(100 + len(engines)))
        return engines[-1]

    worker = Worker(factory, rebuild_backoff_s=0.01)
    worker.start()
    assert engines[0].on_exit is not None  # watched from the start
    running = worker.submit(job("a"))
    engines[0].running.wait(WAIT_S)
    queued = worker.submit(job("b"))
    engines[0].verdict.set()

    for future in (running, queued):
        with pytest.raises(EngineRestarting, match="engine process 100 was killed by SIGKILL") as caught:
            future.result(timeout=WAIT_S)
        assert caught.value.retry_after_s >= 3  # the last start's 2.2 s, rounded up, at least
    wait_for(lambda: worker.ready)
    assert len(engines) == 2 and engines[0].closed
    assert worker.restarts == {"signal": 1}
    assert "SIGKILL" in worker.last_exit
    worker.stop(drain_timeout_s=1)


def test_a_death_while_idle_drops_readiness_at_once_and_rebuilds(monkeypatch):
    engines = []
    hold = threading.Event()

    def factory():
        if engines:
            hold.wait(WAIT_S)  # the rebuild waits, so "not ready" can be seen
        engines.append(FakeProcess(200 + len(engines)))
        return engines[-1]

    worker = Worker(factory, rebuild_backoff_s=0.01)
    worker.start()
    first = engines[0]
    first.exit_code = -11
    first.on_exit(first, "signal")  # what the watcher thread calls
    assert not worker.ready
    assert "engine process 200 was killed by SIGSEGV" in worker.why_not_ready()
    hold.set()
    wait_for(lambda: worker.ready and len(engines) == 2)
    assert worker.restarts == {"signal": 1}
    worker.stop(drain_timeout_s=1)


def test_an_engine_that_keeps_dying_at_once_is_restarted_with_growing_delays(monkeypatch):
    slept, real_sleep = [], time.sleep

    def sleep(seconds):  # the worker's waits are recorded, not slept; the test's own polls are real
        if threading.current_thread().name == "hotlora-worker":
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(worker_module.time, "sleep", sleep)
    engines = []

    def factory():
        engines.append(FakeProcess(300 + len(engines)))
        return engines[-1]

    worker = Worker(factory, rebuild_backoff_s=0.5, max_rebuild_backoff_s=1.5)
    worker.start()
    for n in range(4):
        wait_for(lambda: worker.ready and len(engines) == n + 1)
        engine = engines[n]
        engine.exit_code = 1
        engine.on_exit(engine, "exit")
    wait_for(lambda: worker.ready and len(engines) == 5)
    assert slept == [0.5, 1.0, 1.5, 1.5]  # doubling, capped at max_rebuild_backoff_s
    assert worker.restarts == {"exit": 4}
    worker.stop(drain_timeout_s=1)


def test_engines_that_die_while_starting_are_restarts_backed_off_never_given_up(monkeypatch):
    """An engine process killed while it starts (the OOM killer in warm-up, a preemption) is an engine
    restart like any other: counted by cause, backed off as a crash loop (the 503s' Retry-After says
    so), and not one of ``max_rebuild_attempts`` failed builds: more deaths than that in a row, then
    an engine that starts, and the worker serves again. ``/healthz`` stays alive throughout."""
    slept, real_sleep = [], time.sleep

    def sleep(seconds):
        if threading.current_thread().name == "hotlora-worker":
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(worker_module.time, "sleep", sleep)
    engines, deaths, checked = [], [], threading.Event()

    def factory():
        if engines and len(deaths) < 4:  # the first rebuild's four starts die before they are warm
            if len(deaths) == 2:
                checked.wait(WAIT_S)  # the third start is under way while the test looks
            deaths.append(1)
            raise EngineDied(f"the engine process {500 + len(deaths)} was killed by SIGKILL while starting",
                             cause="signal")
        engines.append(FakeProcess(400 + len(engines)))
        return engines[-1]

    worker = Worker(factory, max_rebuild_attempts=2, rebuild_backoff_s=0.5, max_rebuild_backoff_s=4.0)
    worker.start()
    engine = engines[0]
    engine.exit_code = -9
    engine.on_exit(engine, "signal")
    wait_for(lambda: len(deaths) == 2)
    refused = worker.not_ready()
    assert "restarting" in str(refused) and "while starting" in str(refused)
    assert not worker.ready and worker.crash_loop_delay_s == 2.0
    assert refused.retry_after_s >= 2  # the last start's time (here ~0) plus the crash-loop wait
    checked.set()
    wait_for(lambda: worker.ready and len(engines) == 2)
    assert worker.failed is None and worker.restarts == {"signal": 5}
    assert slept == [0.5, 1.0, 2.0, 4.0, 4.0]  # each death within a minute of its start: a crash loop
    worker.stop(drain_timeout_s=1)


def test_an_idle_engine_that_stops_answering_is_replaced_before_a_request_waits_for_it():
    """Between runs the worker pings its engine process every ``idle_ping_s``: one that does not
    answer (stopped, deadlocked below Python) is killed and rebuilt at once, counted as a stall,
    rather than found by the next request after the whole stall deadline."""
    engines, hang = [], threading.Event()

    class Pinged(FakeProcess):
        pings = 0

        def ping(self):
            self.pings += 1
            if hang.is_set() and self is engines[0]:
                raise EngineDied(f"the engine process {self.pid} did not answer a ping between runs within 30s: "
                                 "killed, an engine restart follows", cause="stall")

    def factory():
        engines.append(Pinged(600 + len(engines)))
        return engines[-1]

    worker = Worker(factory)
    worker.idle_ping_s = 0.05
    worker.start()
    wait_for(lambda: engines[0].pings >= 2)  # a live idle engine is asked, and kept
    assert worker.ready and len(engines) == 1
    hang.set()
    wait_for(lambda: worker.ready and len(engines) == 2)
    assert worker.restarts == {"stall": 1} and "did not answer a ping" in worker.last_exit
    worker.stop(drain_timeout_s=1)


def test_errors_cross_with_their_own_fields():
    rejected = error_of(error_record(AdapterRejected("identity=x", ["rank 32 > 8", "NaN in lora_A"])))
    assert isinstance(rejected, AdapterRejected) and rejected.problems == ["rank 32 > 8", "NaN in lora_A"]
    shape = error_of(error_record(UnservedShape("64x64 is not served", ("32x32",))))
    assert isinstance(shape, UnservedShape) and shape.sizes == ("32x32",) and str(shape) == "64x64 is not served"
    foreign = error_of(error_record(ZeroDivisionError("division by zero")))
    assert type(foreign).__name__ == "EngineError" and "ZeroDivisionError" in str(foreign)


def test_the_engine_processs_spans_are_replayed_into_the_requests_trace():
    recorded = RecordedTrace()
    with recorded.span("swap", images=3):
        recorded.event("bound")
    recorded.record("denoise", 10, 20, images=3)

    class Collect(Trace):
        recording = True

        def __init__(self):
            self.seen = []

        def record(self, name, start_ns, end_ns, **attributes):
            self.seen.append((name, end_ns >= start_ns, attributes))

        def event(self, name, **attributes):
            self.seen.append((name, attributes))

    into = Collect()
    replay(into, recorded.records)
    assert into.seen == [("bound", {}), ("swap", True, {"images": 3}), ("denoise", True, {"images": 3})]


def test_every_run_steps_the_heartbeat_whether_or_not_its_caller_wants_progress():
    """The server's stall deadline is per message from the engine process: a plain request (no
    progress listener, as ``POST /v1/generate`` without streaming) still sends one per denoising step,
    so a run longer than ``engine_stall_timeout_s`` is not taken for a hung engine."""
    from hotlora.engine import process
    from hotlora.lru import LRU

    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    class SteppingEngine:
        recompiles, active_adapters = 0, {}

        def describe(self):
            return {}

        def stage(self, request):
            pass

        def run(self, request):
            for step in range(1, 4):
                request.progress(step, 3)
            return "result"

    conn, plain = Conn(), job().request
    assert plain.progress is None
    process._run(conn, SteppingEngine(), LRU(max_cost=0, cost=lambda a: 0), None, 7, [(plain, False)], mixed=False)
    assert [m[:5] for m in conn.sent[:-1]] == [("progress", 7, 0, step, 3) for step in (1, 2, 3)]
    assert conn.sent[-1][0] == "done" and conn.sent[-1][2][0][:2] == ("done", "result")
