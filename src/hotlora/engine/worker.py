"""One worker owns the engine: a bounded queue of ready jobs, one thread running them, rebuilds.

Requests resolve their adapters (fetch, convert, validate) *before* they are queued, on other
threads, so a cold adapter downloads while earlier requests generate, and a bad one fails without
ever reaching the engine. The worker thread only swaps and generates. A RequestError fails one
job; an EngineError fails its job, marks the worker not ready, rebuilds the engine and carries on
with the queue: no job is lost, none waits forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from hotlora.engine.core import Engine, GenerationResult
from hotlora.errors import EngineError, HotloraError, RequestError

log = logging.getLogger(__name__)


class Overloaded(RequestError):
    """The queue is full; retry later."""

    status_code = 429

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotAccepting(RequestError):
    """Starting up, rebuilding past the wait limit, or shutting down."""

    status_code = 503
    retry_after_s = 5


class DeadlineExceeded(RequestError):
    status_code = 504


class ClientGone(RequestError):
    status_code = 499


@dataclass
class Job:
    prompt: str
    params: dict  # everything Engine.generate takes besides prompt and adapters
    adapters: dict  # slot -> (Adapter, scale), already resolved and validated
    deadline: float | None = None  # time.monotonic() by which the job must have started
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)


class Worker:
    def __init__(self, engine_factory: Callable[[], Engine], *, max_queue: int = 16,
                 on_event: Callable[[str, dict], Any] | None = None):
        self._factory = engine_factory
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self.rebuilds = 0
        self._ready = threading.Event()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self.on_event = on_event or (lambda name, data: None)  # metrics hook; must not raise
        self._busy = threading.Event()
        self._fault_armed = False
        self._last_store = None

    @property
    def store(self):
        """The adapter store the engines share (it outlives rebuilds)."""
        engine = self.engine
        return engine.store if engine is not None else self._last_store

    @property
    def resolver(self):
        """The current engine's adapter resolver (no model tensors: safe to use on request threads)."""
        engine = self.engine
        return engine.resolver if engine is not None else None

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._accepting

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        """Build and warm the engine (blocking), then start the worker thread."""
        began = time.perf_counter()
        self.engine = self._factory()
        self._last_store = self.engine.store
        log.info("engine ready in %.1fs: %s", time.perf_counter() - began, self.engine.describe())
        self._accepting = True
        self._ready.set()
        self._thread = threading.Thread(target=self._run, name="hotlora-worker", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 60.0) -> bool:
        """Stop taking work and finish what is queued or running. True if everything drained."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while (self._queue.qsize() or self._busy.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)
        drained = not self._queue.qsize() and not self._busy.is_set()
        if not drained:
            while True:  # whatever could not run in time still gets an answer
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.future.set_exception(NotAccepting("the server shut down before this request could run"))
        self._queue.put(None)
        if self._thread:
            self._thread.join(timeout=5)
        return drained

    # ------------------------------------------------------------------ submitting

    def submit(self, job: Job) -> Future:
        if not self._accepting:
            raise NotAccepting("the server is not accepting work (starting or shutting down)")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"the queue is full ({self.max_queue} requests waiting)", retry_after_s=self._retry_after()) from None
        self.on_event("queued", {"depth": self.depth})
        return job.future

    def _retry_after(self) -> int:
        return max(1, int(self.max_queue * 0.5))

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._busy.set()
            try:
                self._run_one(job)
            except BaseException as exc:  # the loop must survive anything a job does
                log.exception("worker loop error")
                if not job.future.done():
                    job.future.set_exception(EngineError(f"worker error: {exc}"))
            finally:
                self._busy.clear()
                self.on_event("dequeued", {"depth": self.depth})

    def _run_one(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.future.set_exception(ClientGone("the client went away before the request started"))
            self.on_event("dropped", {})
            return
        if job.deadline is not None and time.monotonic() > job.deadline:
            job.future.set_exception(DeadlineExceeded("the request's deadline passed before it could start"))
            return
        self._ready.wait()
        job.started = time.monotonic()
        if self._fault_armed:
            self._fault_armed = False
            self._corrupt_a_weight()
        try:
            result = self.engine.generate(job.prompt, adapters=job.adapters, **job.params)
        except EngineError as exc:
            job.future.set_exception(exc)
            self._rebuild(exc)
        except HotloraError as exc:
            job.future.set_exception(exc)
        except Exception as exc:  # anything unexpected inside the engine is an engine fault
            job.future.set_exception(EngineError(f"{type(exc).__name__}: {exc}"))
            self._rebuild(exc)
        else:
            job.future.set_result(result)

    def inject_fault(self) -> None:
        """Test hook: the next job runs on a corrupted base weight (NaN), as after a memory fault."""
        self._fault_armed = True

    def _corrupt_a_weight(self) -> None:
        import torch

        weight = next(p for n, p in self.engine.denoiser.named_parameters() if "lora_" not in n and p.ndim == 2)
        with torch.no_grad():
            weight.fill_(float("nan"))

    def _rebuild(self, cause: BaseException) -> None:
        """Throw the engine away and build a fresh one; the queue waits, readiness is false meanwhile."""
        import torch

        self._ready.clear()
        log.error("engine fault (%s): rebuilding", cause)
        self.on_event("rebuild_started", {})
        began = time.perf_counter()
        self.engine = None
        torch._dynamo.reset()  # drop graphs guarded on the old modules before compiling the new ones
        while True:
            try:
                self.engine = self._factory()
                self._last_store = self.engine.store
                break
            except Exception:
                log.exception("rebuild failed; retrying in 5s")
                time.sleep(5)
        self.rebuilds += 1
        log.info("engine rebuilt in %.1fs", time.perf_counter() - began)
        self.on_event("rebuilt", {"seconds": time.perf_counter() - began})
        self._ready.set()


__all__ = ["Worker", "Job", "Overloaded", "NotAccepting", "DeadlineExceeded", "ClientGone", "GenerationResult"]
