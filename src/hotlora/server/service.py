"""What every API shares, below the routes: admission, checking and resolving a request, queueing it
on the worker, waiting for it (watching the client), encoding the images; and background prefetch.

Fairness between clients (an API key, else the peer address): a request waiting for its adapters'
fetches holds no admission slot, only a place in its client's bounded share
(``max_fetching_per_client``); prefetches are bounded per client too; the store's fetch pool gives
each client a share of its workers and puts requests before prefetches. A request's deadline
(``timeout_s``) counts from its arrival and covers the fetch wait as well as the queue.

The routes only translate their API's request into one ``GenerationRequest`` (once) and the
service's ``Generated`` into their API's response. The service keeps to admission, fetching (it
owns the event loop, the client's share and the deadline; the adapter store is the serving
object's, and the engines never see it), queueing and encoding: checking, validating and laying out
are the engine's (``Engine.check`` before the fetch, ``Engine.prepare`` after, given every fetched
adapter), each once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, NamedTuple

from fastapi import Request

from hotlora.adapters.defaults import applied_text
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.resolver import paired
from hotlora.adapters.store.egress import EgressPolicy
from hotlora.adapters.store.references import redact_reference
from hotlora.settings import ServerConfig
from hotlora.engine.request import AdapterSpec, GenerationRequest
from hotlora.engine.worker import ClientGone, DeadlineExceeded, Job, Overloaded, Worker
from hotlora.errors import HotloraError
from hotlora.server.access import Access
from hotlora.server.auth import Principal
from hotlora.server import outputs
from hotlora.server.inputs import ImageInput, image_label, load_image
from hotlora.server.metrics import Metrics
from hotlora.server.shares import Shares
from hotlora.server.tracing import Tracing
from hotlora.tracing import Trace, wall_ns

if TYPE_CHECKING:
    from hotlora.server.run import Serving

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting request checks that its client is still there


@dataclass(frozen=True, kw_only=True)
class Generated:
    """One generation as every API answers it: the images encoded, what was served and how long
    each stage took (``timings``: milliseconds per stage, ``total_ms`` last)."""

    images: list[bytes]  # a video model's: each video's file (MP4, WebP), or every frame's PNG in order
    seeds: list[int]
    adapters: dict[str, dict | None]  # slot -> what was served (``GenerationResult.adapters``)
    timings: dict[str, float]
    recompiles: int
    size: str  # the size served, WIDTHxHEIGHT
    snapped_from: str | None = None  # the size asked for, when size_policy "nearest" snapped it
    # What decoding did to the input images that the client may want to know (a first frame
    # taken, EXIF orientation applied, CMYK converted, a declared type the content contradicted).
    input_notes: tuple[str, ...] = ()
    adapter_defaults: dict = field(default_factory=dict)  # ``GenerationResult.adapter_defaults``
    format: str = "png"  # what ``images`` are encoded as (``MEDIA_TYPES``)
    # A video model's: the frames of each video and their rate (``format`` "png": ``frames``
    # consecutive entries of ``images`` are one video).
    frames: int | None = None
    fps: int | None = None

    @property
    def media_type(self) -> str:
        return outputs.MEDIA_TYPES[self.format]

    def body(self) -> dict:
        """The JSON answer's fields (images as the caller encodes them); ``frames`` and ``fps`` for a video."""
        return {"images": self.images, "seeds": self.seeds, "adapters": self.adapters, "timings": self.timings,
                "recompiles": self.recompiles, "size": self.size, "snapped_from": self.snapped_from,
                "input_notes": list(self.input_notes), "adapter_defaults": self.adapter_defaults,
                **({"frames": self.frames, "fps": self.fps} if self.frames is not None else {})}


class Checked(NamedTuple):
    """A request ``Service.check`` passed: the engine and store it was checked against, and what
    ``Engine.check`` made of it."""

    engine: object
    store: object
    checked: object


