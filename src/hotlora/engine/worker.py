"""One worker owns the engine: a bounded queue of ready jobs, one thread running them, rebuilds.

Requests are prepared (``Engine.prepare``: checked, adapters fetched, converted, validated) *before*
they are queued, on other threads, so a cold adapter downloads while earlier requests generate,
and a bad one fails without ever reaching the engine. The worker thread only runs
(``Engine.run``). A RequestError fails its
job(s); an EngineError fails them, marks the worker not ready, rebuilds the engine and carries on
with the queue: no job is lost, none waits forever.

With a mixed-batch engine the worker merges queued jobs that share denoising parameters into one
compiled batch (two 3-image packs of different users fill one batch of 6), oldest job first,
waiting at most ``max_batch_delay_s`` for companions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from hotlora.engine.core import Engine
from hotlora.engine.process import EngineDied, exit_text
from hotlora.engine.request import PreparedRequest
from hotlora.engine.results import GenerationResult
from hotlora.errors import ClientGone, DeadlineExceeded, EngineError, HotloraError, NotAccepting, Overloaded

log = logging.getLogger(__name__)
CRASH_LOOP_S = 60.0  # an engine that dies within this of its start is a crash loop: the next start waits
# How often an idle engine process is asked whether it still answers (``ping``): a hung one is found
# within this plus the ping deadline (35 s), before a request sent to it waits for the stall deadline.
IDLE_PING_S = 5.0


class EngineRestarting(NotAccepting):
    """The engine process died (or stalled) with this request in flight or queued; a new one is
    starting. 503 with Retry-After: the request was not served and may be sent again."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    request: PreparedRequest  # checked and resolved on the request's thread; the worker only runs it
    deadline: float | None = None  # time.monotonic() by which the job must have started, and ended (``stop_when``)
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)

    @property
    def num_images(self) -> int:
        return self.request.num_images

    def batch_key(self) -> tuple:
        """Jobs with equal keys can share one forward batch."""
        return self.request.batch_key()

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stop_when(self) -> Callable[[], bool]:
        """The run's stop predicate for this job: its caller went away, or its deadline passed (a
        request that started in time still ends at its deadline, not after its last step)."""
        return lambda: self.cancelled.is_set() or self.past_deadline()

    def stopped(self, exc: ClientGone) -> ClientGone | DeadlineExceeded:
        """Why a stopped run ended for this job: its deadline (504) unless its caller went away."""
        if self.cancelled.is_set() or not self.past_deadline():
            return exc
        return DeadlineExceeded(f"the request's deadline passed while it ran: {str(exc).split(': ', 1)[-1]}")


