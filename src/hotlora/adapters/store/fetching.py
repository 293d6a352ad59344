"""The fetch pool: a bounded set of threads that download and convert adapters, fair between
clients and lanes.

A plain ``ThreadPoolExecutor`` is one FIFO: a client that prefetches 40 slow sources takes every
worker for a whole download deadline each, and every other client's request queues behind them
for minutes. concurrent.futures has no priorities and no per-key shares, so this small scheduler
is written by hand:

- two lanes: ``REQUEST`` (a request is waiting for the adapter) before ``PREFETCH`` (nobody is),
  and prefetches never take the last worker (``prefetch_workers``), so a request always finds one
  unless requests themselves fill the pool;
- each client (an API key, else the peer address) runs at most ``per_client`` jobs of a lane at
  once, and never every worker (``workers - 1`` in all, with more than one): its further jobs wait
  while other clients' jobs run, served round-robin. The shares are per lane so that a client's
  request does not wait behind its own prefetches (when keys are off, every caller behind one
  address is one client);
- every job carries a ``Deadline`` started when it was submitted: time queued counts, and a job
  whose deadline passed in the queue fails without taking a worker (``FetchersBusy``, 429: the
  source was never asked, the server was busy);
- a request for a job still queued as a prefetch promotes it to the request lane.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from hotlora.adapters.store.remote import Deadline

log = logging.getLogger(__name__)

REQUEST, PREFETCH = "request", "prefetch"
LANES = (REQUEST, PREFETCH)


@dataclass(eq=False)
class FetchJob:
    """One unit of work on the pool: ``run(deadline)`` on a worker thread, its outcome in ``future``."""

    run: Callable[[Deadline], object]
    client: str
    lane: str
    deadline: Deadline
    expired: Callable[[Deadline], BaseException]  # the error of a job whose deadline passed in the queue
    future: Future = field(default_factory=Future)
    started: bool = False


class FetchScheduler:
    def __init__(self, workers: int, per_client: int, prefetch_workers: int, name: str = "hotlora-fetch"):
        self.workers = max(1, workers)
        self.per_client = max(1, min(per_client, self.workers))
        self.client_total = max(self.per_client, self.workers - 1)  # across both lanes
        self.prefetch_workers = max(1, min(prefetch_workers, self.workers))
        self._name = name
        self._cond = threading.Condition()
        # lane -> client -> its queued jobs, oldest first; the clients' order is the round-robin.
        self._queued: dict[str, OrderedDict[str, deque[FetchJob]]] = {lane: OrderedDict() for lane in LANES}
        self._running: dict[tuple[str, str], int] = {}  # (client, lane) -> jobs running
        self._running_lane = {lane: 0 for lane in LANES}
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    # ------------------------------------------------------------------ public

    def submit(self, run: Callable[[Deadline], object], *, client: str, lane: str, deadline: Deadline,
               expired: Callable[[Deadline], BaseException]) -> FetchJob:
        job = FetchJob(run, client, lane, deadline, expired)
        with self._cond:
            if self._closed:
                raise RuntimeError("the fetch pool is shut down")
            self._queued[lane].setdefault(client, deque()).append(job)
            self._wake()
        return job

    def promote(self, job: FetchJob, client: str) -> None:
        """A request now waits for ``job``: if it is still queued as a prefetch, it moves to the
        request lane under ``client`` (who is waiting now), keeping its deadline."""
        with self._cond:
            if job.started or job.lane == REQUEST:
                return
            waiting = self._queued[PREFETCH].get(job.client)
            if waiting is None or job not in waiting:
                return
            waiting.remove(job)
            if not waiting:
                del self._queued[PREFETCH][job.client]
            job.lane, job.client = REQUEST, client
            self._queued[REQUEST].setdefault(client, deque()).append(job)
            self._wake()

    def counts(self) -> dict:
        """Jobs queued and running, per lane (for stats and admission)."""
        with self._cond:
            return {lane: {"queued": sum(len(q) for q in self._queued[lane].values()),
                           "running": self._running_lane[lane]} for lane in LANES}

    def shutdown(self) -> None:
        """Queued jobs are cancelled; running ones finish in the background."""
        with self._cond:
            self._closed = True
            dropped = [job for lane in LANES for jobs in self._queued[lane].values() for job in jobs]
            for lane in LANES:
                self._queued[lane].clear()
            self._cond.notify_all()
        for job in dropped:
            job.future.cancel()

    # ------------------------------------------------------------------ internals

    def _wake(self) -> None:
        """Called holding the lock: idle workers look for the new work, and a new one starts while
        the pool is not full."""
        if self._idle:
            # All of them: a notified thread counts as idle until it runs, so a single notify
            # could go to one already woken and the new work would wait for the next finish.
            self._cond.notify_all()
        # A new thread too, even with some idle: several submits can land while one notified
        # thread has not run yet, and it takes only one of them; the rest would wait for a finish.
        if len(self._threads) < self.workers:
            thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _next(self) -> FetchJob | None:
        """Called holding the lock: the next runnable job, requests first, round-robin over clients
        under their share; None when nothing may run now."""
        for lane in LANES:
            if lane == PREFETCH and self._running_lane[PREFETCH] >= self.prefetch_workers:
                continue
            clients = self._queued[lane]
            for client in list(clients):
                if (self._running.get((client, lane), 0) >= self.per_client
                        or sum(self._running.get((client, other), 0) for other in LANES) >= self.client_total):
                    continue
                jobs = clients.pop(client)  # popped and put back last: the round-robin
                job = jobs.popleft()
                if jobs:
                    clients[client] = jobs
                return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None:
                    if self._closed:
                        return
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                    job = self._next()
                job.started = True
                share = (job.client, job.lane)
                self._running[share] = self._running.get(share, 0) + 1
                self._running_lane[job.lane] += 1
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running[share] -= 1
                    if not self._running[share]:
                        del self._running[share]
                    self._running_lane[job.lane] -= 1
                    # A share freed may make a queued job runnable that no new submit would wake.
                    self._cond.notify_all()

    @staticmethod
    def _run(job: FetchJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if job.deadline.passed:  # it waited its whole deadline in the queue: no worker time for it
            job.future.set_exception(job.expired(job.deadline))
            return
        try:
            result = job.run(job.deadline)
        except BaseException as exc:  # delivered to whoever awaits the job, never lost here
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