class Service:
    """What the routes share: the worker and the adapter store (the serving object's), admission
    control, metrics."""

    def __init__(self, serving: Serving, config: ServerConfig, tracing: Tracing | None = None):
        self.serving = serving
        self.worker: Worker = serving.worker
        self.config = config
        self.access = Access(config)
        self.metrics = Metrics(self.worker, self)
        self.tracing = tracing or Tracing.from_endpoint(config.otlp_endpoint)
        # Requests past their fetch (preparing, queued, running) count against this bound; those
        # still waiting on fetches are bounded per client instead (``_fetching``), so one client's
        # slow sources cannot take the slots everyone else's cached requests need.
        self.max_pending = 2 * config.max_queue
        self._pending = 0
        self._lock = threading.Lock()
        self._fetching = Shares(config.max_fetching_per_client, "requests waiting for adapter fetches")
        self._prefetching = Shares(config.max_prefetch_per_client, "prefetches running")
        self._decoding = Shares(config.max_decoding_per_client, "requests whose input images are being fetched or "
                                                                "decoded")
        self._prefetches: set[asyncio.Task] = set()

    def admit(self) -> None:
        if not self.worker.ready:
            raise self.worker.not_ready()
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"too many requests in flight ({self._pending})", retry_after_s=5)
            self._pending += 1

    def release(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def store(self):
        """The adapter store every request is fetched through (None until the first engine)."""
        return self.serving.store

    @property
    def pending(self) -> int:
        """Requests admitted (past their fetch): preparing, queued or running."""
        return self._pending

    async def generate(self, request: Request, job: GenerationRequest, fmt: str | None,
                       kind: str | None = None) -> Generated:
        """Check, fetch, prepare, queue, wait (watching the client), encode. ``job``: the route's
        translation of its body (``output_type`` "pil": encoded here); ``fmt``: ``outputs.output_format``;
        ``kind``: the output kind the route serves (None: either).
        One trace per call when tracing is on (``server/tracing.py``)."""
        route = request.scope.get("route")
        began = time.monotonic()
        with self.tracing.request(request.headers, request.method, route.path if route else request.url.path) as trace:
            job = replace(job, trace=trace)
            principal, client = self.access.principal_of(request), self.access.client_of(request)
            with trace.span("admission"):
                checked = self.check(principal, job)
                fmt = outputs.output_format(checked.engine, fmt, kind)

            async def watch(queued: Job) -> None:  # a client that hung up: dropped before it starts
                if await request.is_disconnected():
                    queued.cancelled.set()

            return await self.run(checked, fmt, principal=principal, client=client, trace=trace, began=began,
                                  watch=watch)

    def check(self, principal: Principal, job: GenerationRequest) -> "Checked":
        """Everything refused before a fetch: the caller's sources (403), the engine's parameter and
        spec checks (``Engine.check``), the references the store can refuse without a download
        (``AdapterStore.check``); a job (``server/jobs.py``) is refused by it before its 202."""
        self.check_sources(principal, [ref for spec in job.adapters.values() for ref in spec.refs])  # before any fetch
        if not self.worker.ready:
            raise self.worker.not_ready()
        engine, store = self.worker.engine, self.store
        if engine is None or store is None:
            raise self.worker.not_ready()
        # Parameters and specs first, then what the store refuses without a download (a missing file,
        # an unknown catalog name, a refused host): a job is refused before its 202, not failed after.
        checked = engine.check(job, default_scale=store.default_scale)
        for ref in (ref for spec in checked.specs.values() for ref in spec.refs if isinstance(ref, str)):
            store.check(ref)
        return Checked(engine, store, checked)

    async def run(self, checked: "Checked", fmt: str, *, principal: Principal, client: str, trace: Trace,
                  began: float, watch, wait_for_admission: bool = False,
                  cancelled: threading.Event | None = None) -> Generated:
        """Fetch, prepare, queue, wait, encode what ``check`` passed. ``began``: its arrival
        (monotonic; the deadline counts from it); ``watch(queued)``: awaited every ``POLL_S`` on the
        worker's queue. A job (server/jobs.py) waits for admission (``wait_for_admission``) where a
        request gets a 429, and is dropped before it starts once ``cancelled`` is set (ClientGone)."""
        engine, store, checked = checked
        job = checked.request
        deadline = began + (job.timeout_s or self.config.request_timeout_s)  # the fetch wait counts too
        fetch_began = time.monotonic()
        # Waiting on fetches holds a place in the client's own share, not an admission slot: one
        # client's slow sources cannot turn everyone else's cached requests away.
        with self._fetching.hold(client), trace.span("fetch", adapters=len(checked.specs)):
            fetched, request_with_inputs = await asyncio.gather(
                self.fetch(store, checked.specs, principal, client, deadline),
                self.load_inputs(engine, checked.request, client, deadline))
        checked = replace(checked, request=request_with_inputs)
        fetch_ms = (time.monotonic() - fetch_began) * 1000
        if wait_for_admission:
            await self.admit_by(deadline, cancelled)
        else:
            self.admit()
        trace.event("admitted")
        queued = None
        try:
            prepare_began = time.monotonic()
            prepared = await asyncio.to_thread(engine.prepare, checked, fetched=fetched)
            prepare_ms = (time.monotonic() - prepare_began) * 1000  # validation and layout, apart from the fetch
            queued = Job(prepared, deadline=deadline, **({"cancelled": cancelled} if cancelled is not None else {}))
            future = asyncio.wrap_future(self.worker.submit(queued))
            while True:
                done, _ = await asyncio.wait({future}, timeout=POLL_S)
                if done:
                    break
                await watch(queued)
            result = future.result()
        finally:
            self.release()
            if queued is not None and queued.started is not None:  # queued here, started on the worker
                trace.record("queue_wait", wall_ns(queued.enqueued), wall_ns(queued.started))
        encode_began = time.monotonic()
        with trace.span("encode", images=len(result.images), format=fmt):
            encoded = await asyncio.to_thread(outputs.encode, engine.family, result.images, fmt, result.audio,
                                              result.audio_rate)
        timings = stage_timings(queued, result, fetch_ms=fetch_ms, prepare_ms=prepare_ms,
                                encode_ms=(time.monotonic() - encode_began) * 1000,
                                total_ms=(time.monotonic() - began) * 1000)
        decode = result.timings.decode_ms
        self.metrics.observe({**timings, "decode_ms": sum(decode) if decode else None}, result.adapters)
        log.info("generated %d images in %.0f ms (queue %.0f ms, generate %.0f ms)", len(encoded.files),
                 timings["total_ms"], timings["queue_ms"], timings["generate_ms"])
        return Generated(images=encoded.files, seeds=result.seeds, adapters=result.adapters, timings=timings,
                         recompiles=result.recompiles, size=result.size, snapped_from=result.snapped_from,
                         input_notes=input_notes(checked.request), format=fmt,
                         frames=encoded.frames, fps=encoded.fps, adapter_defaults=result.adapter_defaults)

    async def admit_by(self, deadline: float, cancelled: threading.Event | None = None) -> None:
        """``admit``, waiting for a slot while the queue is full (a job's way: it was accepted
        with a 202, so a full queue delays it instead of failing it) until ``deadline`` (504)."""
        while True:
            if cancelled is not None and cancelled.is_set():
                raise ClientGone("the job was cancelled before it started")
            try:
                return self.admit()
            except Overloaded:
                if time.monotonic() + POLL_S > deadline:
                    raise DeadlineExceeded("the job's deadline passed while it waited for a place in the queue") \
                        from None
            await asyncio.sleep(POLL_S)

    async def load_inputs(self, engine, job: GenerationRequest, client: str, deadline: float, *,
                          fetch: bool = True) -> GenerationRequest:
        """``job`` with its input images and mask fetched (URLs) and decoded (``server/inputs.py``)
        on a worker thread, under ``client``'s share of decoders (429 beyond) and the request's
        deadline (504; the thread keeps its place in the share until it ends). ``fetch`` False: the
        images in the body alone (uploads, base64), URLs left for the run to fetch."""
        def decodes_now(value) -> bool:  # a route's image (not the Python API's PIL), a URL only when fetching
            return isinstance(value, ImageInput) and (fetch or value.url is None)

        if not any(decodes_now(value) for value in (*job.images, job.mask)):
            return job
        budget, policy, timeout_s = engine.image_budget, self.image_policy, self.config.input_image_fetch_deadline_s
        hold = self._decoding.hold(client)

        def decoded(value, label: str, mode: str):
            if not decodes_now(value):
                return value
            return load_image(value, label=label, mode=mode, budget=budget, policy=policy, fetch_timeout_s=timeout_s)

        def load() -> GenerationRequest:
            try:
                images = tuple(decoded(image, image_label(i, len(job.images)), "RGB") for i, image in enumerate(job.images))
                mask = decoded(job.mask, "mask", "L")
                return replace(job, images=images, mask=mask)
            finally:
                hold.release()

        try:
            return await asyncio.wait_for(asyncio.to_thread(load), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline passed while its input images were fetched and decoded") \
                from None

    @cached_property
    def image_policy(self) -> EgressPolicy:
        """Where input-image URLs may point: the adapter store's policy for client-chosen URLs."""
        config = self.serving.config
        return EgressPolicy.of(config, exclusive=True) if config is not None else EgressPolicy()

    def check_sources(self, principal: Principal, refs: list[str]) -> None:
        """403 for a reference outside the caller's key's sources; nothing has been fetched yet."""
        store = self.store
        principal.check_references(refs, catalog_names=store.catalog if store is not None else ())

    async def fetch(self, store, specs: Mapping[str, AdapterSpec], principal: Principal, client: str = "local",
                    deadline: float | None = None) -> dict[str, Adapter]:
        """Fetch every slot's adapter (``specs``: checked by ``Engine.check``) concurrently on the
        store's own fetch pool, in the request lane under ``client``'s share (a RAM-cached adapter
        returns at once, never behind someone's slow download), waiting until ``deadline`` at most
        (504 then; the fetch goes on and its result is cached); ``Engine.prepare`` validates them.
        Each adapter goes on under the caller's own reference: a content-addressed hit carries the
        first fetcher's. Slot -> adapter, every slot of ``specs`` (the routes' references are text)."""

        async def one(ref):
            return self.access.named(principal, await store.aget(ref, client=client), ref)

        async def fetch(slot, spec):
            if spec.low_noise is None:
                return slot, await one(spec.ref)
            high, low = await asyncio.gather(one(spec.ref), one(spec.low_noise))  # a two-expert pair, fetched at once
            return slot, paired(high, low, slot)

        everything = asyncio.gather(*(fetch(slot, spec) for slot, spec in specs.items()
                                      if isinstance(spec.ref, str)))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return dict(await asyncio.wait_for(everything, timeout=left))
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline passed while its adapters were being fetched "
                                   "(the fetch goes on: a retry may find them cached)") from None

    async def prefetch(self, store, refs: list[str], principal: Principal, client: str = "local") -> None:
        """Fetch in the background, in the store's prefetch lane, under two admission bounds: 429
        when too many fetches are running, or too many of this client's prefetches."""
        running = store.fetches_in_flight
        if running + len(refs) > self.config.max_prefetch_inflight:
            raise Overloaded(f"{running} adapter fetches are running; a prefetch may add up to "
                             f"{self.config.max_prefetch_inflight - running} now", retry_after_s=5)
        holds = self._prefetching.take(client, len(refs))  # raises Overloaded past the client's share

        async def fetch(ref):
            try:
                self.access.named(principal, await store.prefetch(ref, client=client), ref)  # listed for this caller
            except HotloraError as exc:  # the store's messages show references redacted too
                log.warning("prefetch of %s failed: %s", redact_reference(ref), exc)
            except Exception:  # nobody awaits a prefetch: an unexpected error is logged, never lost
                log.exception("prefetch of %s failed unexpectedly", redact_reference(ref))

        for ref, hold in zip(refs, holds):
            task = asyncio.get_running_loop().create_task(fetch(ref))
            self._prefetches.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._prefetches.discard)
            task.add_done_callback(lambda _, hold=hold: hold.release())  # however it ends, cancelled too


