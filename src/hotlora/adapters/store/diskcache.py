"""The disk tier: converted adapters, keyed by source identity, under a byte budget (LRU).

Entries are canonical safetensors files (``<key>.safetensors``) with a sidecar holding their
sha256 (``<key>.sha256``), written and read through ``hotlora.durable``: each file goes to a
temporary name, is fsynced and renamed into place, data first, so a kill mid-write leaves at most
a ``.tmp-<host>+<pid>+*`` file (swept at start-up once its process is gone) or data without a
sidecar (discarded as corrupt), never an entry that reads as valid. Every read verifies the hash.
Recency is the data file's mtime, touched on each hit, so the LRU order survives restarts. A disk
that refuses writes (full, read-only) degrades the store to RAM-only instead of failing requests.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hotlora.adapters.format.embeddings import Embeddings
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora import durable
from hotlora.durable import discard, read_verified, remove_quietly, sweep_orphans, write_verified
from hotlora.lru import LRU

log = logging.getLogger(__name__)
FORMAT = "hotlora-canonical-v1"
_ORPHAN_SUM_AGE_S = 60.0  # a checksum without its data this old is a leftover, not a put in progress


def serialize(adapter: Adapter) -> bytes:
    from safetensors.torch import save

    tensors = {}
    parts = {"": adapter.modules, **{f"{te}::": mods for te, mods in adapter.text_modules.items()}}
    for part, modules in parts.items():
        for module, w in modules.items():
            # clone: converters share one down matrix between q, k and v; safetensors refuses shared
            # storage. contiguous: converters may hand out strided views.
            tensors[f"{part}{module}::down"] = w.down.detach().cpu().clone().contiguous()
            tensors[f"{part}{module}::up"] = w.up.detach().cpu().clone().contiguous()
            if w.bias is not None:
                tensors[f"{part}{module}::bias"] = w.bias.detach().cpu().clone().contiguous()
    info = {
        "format": FORMAT, "name": adapter.name, "family": adapter.family, "layout": adapter.layout,
        "sha256": adapter.sha256, "base_model": adapter.base_model, "skipped_keys": adapter.skipped_keys,
        "declared": adapter.declared,
        "scaling": {m: w.scaling for m, w in adapter.modules.items()},
        "text_scaling": {te: {m: w.scaling for m, w in mods.items()} for te, mods in adapter.text_modules.items()},
    }
    if adapter.embeddings is not None:
        info["embeddings"] = {"tokens": list(adapter.embeddings.tokens), "sha256": adapter.embeddings.sha256}
        for encoder, vectors in adapter.embeddings.vectors.items():
            tensors[f"embeddings::{encoder}"] = vectors.detach().cpu().clone().contiguous()
    return save(tensors, metadata={"hotlora": json.dumps(info)})


def deserialize(data: bytes) -> Adapter:
    from safetensors.torch import load

    tensors = load(data)
    # The safetensors header is JSON behind an 8-byte length; our metadata sits in "__metadata__".
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    info = json.loads(header["__metadata__"]["hotlora"])
    if info.get("format") != FORMAT:
        raise ValueError(f"unknown cache entry format {info.get('format')!r}")
    def weights(part: str, scaling: dict) -> dict[str, LoraWeights]:
        return {m: LoraWeights(down=tensors[f"{part}{m}::down"], up=tensors[f"{part}{m}::up"], scaling=float(s),
                               bias=tensors.get(f"{part}{m}::bias")) for m, s in scaling.items()}

    embeddings = None
    if info.get("embeddings"):
        vectors = {k.removeprefix("embeddings::"): v for k, v in tensors.items() if k.startswith("embeddings::")}
        embeddings = Embeddings(tuple(info["embeddings"]["tokens"]), vectors, info["embeddings"]["sha256"])
    return Adapter(name=info["name"], family=info["family"], layout=info["layout"],
                   modules=weights("", info["scaling"]), sha256=info["sha256"], base_model=info["base_model"],
                   skipped_keys=info["skipped_keys"], declared=dict(info.get("declared") or {}),
                   text_modules={te: weights(f"{te}::", scaling) for te, scaling in info.get("text_scaling", {}).items()},
                   embeddings=embeddings)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # bytes held now
    evictions: int = 0
    corrupt: int = 0
    entries: int = 0  # entries held now
    write_errors: int = 0  # writes that failed (disk full, read-only): the entry stayed RAM-only

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------- the tier


class DiskCache:
    """An LRU of converted entries under a byte budget.

    The directory is scanned at start-up into an in-memory index (key -> size, in LRU order, from
    mtimes); after that a put or a hit is O(1): it updates the index and a running byte total, and
    eviction pops from the index. Other processes sharing the directory (replicas) write entries
    this index does not see, so a put rescans once ``rescan_every_s`` has passed: the budget holds
    for the directory as a whole, at a scan's cost every few minutes instead of on every write.
    Every file operation tolerates an entry that someone else removed meanwhile.
    """

    TMP = durable.TMP
    RESCAN_EVERY_S = 300.0

    def __init__(self, root: Path, budget_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.stats = TierStats()
        # key -> data bytes, least recently used first; a put or a hit may evict (files removed here).
        self._index: LRU[str, int] = LRU(max_cost=budget_bytes, cost=int)
        self._lock = threading.Lock()  # the disk-full flag and the stats
        self._disk_full = False  # warn once per spell of failing writes, not per write
        self.rescan_every_s = self.RESCAN_EVERY_S
        self._rescan()

    def _rescan(self) -> None:
        """Rebuild the index from the directory. The scan runs outside the lock (gets and puts go
        on meanwhile); the swap is atomic. On-disk mtimes order it, other replicas' hits included.
        Temporary files of crashed writers (predecessors, replicas) are removed first, and
        checksums whose data is gone (a kill between an eviction's two unlinks)."""
        self._scanned_at = time.monotonic()
        sweep_orphans(self.root, self.TMP)
        found, sums = [], []
        for entry in os.scandir(self.root):
            if entry.name.startswith(self.TMP):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:  # evicted meanwhile
                continue
            if entry.name.endswith(".safetensors"):
                found.append((st.st_mtime_ns, entry.name.removesuffix(".safetensors"), st.st_size))
            elif entry.name.endswith(".sha256"):
                sums.append((entry.name.removesuffix(".sha256"), st.st_mtime))
        self._index.replace_all((key, size) for _, key, size in sorted(found))
        self._count()
        keys = {key for _, key, _ in found}
        for key, written_at in sums:
            # Old only: a put writes its data first, but a scan may pass the data's name before
            # the rename and the checksum's after it.
            if key not in keys and time.time() - written_at > _ORPHAN_SUM_AGE_S:
                remove_quietly(self._paths(key)[1])

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.safetensors", self.root / f"{key}.sha256"

    def get(self, key: str) -> Adapter | None:
        data_path, sum_path = self._paths(key)
        try:
            data = read_verified(data_path, "disk cache entry", sum_path, on_corrupt=lambda why: self._corrupt(key))
        except OSError as exc:  # an unreadable disk is a miss: the source still has the adapter
            log.warning("disk cache entry %s unreadable: %s", key[:12], exc)
            self.stats.misses += 1
            return None
        if data is None:  # never written, evicted (maybe by another process) meanwhile, or corrupt
            self._forget(key)
            self.stats.misses += 1
            return None
        try:
            adapter = deserialize(data)
        except Exception as exc:  # a valid hash over an unreadable entry: wrong version or a bug
            self._discard(key, f"unreadable ({exc})")
            self.stats.misses += 1
            return None
        self._touch(key, data_path, len(data))
        self.stats.hits += 1
        return adapter

    def _touch(self, key: str, data_path: Path, size: int) -> None:
        """LRU recency, on disk (survives restarts) and in the index. The bytes were read and
        verified, so an entry evicted by someone else in the meantime is still a valid answer."""
        try:
            os.utime(data_path)
        except FileNotFoundError:
            self._forget(key)
            return
        except OSError:  # a read-only disk: recency is best effort
            pass
        self._remember(key, size)

    def put(self, key: str, adapter: Adapter) -> bool:
        """Write an entry; False when the disk refused it (full, read-only): the caller keeps
        serving from RAM, and the failure is counted in ``stats.write_errors``."""
        data = serialize(adapter)
        data_path, sum_path = self._paths(key)
        try:
            write_verified(data_path, data, sum_path)
        except OSError as exc:
            self._forget(key)
            self._write_failed(key, exc)
            return False
        if self._disk_full:
            log.warning("disk cache writable again: %s", self.root)
            self._disk_full = False
        if time.monotonic() - self._scanned_at > self.rescan_every_s:
            try:
                self._rescan()  # see what other replicas wrote, so the budget holds for all of them
            except OSError as exc:  # keep the index we have
                log.warning("disk cache rescan failed: %s", exc)
        self._remember(key, len(data))
        return True

    def _write_failed(self, key: str, exc: OSError) -> None:
        with self._lock:
            self.stats.write_errors += 1
            first = not self._disk_full
            self._disk_full = True
        if first:
            log.warning("disk cache write failed (%s): serving from RAM only until writes succeed again; "
                        "further failures are logged at debug level", exc)
        else:
            log.debug("disk cache write of %s failed: %s", key[:12], exc)

    # Index bookkeeping.

    def _remember(self, key: str, size: int) -> None:
        """``key`` is the most recent entry; what that pushes over the budget is removed from disk."""
        evicted = self._index.put(key, size)
        for old, _ in evicted:
            for path in self._paths(old):
                remove_quietly(path)  # another process may have removed it already
        with self._lock:
            self.stats.evictions += len(evicted)
        self._count()

    def _forget(self, key: str) -> None:
        self._index.pop(key)
        self._count()

    def _count(self) -> None:
        with self._lock:
            self.stats.bytes, self.stats.entries = self._index.total_cost, len(self._index)

    def _corrupt(self, key: str) -> None:
        with self._lock:
            self.stats.corrupt += 1
        self._forget(key)

    def _discard(self, key: str, why: str) -> None:
        data_path, sum_path = self._paths(key)
        discard(data_path, "disk cache entry", why, sum_path)
        self._corrupt(key)

    def keys(self) -> list[str]:
        """The entries this process knows of (its index), least recently used first."""
        return self._index.keys()
