"""What every API shares, below the routes: admission, checking and resolving a request, queueing it
on the worker, waiting for it (watching the client), encoding the images; and background prefetch.

The routes only translate their API's request into ``Service.generate`` and its result into their
API's response.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import Request

from hotlora.adapters.references import redact_reference
from hotlora.config import ServerConfig
from hotlora.engine.worker import Job, NotAccepting, Overloaded, Worker
from hotlora.errors import HotloraError
from hotlora.server.access import Access
from hotlora.server.auth import Principal
from hotlora.server.images import encode
from hotlora.server.metrics import Metrics

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting request checks that its client is still there


class Service:
    """What the routes share: the worker, the resolver, admission control, metrics."""

    def __init__(self, worker: Worker, config: ServerConfig):
        self.worker = worker
        self.config = config
        self.access = Access(config)
        self.metrics = Metrics(worker)
        # Requests being resolved count against the bound too: a flood of cold adapters must
        # not pile up unbounded fetches in front of the queue.
        self.max_pending = 2 * config.max_queue
        self._pending = 0
        self._lock = threading.Lock()
        self._prefetches: set[asyncio.Task] = set()

    def admit(self) -> None:
        if not self.worker.ready:
            raise NotAccepting("the engine is not ready (starting, rebuilding or shutting down)")
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"too many requests in flight ({self._pending})", retry_after_s=5)
            self._pending += 1

    def release(self) -> None:
        with self._lock:
            self._pending -= 1

    async def generate(self, request: Request, *, prompt: str, adapters: dict, fmt: str, num_images: int = 1,
                       timeout_s: float | None = None, progress=None, **params) -> dict:
        """Validate, resolve, queue, wait (watching the client), encode. Returns images and timings."""
        began = time.monotonic()
        principal = self.access.principal_of(request)
        self.check_sources(principal, [spec["ref"] for spec in adapters.values() if spec])  # before any fetch
        self.admit()
        try:
            engine = self.worker.engine
            if engine is None:
                raise NotAccepting("the engine is rebuilding")
            seed, negative = params.get("seed") or 0, params.get("negative_prompt")
            # Parameters first: bad ones never wait for a download.
            checked = engine.rules.check(prompt, num_images, params.get("num_inference_steps"),
                                         params.get("guidance_scale"), params.get("height"), params.get("width"),
                                         seed, "pil", negative)
            fetch_began = time.monotonic()
            fetched = await self.fetch(engine.resolver, adapters, principal)
            prepared = await asyncio.to_thread(engine.prepare, prompt, adapters=fetched, num_images=num_images,
                                               seed=seed, output_type="pil", negative_prompt=negative,
                                               progress=progress, params=checked)
            fetch_ms = (time.monotonic() - fetch_began) * 1000
            timeout = timeout_s or self.config.request_timeout_s
            job = Job(prepared, deadline=time.monotonic() + timeout)
            future = asyncio.wrap_future(self.worker.submit(job))
            while True:
                done, _ = await asyncio.wait({future}, timeout=POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancelled.set()
            result = future.result()
        finally:
            self.release()
        encode_began = time.monotonic()
        images = await asyncio.to_thread(lambda: [encode(img, fmt) for img in result.images])
        timings = {
            "queue_ms": round((job.started - job.enqueued) * 1000, 3),
            "fetch_ms": round(fetch_ms, 3),
            "swap_ms": round(result.timings.swap_ms, 3),
            "text_encoders_ms": round(result.swap.text_ms, 3),  # text-encoder LoRA and embeddings, apart
            "generate_ms": round(sum(result.timings.generate_ms), 3),
            "encode_ms": round((time.monotonic() - encode_began) * 1000, 3),
        }
        timings["total_ms"] = round((time.monotonic() - began) * 1000, 3)
        self.metrics.observe(timings)
        return {"images": images, "seeds": result.seeds, "adapters": result.adapters, "timings": timings,
                "recompiles": result.recompiles, "size": result.size, "snapped_from": result.snapped_from}

    def check_sources(self, principal: Principal, refs: list[str]) -> None:
        """403 for a reference outside the caller's key's sources; nothing has been fetched yet."""
        store = self.worker.store
        principal.check_references(refs, catalog_names=store.catalog if store is not None else ())

    async def fetch(self, resolver, adapters: dict, principal: Principal) -> dict:
        """Fetch every slot's adapter concurrently on the store's own fetch pool (a RAM-cached
        adapter returns at once, never behind someone's slow download); ``Engine.prepare``
        validates them. Slots and scales are checked before any download. Each adapter goes on
        under the caller's own reference: a content-addressed hit carries the first fetcher's."""
        store = resolver.store

        async def fetch(slot, source, scale, tokens):
            if isinstance(source, str) and store is not None:
                source = self.access.named(principal, await store.aget(source), source)
            return slot, {"ref": source, "scale": scale, "tokens": tokens}

        specs = resolver.sources(adapters)
        return dict(await asyncio.gather(*(fetch(slot, *spec) for slot, spec in specs.items())))

    async def prefetch(self, store, refs: list[str], principal: Principal) -> None:
        """Fetch in the background under an admission bound: 429 when too many fetches are running."""
        running = store.fetches_in_flight
        if running + len(refs) > self.config.max_prefetch_inflight:
            raise Overloaded(f"{running} adapter fetches are running; a prefetch may add up to "
                             f"{self.config.max_prefetch_inflight - running} now", retry_after_s=5)

        async def fetch(ref):
            try:
                self.access.named(principal, await store.aget(ref), ref)  # listed for this caller
            except HotloraError as exc:  # the store's messages show references redacted too
                log.warning("prefetch of %s failed: %s", redact_reference(ref), exc)

        for ref in refs:
            task = asyncio.get_running_loop().create_task(fetch(ref))
            self._prefetches.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._prefetches.discard)


def server_timing(timings: dict) -> str:
    """The ``Server-Timing`` header of a generation: one ``stage;dur=ms`` per timing."""
    return ", ".join(f"{k.removesuffix('_ms')};dur={v}" for k, v in timings.items())


SIZE_HEADER = "x-hotlora-size"  # the size served, WIDTHxHEIGHT
SNAPPED_HEADER = "x-hotlora-snapped-from"  # the size asked for, when size_policy="nearest" snapped it


def result_headers(out: dict) -> dict:
    """Every API's answer to a generation carries its timings and the size it was served at (an
    image-bytes answer has no body to say it in)."""
    headers = {"Server-Timing": server_timing(out["timings"]), SIZE_HEADER: out["size"]}
    if out.get("snapped_from"):
        headers[SNAPPED_HEADER] = out["snapped_from"]
    return headers