def stage_timings(queued: Job, result, *, fetch_ms: float, prepare_ms: float, encode_ms: float,
                  total_ms: float) -> dict[str, float]:
    """Milliseconds per stage of one generation, ``total_ms`` last (the answers' ``timings``)."""
    return {
        "queue_ms": round((queued.started - queued.enqueued) * 1000, 3),
        "fetch_ms": round(fetch_ms, 3),  # the adapters' fetches and the input images' fetch and decode
        "prepare_ms": round(prepare_ms, 3),
        "swap_ms": round(result.timings.swap_ms, 3),
        "text_encoders_ms": round(result.swap.text_ms, 3),  # text-encoder LoRA and embeddings: part of swap_ms
        "generate_ms": round(sum(result.timings.generate_ms), 3),
        "encode_ms": round(encode_ms, 3),
        "total_ms": round(total_ms, 3),
    }


def server_timing(timings: dict) -> str:
    """The ``Server-Timing`` header of a generation: one ``stage;dur=ms`` per timing."""
    return ", ".join(f"{k.removesuffix('_ms')};dur={v}" for k, v in timings.items())


SIZE_HEADER = "x-hotlora-size"  # the size served, WIDTHxHEIGHT
SNAPPED_HEADER = "x-hotlora-snapped-from"  # the size asked for, when size_policy="nearest" snapped it
NOTES_HEADER = "x-hotlora-input-notes"  # Generated.input_notes, "; "-joined
DEFAULTS_HEADER = "x-hotlora-adapter-defaults"  # Generated.adapter_defaults (``adapters.defaults.applied_text``)


def input_notes(job: GenerationRequest) -> tuple[str, ...]:
    """The decoded input images' notes (``DecodedImage.notes``), images first, then the mask."""
    return tuple(note for image in (*job.images, job.mask) for note in getattr(image, "notes", ()))


def result_headers(out: Generated) -> dict:
    """Every API's answer to a generation carries its timings and the size it was served at (an
    image-bytes answer has no body to say it in)."""
    headers = {"Server-Timing": server_timing(out.timings), SIZE_HEADER: out.size}
    if out.snapped_from:
        headers[SNAPPED_HEADER] = out.snapped_from
    if out.input_notes:  # notes quote what clients declared: printable ASCII only in a header
        headers[NOTES_HEADER] = "".join(c if " " <= c <= "~" else "?" for c in "; ".join(out.input_notes))[:2000]
    if out.adapter_defaults:  # slot names are the client's own: printable ASCII only in a header
        headers[DEFAULTS_HEADER] = "".join(c if " " <= c <= "~" else "?" for c in applied_text(out.adapter_defaults))
    return headers
