"""The adapter store: references in, converted adapters out, through two cache tiers.

    request -> RAM LRU (ready-to-copy tensors) -> disk LRU (converted files) -> source (+ convert)

Keys are the source's identity of the content (etag, revision, content hash, file stat) plus the
converter's version and hotlora's, so a changed object is a new entry, an unchanged one is never
fetched twice, and a changed converter converts again instead of serving old conversions.
Concurrent requests for one key share one fetch (single-flight). The store validates files (caps,
format) but not fit to the engine: that is ``validate.problems_with`` against the engine's ceiling.

Nothing here may take the server down: both tiers are bounded (bytes and entry counts), a full
disk degrades to RAM-only, a fetch has one total deadline from the moment it is asked for (queue,
probe and download together), and async callers fetch on a bounded pool that is fair between
clients and puts requests before prefetches (``fetching.FetchScheduler``), while RAM hits answer
without waiting for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from hotlora import __version__
from hotlora.adapters.format import convert as formats
from hotlora.adapters.store.catalog import CatalogEntry, load_catalog
from hotlora.adapters.store.fetching import PREFETCH, REQUEST, FetchJob, FetchScheduler
from hotlora.adapters.store.diskcache import DiskCache, TierStats
from hotlora.durable import owner_tag, sweep_orphans
from hotlora.families import ModelFamily
from hotlora.adapters.format.convert import Adapter, LoraWeights, ReadLimits, load_adapter
from hotlora.adapters.store.egress import EgressRefused
from hotlora.adapters.store.references import Reference, parse_reference
from hotlora.adapters.store.remote import Deadline
from hotlora.adapters.store.hub import HubSource
from hotlora.adapters.store.sources import Fetched, HttpSource, LocalSource, S3Source, Source
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterNotFound, FetchersBusy, SourceUnavailable, UnsafeReference
from hotlora.lru import LRU

log = logging.getLogger(__name__)
KEY_VERSION = "v2"  # the layout of the key string itself
_REMEMBERED_IDENTITIES = 4096  # remote references whose identity is remembered (revalidate_after_s)
# What a RAM entry costs besides its tensor bytes, so a flood of tiny adapters is bounded too: the
# Adapter, its dicts and key strings, and per module a LoraWeights and two tensor objects (Python
# objects plus TensorImpl and storage headers). An order of magnitude, not a measurement.
RAM_ENTRY_OVERHEAD = 4 * 1024
RAM_MODULE_OVERHEAD = 512


HOTLORA_VERSION = __version__  # in every key: a new hotlora converts again


@dataclass
class RemoteStats:
    fetches: int = 0
    bytes: int = 0
    fetch_ms: float = 0.0
    convert_ms: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class RamCache:
    """Host-RAM LRU under a byte budget and an entry cap (the shared ``LRU``). Bytes count each
    entry's overhead besides its tensors (``cost``). Pinned entries (catalog) are never evicted;
    they count against both limits, and when they alone exceed them, they are all that is kept."""

    def __init__(self, budget_bytes: int, max_entries: int = StoreConfig.default("ram_max_entries")):
        self.budget = budget_bytes
        self.max_entries = max_entries
        self._lru: LRU[str, Adapter] = LRU(max_entries=max_entries, max_cost=budget_bytes, cost=self.cost)
        self._lock = threading.Lock()  # keeps the stats in step with the map
        self.stats = TierStats()

    @staticmethod
    def cost(adapter: Adapter) -> int:
        return adapter.nbytes + RAM_ENTRY_OVERHEAD + RAM_MODULE_OVERHEAD * len(adapter.modules)

    def get(self, key: str, count_miss: bool = True) -> Adapter | None:
        with self._lock:
            adapter = self._lru.get(key)
            if adapter is None:
                self.stats.misses += count_miss
                return None
            self.stats.hits += 1
            return adapter

    def put(self, key: str, adapter: Adapter, pin: bool = False) -> None:
        with self._lock:
            self.stats.evictions += len(self._lru.put(key, adapter, pin=pin))
            self.stats.bytes, self.stats.entries = self._lru.total_cost, len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[str]:
        return self._lru.keys()

    def values(self) -> list[Adapter]:
        return self._lru.values()


def _ready_to_copy(adapter: Adapter) -> Adapter:
    """Page-locked host tensors on CUDA machines, so slot copies are asynchronous DMA."""
    if not torch.cuda.is_available():
        return adapter
    def pinned(modules):
        return {m: LoraWeights(w.down.pin_memory(), w.up.pin_memory(), w.scaling,
                               None if w.bias is None else w.bias.pin_memory()) for m, w in modules.items()}

    return dataclasses.replace(adapter, modules=pinned(adapter.modules),
                               text_modules={te: pinned(mods) for te, mods in adapter.text_modules.items()})


class AdapterStore:
    def __init__(self, config: StoreConfig, family: ModelFamily, *, denoiser_config: Mapping | None = None,
                 catalog: Mapping[str, CatalogEntry] | str | Path | None = None, hf_cache_dir: str | None = None):
        self.config = config
        self.family = family
        self.denoiser_config = denoiser_config
        catalog = catalog if catalog is not None else config.catalog
        self.catalog: dict[str, CatalogEntry] = (
            load_catalog(catalog) if isinstance(catalog, (str, Path)) else dict(catalog or {})
        )
        self.limits = ReadLimits.of(config)
        # Local references resolve inside the configured roots and the catalog file's own folder
        # (its relative entries live there), never the working directory.
        roots = tuple(config.local_roots)
        if isinstance(catalog, (str, Path)):
            roots += (Path(catalog).resolve().parent,)
        self.sources: dict[str, Source] = {
            "file": LocalSource(config, roots), "https": HttpSource(config), "s3": S3Source(config),
            "hf": HubSource(config, hf_cache_dir or config.hf_cache_dir),
        }
        self.ram = RamCache(config.ram_budget_bytes, config.ram_max_entries)
        self.disk = DiskCache(Path(config.cache_dir) / "adapters", config.disk_budget_bytes)
        self.remote = RemoteStats()
        self.on_fetch: Callable[[float], None] | None = None  # metrics: seconds per source fetch + conversion
        # Per-fetch work directories, named <host>+<pid>+...: replicas sharing the cache directory
        # remove only what crashed processes (or anyone, long ago) left behind.
        self._work = Path(config.cache_dir) / "downloads"
        self._work.mkdir(parents=True, exist_ok=True)
        sweep_orphans(self._work)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}
        self._identities: LRU[Reference, tuple[str, float]] = LRU(max_entries=_REMEMBERED_IDENTITIES)  # see _probe
        # Async callers fetch here: a bounded pool, so slow sources cannot take every thread, with
        # a share per client and prefetches kept off the last worker, so no client starves another.
        self.fetch_workers = config.max_fetch_workers
        self.fetch_pool = FetchScheduler(
            self.fetch_workers, per_client=config.fetch_workers_per_client or max(1, self.fetch_workers // 2),
            prefetch_workers=max(1, self.fetch_workers - 1))
        self._jobs: dict[tuple[Reference, bool], FetchJob] = {}  # queued or running on fetch_pool

    # ------------------------------------------------------------------ public

    def get(self, ref: str, deadline: Deadline | None = None) -> Adapter:
        """The adapter ``ref`` names, from the cheapest tier that has it. ``deadline``: the whole
        fetch's (probe and download together); None: ``download_deadline_s`` from now."""
        deadline = deadline or Deadline.of(self.config)
        reference, pin = self._resolve_catalog(ref)
        source = self.sources[reference.kind]
        identity = self._probe(reference, source, deadline)
        if identity is not None:
            key = self._key(identity)
            return self._as_cataloged(ref, self._single_flight(
                key, lambda: self._from_tiers(key, pin) or self._fetch(reference, source, pin, deadline, checked=key)))
        # Only a download tells what the content is: one download per reference at a time. The
        # whole reference: two files (or revisions) of one repository are two downloads.
        address = f"ref|{reference.kind}|{reference.location}|{reference.revision or ''}|{reference.filename or ''}"
        return self._as_cataloged(ref, self._single_flight(address, lambda: self._fetch(reference, source, pin,
                                                                                         deadline)))

    async def aget(self, ref: str, *, client: str = "local", lane: str = REQUEST) -> Adapter:
        """``get`` for the event loop. A RAM hit whose identity needs no round trip (``cached``)
        answers at once, on the caller's thread, even while every fetch worker is busy; anything
        else runs on ``fetch_pool`` under ``client``'s share, in ``lane``, as one job per
        reference however many callers await it. A caller that stops waiting (cancelled, timed
        out) leaves the job running: its result is cached."""
        adapter = self.cached(ref)
        if adapter is not None:
            return adapter
        return await asyncio.shield(asyncio.wrap_future(self._submit(ref, client, lane).future))

    async def prefetch(self, ref: str, *, client: str = "local") -> Adapter:
        """``aget`` in the prefetch lane: behind every request, never on the last free worker."""
        return await self.aget(ref, client=client, lane=PREFETCH)

    def cached(self, ref: str) -> Adapter | None:
        """The adapter if RAM holds it and finding out takes no network round trip: local files
        (a stat), remote references whose identity is remembered (``revalidate_after_s``); else
        None. A malformed, refused or missing local reference raises as ``get`` would."""
        reference, _ = self._resolve_catalog(ref)
        if reference.kind == "file":
            identity = self.sources["file"].probe(reference)
        else:
            identity = self._remembered(reference)
        adapter = self.ram.get(self._key(identity), count_miss=False) if identity is not None else None
        return None if adapter is None else self._as_cataloged(ref, adapter)

    @property
    def fetches_in_flight(self) -> int:
        """Jobs queued or running on ``fetch_pool`` (for the server's own admission bound)."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Stop the fetch pool: queued jobs are cancelled, running ones finish in the background."""
        self.fetch_pool.shutdown()

    def check(self, ref: str) -> None:
        """What ``get`` would refuse of ``ref`` that is known without a network round trip or a read:
        a malformed reference, a catalog name with no entry, a local path outside the roots or
        missing (a stat), an https URL whose scheme or host the egress policy refuses (its name
        only: addresses are vetted when it connects). Remote objects that do not exist are found
        when fetched."""
        reference, _ = self._resolve_catalog(ref)
        if reference.kind == "file":
            self.sources["file"].probe(reference)
        elif reference.kind == "https":
            try:
                self.sources["https"].remote.policy.check_url(reference.location)
            except EgressRefused as exc:  # as a fetch answers it: the client reads the rule, the log the host
                log.warning("%s: refused by the egress policy: %s", reference.display, exc)
                raise UnsafeReference(f"{reference.display}: {exc.shown}") from None

    def _as_cataloged(self, ref: str, adapter: Adapter) -> Adapter:
        """``adapter`` as the catalog entry ``ref`` names serves it: with the inference defaults the
        entry declares over the file's. A copy: the tiers hold the file's adapter, which another
        entry (or a plain path to the same file) serves with its own."""
        reference = parse_reference(ref, catalog_names=self.catalog)
        entry = self.catalog.get(reference.location) if reference.kind == "catalog" else None
        if entry is None or not entry.declared:
            return adapter
        return dataclasses.replace(adapter, declared={**adapter.declared, **dict(entry.declared)})

    def default_scale(self, ref: str) -> float | None:
        entry = self.catalog.get(ref.removeprefix("catalog:")) if isinstance(ref, str) else None
        return entry.scale if entry else None

    def precache_catalog(self, progress: Callable[[str, int, int], None] | None = None) -> dict[str, str]:
        """Fetch and convert every catalog entry; returns name -> error for the ones that failed."""
        failures = {}
        for i, name in enumerate(self.catalog, 1):
            began = time.perf_counter()
            try:
                self.get(f"catalog:{name}")
                log.info("catalog %d/%d: %s ready in %.0f ms", i, len(self.catalog), name,
                         (time.perf_counter() - began) * 1000)
            except Exception as exc:  # one bad entry must not stop the others
                failures[name] = str(exc)
                log.error("catalog %d/%d: %s failed: %s", i, len(self.catalog), name, exc)
            if progress:
                progress(name, i, len(self.catalog))
        return failures

    def stats(self) -> dict:
        remote = {**self.remote.as_dict(), "in_flight": self.fetches_in_flight, "workers": self.fetch_workers,
                  "lanes": self.fetch_pool.counts()}
        return {"ram": self.ram.stats.as_dict(), "disk": self.disk.stats.as_dict(), "remote": remote}

    # ------------------------------------------------------------------ internals

    def _resolve_catalog(self, ref: str) -> tuple[Reference, bool]:
        reference = parse_reference(ref, catalog_names=self.catalog)
        if reference.kind != "catalog":
            return reference, False
        entry = self.catalog.get(reference.location)
        if entry is None:
            raise AdapterNotFound(f"no catalog entry named {reference.location!r}")
        inner = parse_reference(entry.ref)
        if inner.kind == "catalog":
            raise AdapterNotFound(f"catalog entry {entry.name!r} points at another catalog entry")
        return inner, entry.pin

    def _submit(self, ref: str, client: str, lane: str) -> FetchJob:
        """``get(ref)`` on the fetch pool, or the job already queued or running for it (promoted
        to the request lane when a request now waits for a queued prefetch)."""
        reference, pin = self._resolve_catalog(ref)  # a malformed reference fails here, not in a worker
        name = (reference, pin)
        with self._lock:
            job = self._jobs.get(name)
            new = job is None
            if new:
                job = self._jobs[name] = self.fetch_pool.submit(
                    lambda deadline: self.get(ref, deadline), client=client, lane=lane,
                    deadline=Deadline.of(self.config), expired=lambda deadline: FetchersBusy(
                        f"{reference.display}: waited {deadline.seconds:g} s for a fetch worker (the server is "
                        "busy fetching other adapters); retry later"))
        if new:
            # Outside the lock: a job already done runs its callback here, and the callback locks.
            job.future.add_done_callback(lambda _: self._job_done(name, job))
        elif lane == REQUEST:
            self.fetch_pool.promote(job, client)
        return job

    def _job_done(self, name: tuple[Reference, bool], job: FetchJob) -> None:
        with self._lock:
            if self._jobs.get(name) is job:
                del self._jobs[name]

    def _probe(self, reference: Reference, source: Source, deadline: Deadline) -> str | None:
        """The content identity of ``reference``: asked of its source, or, for remote references
        within ``revalidate_after_s`` of the last answer, remembered (no round trip)."""
        if reference.kind == "file":  # a local stat is cheaper than any bookkeeping
            return source.probe(reference, deadline)
        identity = self._remembered(reference)
        if identity is None:
            identity = source.probe(reference, deadline)
            if identity is not None:
                self._remember(reference, identity)
        return identity

    def _remembered(self, reference: Reference) -> str | None:
        known = self._identities.get(reference)
        return known[0] if known is not None and known[1] > time.monotonic() else None

    def _remember(self, reference: Reference, identity: str) -> None:
        """Trust ``identity`` for ``revalidate_after_s``: from a probe, or from a download when only
        a download tells (hub revisions, HTTPS without ETag)."""
        ttl = self.config.revalidate_after_s
        if ttl <= 0 or reference.kind == "file":
            return
        self._identities.put(reference, (identity, time.monotonic() + ttl))

    def _key(self, identity: str) -> str:
        # The converter's version and hotlora's: after a converter fix, entries are converted again.
        versions = f"{KEY_VERSION}|{formats.CONVERTER_VERSION}|{HOTLORA_VERSION}"
        return hashlib.sha256(f"{versions}|{self.family.name}|{identity}".encode()).hexdigest()

    def _from_tiers(self, key: str, pin: bool) -> Adapter | None:
        adapter = self.ram.get(key)
        if adapter is not None:
            return adapter
        adapter = self.disk.get(key)
        if adapter is not None:
            adapter = _ready_to_copy(adapter)
            self.ram.put(key, adapter, pin=pin)
        return adapter

    def _fetch(self, reference: Reference, source: Source, pin: bool, deadline: Deadline,
               checked: str | None = None) -> Adapter:
        """Download (or locate) and convert; ``checked``: the key the tiers were already asked for."""
        try:
            workdir = Path(tempfile.mkdtemp(prefix=f"{owner_tag()}+", dir=self._work))
        except OSError as exc:  # a full or read-only cache disk: the request gets an answer, not a crash
            raise SourceUnavailable(f"{reference.display}: no room to download ({exc.strerror or 'I/O error'})") from None
        try:
            began = fetch_began = time.perf_counter()
            try:
                fetched: Fetched = source.fetch(reference, workdir, deadline)
            except FileNotFoundError:
                if reference.kind != "file":
                    raise SourceUnavailable(f"{reference.display}: its download vanished mid-way") from None
                raise AdapterNotFound(f"adapter not found: {reference.display} does not exist") from None
            except OSError as exc:  # writing the download (disk full) or reading a local file failed
                raise SourceUnavailable(
                    f"{reference.display}: local I/O error while fetching ({exc.strerror or type(exc).__name__})"
                ) from None
            self.remote.fetch_ms += (time.perf_counter() - began) * 1000
            self.remote.fetches += 1
            self.remote.bytes += fetched.nbytes
            self._remember(reference, fetched.identity)
            key = self._key(fetched.identity)
            cached = self._from_tiers(key, pin) if key != checked else None  # once: one miss per miss
            if cached is not None:
                return self._fetched(cached, fetch_began)
            began = time.perf_counter()
            adapter = load_adapter(fetched.path, self.family, name=reference.display,
                                   denoiser_config=self.denoiser_config,
                                   limits=dataclasses.replace(self.limits, roots=fetched.roots))
            self.remote.convert_ms += (time.perf_counter() - began) * 1000
            self.disk.put(key, adapter)  # False on a full disk: counted there, served from RAM anyway
            adapter = _ready_to_copy(adapter)
            self.ram.put(key, adapter, pin=pin)
            log.info("adapter %s: %s layout, rank %d, %d modules, %d bytes (sha256 %s)", reference.display,
                     adapter.layout, adapter.rank, len(adapter.modules), adapter.nbytes, adapter.sha256[:12])
            return self._fetched(adapter, fetch_began)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _fetched(self, adapter: Adapter, began: float) -> Adapter:
        if self.on_fetch is not None:
            try:
                self.on_fetch(time.perf_counter() - began)
            except Exception:  # a metrics hook must not fail a fetch
                log.exception("on_fetch hook failed")
        return adapter

    def _single_flight(self, key: str, load: Callable[[], Adapter]) -> Adapter:
        with self._lock:
            future = self._inflight.get(key)
            leader = future is None
            if leader:
                future = self._inflight[key] = Future()
        if not leader:
            return future.result()
        try:
            adapter = load()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(adapter)
            return adapter
        finally:
            with self._lock:
                self._inflight.pop(key, None)
