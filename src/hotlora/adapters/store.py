"""The adapter store: references in, converted adapters out, through two cache tiers.

    request -> RAM LRU (ready-to-copy tensors) -> disk LRU (converted files) -> source (+ convert)

Keys are the source's identity of the content (etag, revision, content hash, file stat), so a
changed object is a new entry and an unchanged one is never fetched twice. Concurrent requests
for one key share one fetch (single-flight). The store validates files (caps, format) but not
fit to the engine: that is ``validate.problems_with`` against the engine's ceiling.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from hotlora.adapters.catalog import CatalogEntry, load_catalog
from hotlora.adapters.diskcache import DiskCache, TierStats
from hotlora.adapters.families import Family
from hotlora.adapters.formats import Adapter, LoraWeights, ReadLimits, load_adapter
from hotlora.adapters.references import Reference, parse_reference
from hotlora.adapters.sources import Fetched, HttpSource, HubSource, LocalSource, S3Source, Source
from hotlora.config import StoreConfig
from hotlora.errors import AdapterNotFound

log = logging.getLogger(__name__)
KEY_VERSION = "v1"
_REMEMBERED_IDENTITIES = 4096  # remote references whose identity is remembered (revalidate_after_s)


@dataclass
class RemoteStats:
    fetches: int = 0
    bytes: int = 0
    fetch_ms: float = 0.0
    convert_ms: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class RamCache:
    """Host-RAM LRU under a byte budget; pinned entries (catalog) are never evicted."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._entries: OrderedDict[str, Adapter] = OrderedDict()
        self._pinned: set[str] = set()
        self._lock = threading.Lock()
        self.stats = TierStats()

    def get(self, key: str) -> Adapter | None:
        with self._lock:
            adapter = self._entries.get(key)
            if adapter is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return adapter

    def put(self, key: str, adapter: Adapter, pin: bool = False) -> None:
        with self._lock:
            if key in self._entries:
                self.stats.bytes -= self._entries[key].nbytes
            self._entries[key] = adapter
            self._entries.move_to_end(key)
            self.stats.bytes += adapter.nbytes
            if pin:
                self._pinned.add(key)
            for old in list(self._entries):
                if self.stats.bytes <= self.budget:
                    break
                if old in self._pinned or old == key:
                    continue
                self.stats.bytes -= self._entries.pop(old).nbytes
                self.stats.evictions += 1

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def values(self) -> list[Adapter]:
        with self._lock:
            return list(self._entries.values())


def _ready_to_copy(adapter: Adapter) -> Adapter:
    """Page-locked host tensors on CUDA machines, so slot copies are asynchronous DMA."""
    if not torch.cuda.is_available():
        return adapter
    modules = {m: LoraWeights(w.down.pin_memory(), w.up.pin_memory(), w.scaling) for m, w in adapter.modules.items()}
    return Adapter(adapter.name, adapter.family, adapter.layout, modules, adapter.sha256, adapter.base_model,
                   adapter.skipped_keys)


class AdapterStore:
    def __init__(self, config: StoreConfig, family: Family, *, denoiser_config: Mapping | None = None,
                 catalog: Mapping[str, CatalogEntry] | str | Path | None = None, hf_cache_dir: str | None = None):
        self.config = config
        self.family = family
        self.denoiser_config = denoiser_config
        catalog = catalog if catalog is not None else config.catalog
        self.catalog: dict[str, CatalogEntry] = (
            load_catalog(catalog) if isinstance(catalog, (str, Path)) else dict(catalog or {})
        )
        self.limits = ReadLimits(config.max_adapter_bytes, config.max_header_bytes, config.allow_pickle)
        self.sources: dict[str, Source] = {
            "file": LocalSource(config), "https": HttpSource(config), "s3": S3Source(config),
            "hf": HubSource(config, hf_cache_dir or config.hf_cache_dir),
        }
        self.ram = RamCache(config.ram_budget_bytes)
        self.disk = DiskCache(Path(config.cache_dir) / "adapters", config.disk_budget_bytes)
        self.remote = RemoteStats()
        self._work = Path(config.cache_dir) / "downloads"
        self._work.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}
        self._identities: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # see _probe

    # ------------------------------------------------------------------ public

    def get(self, ref: str) -> Adapter:
        """The adapter ``ref`` names, from the cheapest tier that has it."""
        reference, pin = self._resolve_catalog(ref)
        source = self.sources[reference.kind]
        identity = self._probe(reference, source)
        if identity is not None:
            key = self._key(identity)
            return self._single_flight(key, lambda: self._from_tiers(key, pin) or self._fetch(reference, source, pin))
        # Only a download tells what the content is: one download per reference at a time.
        return self._single_flight(f"ref|{reference.kind}|{reference.location}", lambda: self._fetch(reference, source, pin))

    async def prefetch(self, ref: str) -> Adapter:
        """Fetch and convert in a worker thread, so the event loop serves while a cold adapter downloads."""
        return await asyncio.to_thread(self.get, ref)

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
        return {"ram": self.ram.stats.as_dict(), "disk": self.disk.stats.as_dict(), "remote": self.remote.as_dict()}

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

    def _probe(self, reference: Reference, source: Source) -> str | None:
        """The content identity of ``reference``: asked of its source, or, for remote references
        within ``revalidate_after_s`` of the last answer, remembered (no round trip)."""
        ttl = self.config.revalidate_after_s
        if ttl <= 0 or reference.kind == "file":  # a local stat is cheaper than any bookkeeping
            return source.probe(reference)
        address = (reference.kind, reference.location)
        now = time.monotonic()
        with self._lock:
            known = self._identities.get(address)
        if known is not None and known[1] > now:
            return known[0]
        identity = source.probe(reference)
        if identity is not None:
            with self._lock:
                self._identities[address] = (identity, now + ttl)
                self._identities.move_to_end(address)
                while len(self._identities) > _REMEMBERED_IDENTITIES:
                    self._identities.popitem(last=False)
        return identity

    def _key(self, identity: str) -> str:
        return hashlib.sha256(f"{KEY_VERSION}|{self.family.name}|{identity}".encode()).hexdigest()

    def _from_tiers(self, key: str, pin: bool) -> Adapter | None:
        adapter = self.ram.get(key)
        if adapter is not None:
            return adapter
        adapter = self.disk.get(key)
        if adapter is not None:
            adapter = _ready_to_copy(adapter)
            self.ram.put(key, adapter, pin=pin)
        return adapter

    def _fetch(self, reference: Reference, source: Source, pin: bool) -> Adapter:
        workdir = Path(tempfile.mkdtemp(dir=self._work))
        try:
            began = time.perf_counter()
            fetched: Fetched = source.fetch(reference, workdir)
            self.remote.fetch_ms += (time.perf_counter() - began) * 1000
            self.remote.fetches += 1
            self.remote.bytes += fetched.nbytes
            key = self._key(fetched.identity)
            cached = self._from_tiers(key, pin)
            if cached is not None:
                return cached
            began = time.perf_counter()
            adapter = load_adapter(fetched.path, self.family, name=reference.display,
                                   denoiser_config=self.denoiser_config, limits=self.limits)
            self.remote.convert_ms += (time.perf_counter() - began) * 1000
            self.disk.put(key, adapter)
            adapter = _ready_to_copy(adapter)
            self.ram.put(key, adapter, pin=pin)
            log.info("adapter %s: %s layout, rank %d, %d modules, %d bytes (sha256 %s)", reference.display,
                     adapter.layout, adapter.rank, len(adapter.modules), adapter.nbytes, adapter.sha256[:12])
            return adapter
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

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
