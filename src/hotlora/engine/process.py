"""The engine in its own process: the warm model lives in a spawned child, the server keeps the rest.

    SpawnedAhead(model)                  ``hotlora serve``'s first child, spawned before the server's own start-up
    EngineProcess.start(model, config, stall_timeout_s=..., held_bytes=..., ahead=...) spawn (or take) the child, wait until it is warm -> the proxy
    proxy.check / proxy.prepare          in the server's process, by the front the child sent
    proxy.run(p | [p])                   the request crosses to the child, its result comes back
    proxy.close()                        stop the child (killed if it does not stop in time)

Why a process: a fault below Python (a segfault in a kernel, an abort in a CUDA library, the OOM
killer) then costs one engine restart, not the server and every client's connection; and every
torch op of the engine runs on the child's one thread, away from the server's threads (measured on
a CPU: torch work on one thread ran 20-25% slower once another live thread had run an OpenMP
region, and the server built the engine on one thread, served on another, prepared on a third).

What crosses (one ``multiprocessing`` pipe, pickled with torch's reductions, so tensors travel as
shared memory, not as bytes; the records are ``engine/wire.py``'s):
- at start, the child's ``EngineFront`` (request rules, slot ceiling, text checks) and its
  ``describe()``: the server checks and validates requests itself, and nothing it refuses crosses;
- per run, the prepared requests, with each adapter the child already holds replaced by its key
  (``Held``: the child keeps the adapters it was sent, least recently used dropped beyond a byte
  budget, and says which it dropped in every answer, so the server never sends one twice while
  the child has it);
- back: one message per denoising step (progress, and the heartbeat: a run that sends nothing for
  ``stall_timeout_s`` is a stalled engine, killed and restarted), then the results, images as one
  uint8 array per request, spans as records the server replays into the request's trace.

Written by hand: no library serves a warm diffusers pipeline from a child process (vLLM's engine
core does this for its own engine). The child dies with the server (``PR_SET_PDEATHSIG``) and ends
when the pipe closes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable

from hotlora.adapters.binding import Binding
from hotlora.errors import EngineError, HotloraError, RequestError
from hotlora.lru import LRU
from hotlora.engine.request import all_cancelled
from hotlora.engine.wire import Held, Packed, RecordedTrace, error_of, error_record, replay
from hotlora.tracing import NO_TRACE

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often a waiting run looks at its requests' cancel flags
PING_DEADLINE_S = 30.0  # an idle child answers a ping in milliseconds; one that does not within this is hung
PACKS_AHEAD = 8  # adapters packed by prepare and not yet sent (at most a few requests' worth in flight)


class EngineDied(EngineError):
    """The engine process exited, was killed or stopped answering; a new one is being started."""

    def __init__(self, message: str, cause: str = "exit"):
        super().__init__(message)
        self.cause = cause  # signal | exit | stall | fault: the restarts metric's label


# ---------------------------------------------------------------------------- the child


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    model: str
    config: Any  # EngineConfig
    log_level: int  # the root logger's
    hotlora_log_level: int  # hotlora's own loggers' (``hotlora serve`` shows them at INFO)
    held_bytes: int  # adapters the child keeps (``engine_held_adapter_bytes``)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the server's dies (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # elsewhere the pipe's end-of-file ends it, once its current run is over


@dataclasses.dataclass(frozen=True)
class AheadSpec:
    """What a child spawned ahead (``SpawnedAhead``) is told before its ``ChildSpec``."""
    log_level: int
    hotlora_log_level: int
    model: str | None  # the model it will most likely be given: its classes are imported while it waits
    compile: bool  # the server's setting: inductor's ISA probe only when it will compile


def engine_main(conn, spec: ChildSpec | AheadSpec, stop=None) -> None:
    """The child's whole life: build the engine, answer runs until the pipe closes or says stop.
    ``stop``: shared memory the server writes a run's job number into when every request of that
    run is cancelled; the run then ends at its next step boundary. ``AheadSpec``: spawned ahead, it
    imports, then waits for its ``ChildSpec``."""
    spawned = time.monotonic()  # the interpreter's own start and the spawn's unpickling come before
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it stops us
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    logging.getLogger("hotlora").setLevel(spec.hotlora_log_level)
    import faulthandler

    faulthandler.enable()  # a crash below Python leaves its stack in the log
    import torch.multiprocessing  # noqa: F401  (results' tensors cross as shared memory)
    from hotlora.engine.device import probe_cpu_isa_ahead

    if spec.compile if isinstance(spec, AheadSpec) else spec.config.compile:
        probe_cpu_isa_ahead()  # beside the imports below
    from hotlora.engine.core import Engine

    if isinstance(spec, AheadSpec):
        from hotlora.engine.pipeline import import_pipeline_classes

        import_pipeline_classes(spec.model)  # the server is still planning: the load's imports done now
        # When they are done against when its model arrives: whether its imports are on a start's path.
        log.info("imports done in %.1fs (spawned ahead); waiting for its model", time.monotonic() - spawned)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server refused to start, or stopped: nothing to build
        if message[0] != "spec":
            return
        spec = message[1]
    try:
        engine = Engine.from_pretrained(spec.model, spec.config)
    except BaseException as exc:
        log.exception("the engine could not start")
        conn.send(("failed", error_record(exc) if isinstance(exc, HotloraError) else
                   ("builtins", type(exc).__name__, str(exc), {})))
        return
    conn.send(("ready", engine.front, engine.describe(), os.getpid()))
    held = LRU(max_cost=spec.held_bytes, cost=lambda adapter: adapter.nbytes)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone: nobody to serve
        kind = message[0]
        if kind == "run":
            _run(conn, engine, held, stop, *message[1:])
        elif kind == "corrupt":
            engine.corrupt_a_weight()
        elif kind == "ping":
            conn.send(("pong",))
        elif kind == "stop":
            return


def _run(conn, engine, held, stop, job: int, requests: list, mixed: bool) -> None:
    """``requests``: (prepared request, whether it can be cancelled)."""
    dropped: list[tuple] = []
    missing = []
    staged = []
    for index, (request, cancellable) in enumerate(requests):
        bindings = {}
        for slot, binding in request.adapters.items():
            adapter = binding.adapter
            if isinstance(adapter, Held):
                adapter = held.get(adapter.key)
                if adapter is None:
                    missing.append(binding.adapter.key)
                    continue
            else:
                adapter = adapter.unpack()
                dropped += [key for key, _ in held.put(adapter.key, adapter)]
            bindings[slot] = Binding(adapter, binding.scale)
        trace = RecordedTrace() if request.trace.recording else NO_TRACE
        # Every request steps the heartbeat, whether or not its caller wants progress: the server's
        # stall deadline is per message, and a run without one is otherwise silent to its end.
        progress = _progress(conn, job, index)
        cancelled = (lambda: stop.value == job) if cancellable and stop is not None else None
        staged.append(dataclasses.replace(request, adapters=bindings, progress=progress, trace=trace,
                                          cancelled=cancelled))
    if missing:  # only after an answer went astray; the server sends them whole again
        conn.send(("missing", job, missing, dropped))
        return
    try:
        for request in staged:
            engine.stage(request)
        results = engine.run(staged) if mixed else [engine.run(staged[0])]
    except RequestError as exc:
        conn.send(("error", job, error_record(exc), dropped))
        return
    except BaseException as exc:  # an engine fault: the server replaces this process
        log.exception("engine fault")
        conn.send(("fault", job, error_record(exc), dropped))
        return
    answers = []
    for request, result in zip(staged, results):
        if isinstance(result, BaseException):
            answers.append(("error", error_record(result), ()))
        else:
            answers.append(("done", result, request.trace.records if request.trace.recording else ()))
    conn.send(("done", job, answers, dropped, _stats(engine)))


def _progress(conn, job: int, index: int) -> Callable[[int, int], None]:
    return lambda done, total: conn.send(("progress", job, index, done, total))


def _stats(engine) -> dict:
    return {"recompiles": engine.recompiles, "active_adapters": engine.active_adapters, "describe": engine.describe()}


# ---------------------------------------------------------------------------- the server's side


class EngineProcess:
    """The server's handle on an engine process; to the worker and the service it is an engine
    (``check``, ``prepare``, ``run``, ``describe``, ...). One run at a time (the worker's thread)."""

    _jobs = itertools.count(1)
    _stop = None  # shared with the child (``engine_main``); set by ``start``

    def __init__(self, process, conn, front, described: dict, pid: int, started_s: float,
                 stall_timeout_s: float, held_bytes: int):
        self.process, self._conn, self.front = process, conn, front
        self.pid, self.started_s, self.stall_timeout_s = pid, started_s, stall_timeout_s
        self.family, self.rules, self.resolver = front.family, front.rules, front.resolver
        self._described = described
        self.defaults = dict(self.rules.defaults)
        self.batch_size = described["batch_size"]
        self.recompiles, self.active_adapters = described["recompiles"], 0
        self.warmup_s = described["warmup_s"]
        self.model = described["model"]
        self._held: set[tuple] = set()  # adapter keys the child holds
        # Adapters packed by ``prepare`` for their first crossing, taken by the request that sends
        # them; bounded by count and by the child's own bound on bytes, so packs of requests that
        # never ran (cancelled, refused) are forgotten and shared memory cannot pile up.
        self._packs: LRU = LRU(max_entries=PACKS_AHEAD, max_cost=held_bytes, cost=lambda pack: pack.buffer.nbytes)
        self.on_exit: Callable[["EngineProcess", str], None] | None = None
        self._closing = False
        self.exit_code: int | None = None
        self._exited = threading.Event()  # set by the watcher, the one thread that reaps the child
        threading.Thread(target=self._watch, name="hotlora-engine-watch", daemon=True).start()

    @classmethod
    def start(cls, model: str, config, *, stall_timeout_s: float, held_bytes: int,
              ahead: "SpawnedAhead | None" = None) -> "EngineProcess":
        """Spawn the child (never fork: the server's threads and torch's state do not survive a
        fork), or take the one spawned ``ahead`` while it lives, and wait until it is warm;
        EngineError when it cannot start, with its exit status."""
        import torch.multiprocessing  # noqa: F401  (registers torch's reductions: tensors cross as shared memory)

        began = time.perf_counter()
        spec = ChildSpec(model=str(model), config=config, log_level=logging.getLogger().getEffectiveLevel(),
                         hotlora_log_level=logging.getLogger("hotlora").getEffectiveLevel(), held_bytes=held_bytes)
        taken = ahead.take() if ahead is not None else None
        if taken is not None:
            process, ours, stop = taken
            try:
                ours.send(("spec", spec))
            except OSError:
                pass  # it died since: the wait below says how
            log.info("engine process %d (spawned ahead, its imports done or under way) given its model; "
                     "waiting for it to be warm", process.pid)
        else:
            process, ours, stop = _spawn(spec)
            log.info("engine process %d started; waiting for it to be warm", process.pid)
        try:
            message = ours.recv()
        except (EOFError, OSError):
            process.join(timeout=10)
            raise EngineDied(f"the engine process {process.pid} {exit_text(process.exitcode)} while starting",
                             cause=exit_cause(process.exitcode)) from None
        if message[0] == "failed":
            process.join(timeout=30)
            raise error_of(message[1])
        _, front, described, pid = message
        seconds = time.perf_counter() - began
        log.info("engine process %d warm in %.1fs", pid, seconds)
        engine = cls(process, ours, front, described, pid, seconds, stall_timeout_s, held_bytes)
        engine._stop = stop
        return engine

    # ------------------------------------------------------------------ what the server asks

    @property
    def denoiser_config(self):
        return self.front.denoiser_config

    @property
    def image_budget(self):
        return self.front.image_budget

    @property
    def writer(self):
        return _WriterFacts(self._described["mixed"])

    def describe(self) -> dict:
        return {**self._described, "engine_pid": self.pid}

    def check(self, request, *, default_scale=None):
        return self.front.check(request, default_scale=default_scale)

    def prepare(self, request, *, fetched=None, **options):
        """``EngineFront.prepare``, then each adapter the child does not hold packed for its first
        crossing here, on the caller's thread (the server prepares on a pool thread): at full width a
        new adapter takes hundreds of ms to pack, which on the worker's thread would hold up every
        queued request."""
        prepared = self.front.prepare(request, fetched=fetched, **options)
        for binding in prepared.adapters.values():
            key = binding.adapter.key
            if key not in self._held and self._packs.get(key) is None:
                self._packs.put(key, Packed.of(binding.adapter))
        return prepared

    def corrupt_a_weight(self) -> None:
        self._send(("corrupt",))

    # ------------------------------------------------------------------ running

    def run(self, work):
        """As ``Engine.run``: one prepared request -> its GenerationResult (its error raised), or a
        list sharing one forward batch -> one result or error per request."""
        single = not isinstance(work, (list, tuple))
        requests = [work] if single else list(work)
        answers = self._exchange(requests, mixed=not single)
        outcomes = []
        for request, (kind, payload, records) in zip(requests, answers):
            if kind == "error":
                outcomes.append(error_of(payload))
                continue
            replay(request.trace, records)
            outcomes.append(_as_requested(payload, request))
        if single and isinstance(outcomes[0], BaseException):
            raise outcomes[0]
        return outcomes[0] if single else outcomes

    def _exchange(self, requests: list, mixed: bool) -> list:
        job = next(self._jobs)
        self._send(("run", job, [self._wire(r) for r in requests], mixed))
        wanted = all_cancelled(r.cancelled for r in requests)
        while True:
            message = self._receive(wanted, job)
            kind = message[0]
            if kind == "progress":  # a step: the heartbeat, passed on where the caller listens
                _, _, index, done, total = message
                if requests[index].progress is not None:
                    requests[index].progress(done, total)
                continue
            self._held.difference_update(message[-1] if kind != "done" else message[3])
            if kind == "missing":
                self._held.difference_update(message[2])
                self._send(("run", job, [self._wire(r) for r in requests], mixed))
                continue
            if kind == "error":
                raise error_of(message[2])
            if kind == "fault":
                exc = error_of(message[2])
                raise exc if isinstance(exc, EngineError) else EngineError(str(exc))
            _, _, answers, _, stats = message
            self.recompiles, self.active_adapters = stats["recompiles"], stats["active_adapters"]
            self._described = stats["describe"]
            return answers

    def _wire(self, request):
        """The request as it crosses and whether it can be cancelled: adapters the child holds by
        key, no callbacks, no spans (a trace that records is sent as an empty ``RecordedTrace``)."""
        bindings = {}
        for slot, binding in request.adapters.items():
            adapter = binding.adapter
            key = adapter.key
            if key in self._held:
                adapter = Held(key)
            else:
                adapter = self._packs.pop(key) or Packed.of(adapter)
                self._held.add(key)
            bindings[slot] = Binding(adapter, binding.scale)
        wire = dataclasses.replace(request, adapters=bindings, output_type=_wire_output(request.output_type),
                                   progress=None, cancelled=None,
                                   trace=RecordedTrace() if request.trace.recording else NO_TRACE)
        return wire, request.cancelled is not None

    def ping(self) -> None:
        """Between runs (the worker's thread, which owns the pipe): the child answers at once, or it is
        hung (stopped, deadlocked below Python) and is killed, ``EngineDied`` with cause "stall". A
        hung idle child would otherwise be found only by the next request, after the stall deadline."""
        self._send(("ping",))
        deadline = min(self.stall_timeout_s, PING_DEADLINE_S)
        if not self._conn.poll(deadline):
            self.kill()
            raise EngineDied(f"the engine process {self.pid} did not answer a ping between runs within "
                             f"{deadline:.0f}s: killed, an engine restart follows", cause="stall")
        try:
            self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            raise self._died() from None

    def _receive(self, cancelled: Callable[[], bool] | None = None, job: int = 0):
        """The child's next message. While waiting, ``cancelled()`` is looked at every
        ``CANCEL_POLL_S``: once true, the child is told (``_stop``) to end run ``job`` at its next step."""
        deadline = time.monotonic() + self.stall_timeout_s
        while not self._conn.poll(self.stall_timeout_s if cancelled is None else CANCEL_POLL_S):
            if cancelled is None or time.monotonic() >= deadline:
                self.kill()
                raise EngineDied(f"the engine process {self.pid} sent nothing for {self.stall_timeout_s:.0f}s (no "
                                 "denoising step finished): killed, an engine restart follows", cause="stall")
            self._stop_if(cancelled, job)
        # Every step sends a message, often faster than CANCEL_POLL_S: looked at on each one too, or a
        # run would be stopped only where the child falls silent (between chunks).
        self._stop_if(cancelled, job)
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _stop_if(self, cancelled: Callable[[], bool] | None, job: int) -> None:
        if cancelled is not None and self._stop is not None and cancelled():
            self._stop.value = job

    def _died(self) -> EngineDied:
        self._exited.wait(timeout=10)
        code = self.exit_code
        return EngineDied(f"the engine process {self.pid} {exit_text(code)}; an engine restart follows",
                          cause=exit_cause(code))

    # ------------------------------------------------------------------ its life

    def _watch(self) -> None:
        """Wait for the child's end; tell the worker (``on_exit``) unless we ended it."""
        from multiprocessing.connection import wait

        wait([self.process.sentinel])
        self.process.join(timeout=5)
        self.exit_code = self.process.exitcode
        self._exited.set()
        if self._closing:
            return
        log.error("the engine process %d %s", self.pid, exit_text(self.exit_code))
        if self.on_exit is not None:
            self.on_exit(self, exit_cause(self.exit_code))

    def kill(self) -> None:
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._exited.wait(timeout=10)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child: asked first, killed when it does not end within ``timeout_s``."""
        self._closing = True
        try:
            self._conn.send(("stop",))
        except (BrokenPipeError, EOFError, OSError):
            pass
        if not self._exited.wait(timeout=timeout_s):
            log.warning("the engine process %d did not stop in %.0fs: killed", self.pid, timeout_s)
            self.kill()
        self._conn.close()


@dataclasses.dataclass(frozen=True)
class _WriterFacts:
    mixes_requests: bool


def _spawn(spec: ChildSpec | AheadSpec):
    """A spawned child running ``engine_main``: (process, the server's end of its pipe, its stop value)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    stop = context.RawValue("q", 0)  # the job number of a run to stop (``engine_main``)
    process = context.Process(target=engine_main, args=(theirs, spec, stop), name="hotlora-engine",
                              daemon=True)
    process.start()
    theirs.close()
    return process, ours, stop


class SpawnedAhead:
    """An engine process spawned before it is needed. The first, as ``hotlora serve`` starts, before
    the server's own imports and memory plan: its imports (torch, dynamo, diffusers: ~4 s on 2 cores)
    run beside them instead of after, which a restart from the compile artifacts feels most
    (docs/benchmarks.md). Then a spare beside each warm engine process (``engine_spare_process``), which
    replaces it if it dies. It loads nothing until ``EngineProcess.start`` gives it its spec, so a start
    the server refuses (a plan that does not fit, a model no family serves) never loads the model;
    ``discard`` ends it then."""

    def __init__(self, model: str | None = None, compile: bool = True):
        """``model``: the local folder the server will most likely serve (its ``--model``, or the
        built-in tiny model's): the child imports its classes while the server plans. ``compile``:
        the server's setting (the ISA probe is for inductor)."""
        self._spawned = _spawn(AheadSpec(logging.getLogger().getEffectiveLevel(),
                                         logging.getLogger("hotlora").getEffectiveLevel(), model, compile))

    @property
    def pid(self) -> int | None:
        """The child's, while it lives and nobody took it."""
        spawned = self._spawned
        return spawned[0].pid if spawned is not None and spawned[0].is_alive() else None

    def take(self):
        """(process, pipe, stop value) once, while the child lives; else None (spawn a new one)."""
        spawned, self._spawned = self._spawned, None
        if spawned is not None and not spawned[0].is_alive():
            log.warning("the engine process spawned ahead %s; starting another", exit_text(spawned[0].exitcode))
            spawned[1].close()
            return None
        return spawned

    def discard(self) -> None:
        """End the child if nobody took it (the server refused to start)."""
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            process, ours, _ = spawned
            ours.close()
            process.kill()
            process.join(timeout=10)


def exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def exit_cause(code: int | None) -> str:
    return "signal" if code is not None and code < 0 else "exit"


# ---------------------------------------------------------------------------- images across

def _wire_output(output_type: str) -> str:
    """PIL images are made in the server's process: the child sends their pixels as one uint8 array."""
    return "uint8" if output_type == "pil" else output_type


def _as_requested(result, request):
    """The result as this request asked for it: PIL images made here, and each slot's adapter under
    the name this request gave it. The engine process holds adapters by content, so an adapter
    another caller sent first (a content-addressed hit) is held under that caller's name there,
    which must never reach this one."""
    for slot, served in result.adapters.items():
        binding = request.adapters.get(slot)
        if served is not None and binding is not None:
            served["name"] = binding.adapter.name
    if request.output_type != "pil":
        return result
    from hotlora.engine.results import pil_images

    return dataclasses.replace(result, images=pil_images(result.images))


__all__ = ["EngineProcess", "EngineDied", "SpawnedAhead", "engine_main"]