class Worker:
    def __init__(self, engine_factory: Callable[[], Engine], *, max_queue: int = 16, max_batch_delay_s: float = 0.02,
                 on_event: Callable[[str, dict], Any] | None = None, max_rebuild_attempts: int = 5,
                 rebuild_backoff_s: float = 1.0, max_rebuild_backoff_s: float = 60.0):
        self._factory = engine_factory
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self.max_queue = max_queue
        self.max_batch_delay_s = max_batch_delay_s
        self.engine: Engine | None = None
        self.rebuilds = 0
        self.retired_recompiles = 0  # graphs compiled by requests on engines since thrown away (rebuilds)
        self.max_rebuild_attempts = max_rebuild_attempts
        self.rebuild_backoff_s = rebuild_backoff_s
        self.max_rebuild_backoff_s = max_rebuild_backoff_s
        self.failed: str | None = None  # why the worker gave up rebuilding; it answers 503 from then on
        self.batches = 0  # forward batches that carried more than one request
        self._ready = threading.Event()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.on_event = on_event or (lambda name, data: None)  # metrics hook; must not raise
        self._busy = threading.Event()
        self._fault_armed = False
        self.restarts: dict[str, int] = {}  # engine-process restarts by cause: signal, exit, stall
        self.last_exit: str | None = None  # how the last engine process ended, for /readyz and the logs
        self._lost = None  # an engine process found dead while the worker was idle: rebuilt by the loop
        self._born = time.monotonic()  # when the current engine was built (crash-loop detection)
        self._crash_delay = 0.0
        self._rebuilding_after: str | None = None  # why the engine is being replaced, while it is
        self._start_s = 0.0  # how long the last engine took to build and warm up (a restart's Retry-After)
        self.idle_ping_s = IDLE_PING_S

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._accepting

    def why_not_ready(self) -> str:
        """What a request turned away now is told (503)."""
        if self.failed:
            return f"the engine is down: {self.failed}"
        if self._rebuilding_after:
            return f"the engine is restarting ({self._rebuilding_after})"
        return "the engine is not ready (starting, rebuilding or shutting down)"

    def not_ready(self) -> NotAccepting:
        """The 503 for a request turned away now: while an engine restarts, its Retry-After is what the
        last engine took to start plus any crash-loop wait (a client retrying after 5 s would only be
        turned away again)."""
        refused = NotAccepting(self.why_not_ready())
        if self._rebuilding_after and not self.failed:
            refused.retry_after_s = self._restart_retry_after_s()
        return refused

    def _restart_retry_after_s(self) -> int:
        """A restart's Retry-After: the engine's own start time where it reports one (an engine
        process), else the last start the worker timed, plus any crash-loop wait."""
        seconds = getattr(self.engine, "started_s", None) or self._start_s or 5.0
        return max(1, int(seconds + self._crash_delay + 0.999))

    @property
    def crash_loop_delay_s(self) -> float:
        """The wait before the next engine start after engines that died within ``CRASH_LOOP_S`` of
        starting (doubling from ``rebuild_backoff_s`` to ``max_rebuild_backoff_s``); 0 when none."""
        return self._crash_delay

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        """Build and warm the engine (blocking), then start the worker thread."""
        began = time.perf_counter()
        self.engine = self._built(self._factory())
        self._start_s = time.perf_counter() - began
        log.info("engine ready in %.1fs: %s", self._start_s, self.engine.describe())
        self._accepting = True
        self._ready.set()
        self._thread = threading.Thread(target=self._run, name="hotlora-worker", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 60.0) -> bool:
        """Stop taking work and finish what is queued or running. True if everything drained."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while (self._jobs or self._busy.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._cond:
            drained = not self._jobs and not self._busy.is_set()
            while self._jobs:  # whatever could not run in time still gets an answer
                self._jobs.popleft().future.set_exception(
                    NotAccepting("the server shut down before this request could run"))
            self._stopping = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout=5)
        close = getattr(self.engine, "close", None)  # an engine process is stopped with the server
        if close is not None:
            close()
        return drained

    # ------------------------------------------------------------------ submitting

    def submit(self, job: Job) -> Future:
        if self.failed:
            raise NotAccepting(f"the engine is down: {self.failed}")
        if not self._accepting:
            raise NotAccepting("the server is not accepting work (starting or shutting down)")
        with self._cond:
            if len(self._jobs) >= self.max_queue:
                raise Overloaded(f"the queue is full ({self.max_queue} requests waiting)",
                                 retry_after_s=max(1, self.max_queue // 2))
            self._jobs.append(job)
            self._cond.notify_all()
        self._emit("queued", {"depth": self.depth})
        return job.future

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = False
                while not self._jobs and not self._stopping and self._lost is None and not idle:
                    idle = not self._cond.wait(self.idle_ping_s if hasattr(self.engine, "ping") else None)
                lost, self._lost = self._lost, None
            if lost is not None and lost is self.engine:
                self._rebuild(lost.cause)
                continue
            if idle and not self._jobs and self._idle_engine_hung():
                continue
            with self._cond:
                if not self._jobs:
                    if self._stopping:
                        return
                    continue
                first = self._jobs.popleft()
                self._busy.set()
            jobs = [first]
            try:
                jobs = [job for job in [first, *self._companions(first)] if self._still_wanted(job)]
                if jobs:
                    self._execute(jobs)
            except BaseException as exc:  # the loop must survive anything a job does
                log.exception("worker loop error")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(EngineError(f"worker error: {exc}"))
            finally:
                self._busy.clear()
                self._emit("dequeued", {"depth": self.depth})

    def _companions(self, first: Job) -> list[Job]:
        """Queued jobs that can ride in ``first``'s forward batch, oldest first, within the delay."""
        engine = self.engine
        if engine is None or not engine.writer.mixes_requests or first.num_images >= engine.batch_size:
            return []
        room = engine.batch_size - first.num_images
        key = first.batch_key()
        taken: list[Job] = []
        deadline = time.monotonic() + self.max_batch_delay_s
        with self._cond:
            while room > 0:
                for job in list(self._jobs):
                    if job.batch_key() == key and job.num_images <= room:
                        self._jobs.remove(job)
                        taken.append(job)
                        room -= job.num_images
                        if room == 0:
                            break
                remaining = deadline - time.monotonic()
                if room == 0 or remaining <= 0 or self._stopping:
                    break
                self._cond.wait(remaining)
        return taken

    def _still_wanted(self, job: Job) -> bool:
        if job.cancelled.is_set():
            job.future.set_exception(ClientGone("the client went away before the request started"))
            self._emit("dropped", {})
            return False
        if job.past_deadline():
            job.future.set_exception(DeadlineExceeded("the request's deadline passed before it could start"))
            return False
        return True

    def _execute(self, jobs: list[Job]) -> None:
        self._ready.wait()
        now = time.monotonic()
        for job in jobs:
            job.started = now
        if self._fault_armed:
            self._fault_armed = False
            self._corrupt_a_weight()
        # Each request sees its job's cancel flag and deadline: a run all of whose jobs are cancelled
        # or past their deadline stops at the next step boundary (ClientGone, a request error: no
        # rebuild; answered as DeadlineExceeded where the deadline stopped it), not after its last step.
        requests = [replace(job.request, cancelled=job.stop_when()) for job in jobs]
        try:
            if len(jobs) == 1:
                results = [self.engine.run(requests[0])]
            else:
                self.batches += 1
                results = self.engine.run(requests)
        except EngineDied as exc:
            restarting = self._restarting(str(exc))
            self._fail(jobs, restarting)
            with self._cond:
                self._answer_queued(restarting)
            self._rebuild(exc)
        except EngineError as exc:
            self._fail(jobs, exc)
            self._rebuild(exc)
        except ClientGone as exc:
            for job in jobs:
                self._fail([job], job.stopped(exc))
        except HotloraError as exc:
            self._fail(jobs, exc)
        except Exception as exc:  # anything unexpected inside the engine is an engine fault
            self._fail(jobs, EngineError(f"{type(exc).__name__}: {exc}"))
            self._rebuild(exc)
        else:
            self._count_forward_batches(results, len(jobs))
            for job, result in zip(jobs, results):
                if isinstance(result, BaseException):  # this request alone failed (its adapters overflowed)
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _count_forward_batches(self, results: list, requests: int) -> None:
        """One ``forward_batch`` event per forward pass (a pack's chunks; a mixed batch is one)."""
        served = next((r for r in results if isinstance(r, GenerationResult)), None)
        for images in served.timings.chunks if served is not None else ():
            self._emit("forward_batch", {"images": images, "requests": requests})

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)

    def _emit(self, name: str, data: dict) -> None:
        """Metrics hooks must not break the loop (LitServe's rule): a failing one is logged, not raised."""
        try:
            self.on_event(name, data)
        except Exception:
            log.exception("event listener failed on %s", name)

    # ------------------------------------------------------------------ faults

    def _give_up(self, reason: str) -> None:
        log.critical("the engine cannot be rebuilt: %s; answering 503 until restarted", reason)
        self.failed = reason
        self._accepting = False
        self._emit("rebuild_failed", {})
        with self._cond:
            self._answer_queued(NotAccepting(f"the engine is down: {reason}"))

    def inject_fault(self) -> None:
        """Test hook: the next job runs on a corrupted base weight (NaN), as after a memory fault."""
        self._fault_armed = True

    def _corrupt_a_weight(self) -> None:
        self.engine.corrupt_a_weight()

    # ------------------------------------------------------------------ engine processes

    def _built(self, engine):
        """A new engine, watched when it is a process: its death while idle is found at once."""
        self._born = time.monotonic()
        if hasattr(engine, "on_exit"):
            engine.on_exit = self._engine_exited
        return engine

    def _engine_exited(self, engine, cause: str) -> None:
        """The watcher's call when an engine process ends unasked: not ready at once; every queued
        request answered 503 (none waits for a restart of unknown length); the loop rebuilds."""
        if engine is not self.engine:
            return
        self._ready.clear()
        self._rebuilding_after = f"the engine process {engine.pid} {exit_text(engine.exit_code)}"
        engine.cause = EngineDied(f"the engine process {engine.pid} {exit_text(engine.exit_code)}; an engine "
                                  "restart follows", cause=cause)
        with self._cond:
            self._answer_queued(self._restarting(str(engine.cause)))
            self._lost = engine
            self._cond.notify_all()

    def _restarting(self, why: str) -> EngineRestarting:
        return EngineRestarting(f"{why}; the request was not served: retry once the engine is ready again",
                                retry_after_s=self._restart_retry_after_s())

    def _answer_queued(self, exc: BaseException) -> None:
        """Called with ``_cond`` held."""
        while self._jobs:
            self._jobs.popleft().future.set_exception(exc)

    def _idle_engine_hung(self) -> bool:
        """An idle engine process asked whether it still answers; one that does not (a SIGSTOP, a
        deadlock below Python) is killed and rebuilt now, before a request waits for its stall deadline."""
        try:
            self.engine.ping()
        except EngineDied as exc:
            log.error("%s", exc)
            self._rebuild(exc)
            return True
        return False

    def _count_restart(self, cause: BaseException) -> None:
        if not isinstance(cause, EngineDied):
            return
        self.restarts[cause.cause] = self.restarts.get(cause.cause, 0) + 1
        self.last_exit = str(cause)
        self._emit("engine_restart", {"cause": cause.cause})
        lived = time.monotonic() - self._born
        if lived < CRASH_LOOP_S:
            self._crash_delay = min(max(2 * self._crash_delay, self.rebuild_backoff_s), self.max_rebuild_backoff_s)
            log.error("engine crash loop: the last engine lived %.1fs; the next one starts in %.1fs",
                      lived, self._crash_delay)
            time.sleep(self._crash_delay)
        else:
            self._crash_delay = 0.0

    def _rebuild(self, cause: BaseException) -> None:
        """Throw the engine away and build a fresh one; the queue waits, readiness is false meanwhile.

        Failed builds are retried with exponential backoff; after ``max_rebuild_attempts`` in a row
        the worker gives up: queued and future requests are answered 503 with the reason (a broken
        GPU or a deleted model does not fix itself, and a queue waiting forever helps nobody), and
        ``/healthz`` says so (a liveness probe restarts the server). An engine process that dies while
        it starts (the OOM killer during warm-up, a preemption) is no failed build: it is an engine
        restart like any other, counted by cause and backed off as a crash loop, and never given up on."""
        import torch

        self._ready.clear()
        self._rebuilding_after = str(cause) if isinstance(cause, EngineDied) else "after an engine fault"
        log.error("engine fault (%s): rebuilding", cause)
        self._emit("rebuild_started", {})
        began = time.perf_counter()
        old, self.engine = self.engine, None
        self.retired_recompiles += old.recompiles if old is not None else 0
        if getattr(old, "close", None) is not None:
            old.close()  # a live engine process (a Python-level fault) holds the memory the next one needs
        self._count_restart(cause)
        delay, attempt = self.rebuild_backoff_s, 0
        while attempt < self.max_rebuild_attempts:
            if self._stopping:
                return
            torch._dynamo.reset()  # drop graphs guarded on the old modules before compiling the new ones
            # A death while starting is measured from here: a crash loop's too.
            self._born, attempt_began = time.monotonic(), time.perf_counter()
            try:
                self.engine = self._built(self._factory())
                self._start_s = time.perf_counter() - attempt_began
                break
            except EngineDied as exc:
                log.error("%s", exc)
                self._rebuilding_after = str(exc)
                self._count_restart(exc)
            except Exception as exc:
                attempt += 1
                if attempt == self.max_rebuild_attempts:
                    self._give_up(f"{self.max_rebuild_attempts} rebuilds failed in a row, the last with "
                                  f"{type(exc).__name__}: {exc}")
                    return
                log.exception("rebuild %d/%d failed; retrying in %.1fs", attempt, self.max_rebuild_attempts, delay)
                time.sleep(delay)
                delay = min(2 * delay, self.max_rebuild_backoff_s)
        self.rebuilds += 1
        self._rebuilding_after = None
        log.info("engine rebuilt in %.1fs", time.perf_counter() - began)
        self._emit("rebuilt", {"seconds": time.perf_counter() - began})
        self._ready.set()


__all__ = ["Worker", "Job", "Overloaded", "NotAccepting", "DeadlineExceeded", "ClientGone", "GenerationResult"]
