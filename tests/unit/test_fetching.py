"""The fetch pool's fairness rules, with jobs that block on events (no network, no timing bounds
beyond generous waits for threads to move)."""

import threading
import time

import pytest

from hotlora.adapters.store.fetching import PREFETCH, REQUEST, FetchScheduler
from hotlora.adapters.store.remote import Deadline

WAIT_S = 60  # generous: other tests' servers may still hold the GIL in the same process


class Gate:
    """Jobs that record their start and block until released."""

    def __init__(self):
        self.started: list[str] = []
        self.release = threading.Event()
        self._lock = threading.Lock()

    def job(self, name: str):
        def run(deadline):
            with self._lock:
                self.started.append(name)
            assert self.release.wait(WAIT_S)
            return name

        return run

    def wait_started(self, count: int) -> None:
        end = time.monotonic() + WAIT_S
        while len(self.started) < count and time.monotonic() < end:
            time.sleep(0.01)
        assert len(self.started) >= count, self.started
        time.sleep(0.05)  # and no more than that start meanwhile


def submit(pool, gate, name, client, lane, seconds=60):
    return pool.submit(gate.job(name), client=client, lane=lane, deadline=Deadline(seconds),
                       expired=lambda d: TimeoutError(name))


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.release.set()


def test_prefetches_never_take_the_last_worker_and_requests_go_first(gate):
    pool = FetchScheduler(workers=4, per_client=4, prefetch_workers=3)
    prefetches = [submit(pool, gate, f"p{i}", "flood", PREFETCH) for i in range(10)]
    gate.wait_started(3)
    assert sorted(gate.started) == ["p0", "p1", "p2"]
    request = submit(pool, gate, "r", "other", REQUEST)
    gate.wait_started(4)
    assert gate.started[-1] == "r"  # on the worker prefetches may not take
    gate.release.set()
    assert request.future.result(WAIT_S) == "r"
    assert [p.future.result(WAIT_S) for p in prefetches] == [f"p{i}" for i in range(10)]
    pool.shutdown()


def test_one_client_holds_its_share_and_the_others_get_the_rest(gate):
    pool = FetchScheduler(workers=4, per_client=2, prefetch_workers=3)
    for i in range(6):
        submit(pool, gate, f"a{i}", "a", REQUEST)
    gate.wait_started(2)
    assert gate.started == ["a0", "a1"]  # two idle workers stay free for others
    submit(pool, gate, "b0", "b", REQUEST)
    submit(pool, gate, "c0", "c", REQUEST)
    gate.wait_started(4)
    assert sorted(gate.started[2:]) == ["b0", "c0"]
    pool.shutdown()


def test_a_clients_request_does_not_wait_behind_its_own_prefetches(gate):
    pool = FetchScheduler(workers=4, per_client=2, prefetch_workers=3)
    for i in range(5):
        submit(pool, gate, f"p{i}", "one", PREFETCH)
    gate.wait_started(2)
    submit(pool, gate, "r", "one", REQUEST)
    gate.wait_started(3)
    assert gate.started[-1] == "r"
    pool.shutdown()


def test_time_queued_counts_and_an_expired_job_takes_no_worker_time(gate):
    pool = FetchScheduler(workers=1, per_client=1, prefetch_workers=1)
    blocker = submit(pool, gate, "blocker", "a", REQUEST)
    gate.wait_started(1)
    late = submit(pool, gate, "late", "b", REQUEST, seconds=0.2)
    time.sleep(0.4)  # its whole deadline, spent in the queue
    gate.release.set()
    assert blocker.future.result(WAIT_S) == "blocker"
    with pytest.raises(TimeoutError, match="late"):
        late.future.result(WAIT_S)
    assert "late" not in gate.started
    pool.shutdown()


def test_a_request_promotes_a_queued_prefetch(gate):
    pool = FetchScheduler(workers=2, per_client=2, prefetch_workers=1)
    first = submit(pool, gate, "p0", "flood", PREFETCH)
    queued = submit(pool, gate, "p1", "flood", PREFETCH)
    gate.wait_started(1)
    assert gate.started == ["p0"]  # p1 waits: prefetches may use one worker of two
    pool.promote(queued, "asker")
    gate.wait_started(2)
    assert gate.started == ["p0", "p1"] and queued.lane == REQUEST
    gate.release.set()
    assert first.future.result(WAIT_S) == "p0" and queued.future.result(WAIT_S) == "p1"
    pool.shutdown()


def test_shutdown_cancels_what_is_queued(gate):
    pool = FetchScheduler(workers=1, per_client=1, prefetch_workers=1)
    running = submit(pool, gate, "running", "a", REQUEST)
    gate.wait_started(1)
    queued = submit(pool, gate, "queued", "a", REQUEST)
    pool.shutdown()
    assert queued.future.cancelled()
    gate.release.set()
    assert running.future.result(WAIT_S) == "running"
    with pytest.raises(RuntimeError):
        submit(pool, gate, "after", "a", REQUEST)


def test_an_error_reaches_whoever_awaits_the_job():
    pool = FetchScheduler(workers=1, per_client=1, prefetch_workers=1)

    def broken(deadline):
        raise ValueError("boom")

    job = pool.submit(broken, client="a", lane=REQUEST, deadline=Deadline(5), expired=lambda d: TimeoutError())
    with pytest.raises(ValueError, match="boom"):
        job.future.result(WAIT_S)
    pool.shutdown()
