"""The disk tier: converted adapters, keyed by source identity, under a byte budget (LRU).

Entries are canonical safetensors files (``<key>.safetensors``) with a sidecar holding their
sha256 (``<key>.sha256``). Both are written to a temporary name and renamed into place, data
first: a crash mid-write leaves at most a ``.tmp-*`` file (swept at start-up) or data without a
sidecar (treated as corrupt), never an entry that reads as valid. Every read verifies the hash.
Recency is the data file's mtime, touched on each hit, so the LRU order survives restarts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path


from hotlora.adapters.formats import Adapter, LoraWeights

log = logging.getLogger(__name__)
FORMAT = "hotlora-canonical-v1"


def serialize(adapter: Adapter) -> bytes:
    from safetensors.torch import save

    tensors = {}
    for module, w in adapter.modules.items():
        # clone: converters share one down matrix between q, k and v; safetensors refuses shared storage.
        # contiguous: a packed adapter's weights are strided views (adapters/packing.py).
        tensors[f"{module}::down"] = w.down.detach().cpu().clone().contiguous()
        tensors[f"{module}::up"] = w.up.detach().cpu().clone().contiguous()
    info = {
        "format": FORMAT, "name": adapter.name, "family": adapter.family, "layout": adapter.layout,
        "sha256": adapter.sha256, "base_model": adapter.base_model, "skipped_keys": adapter.skipped_keys,
        "scaling": {m: w.scaling for m, w in adapter.modules.items()},
    }
    return save(tensors, metadata={"hotlora": json.dumps(info)})


def deserialize(data: bytes) -> Adapter:
    from safetensors.torch import load

    tensors = load(data)
    # The safetensors header is JSON behind an 8-byte length; our metadata sits in "__metadata__".
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    info = json.loads(header["__metadata__"]["hotlora"])
    if info.get("format") != FORMAT:
        raise ValueError(f"unknown cache entry format {info.get('format')!r}")
    modules = {
        m: LoraWeights(down=tensors[f"{m}::down"], up=tensors[f"{m}::up"], scaling=float(s))
        for m, s in info["scaling"].items()
    }
    return Adapter(name=info["name"], family=info["family"], layout=info["layout"], modules=modules,
                   sha256=info["sha256"], base_model=info["base_model"], skipped_keys=info["skipped_keys"])


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # bytes held now
    evictions: int = 0
    corrupt: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DiskCache:
    def __init__(self, root: Path, budget_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        for leftover in self.root.glob(".tmp-*"):
            log.warning("removing an unfinished cache write: %s", leftover.name)
            leftover.unlink(missing_ok=True)
        self.stats.bytes = sum(p.stat().st_size for p in self.root.glob("*.safetensors"))

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.safetensors", self.root / f"{key}.sha256"

    def get(self, key: str) -> Adapter | None:
        data_path, sum_path = self._paths(key)
        try:
            data = data_path.read_bytes()
            expected = sum_path.read_text().strip()
        except FileNotFoundError:
            if data_path.exists():  # data without its sidecar: an interrupted write
                self._discard(key, "no checksum")
            self.stats.misses += 1
            return None
        if hashlib.sha256(data).hexdigest() != expected:
            self._discard(key, "checksum mismatch")
            self.stats.misses += 1
            return None
        try:
            adapter = deserialize(data)
        except Exception as exc:  # a valid hash over an unreadable entry: wrong version or a bug
            self._discard(key, f"unreadable ({exc})")
            self.stats.misses += 1
            return None
        os.utime(data_path)  # LRU recency
        self.stats.hits += 1
        return adapter

    def put(self, key: str, adapter: Adapter) -> None:
        data = serialize(adapter)
        data_path, sum_path = self._paths(key)
        self._atomic_write(data_path, data)
        self._atomic_write(sum_path, hashlib.sha256(data).hexdigest().encode())
        with self._lock:
            self.stats.bytes = sum(p.stat().st_size for p in self.root.glob("*.safetensors"))
            self._evict(keep=data_path)

    def _atomic_write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _evict(self, keep: Path) -> None:
        entries = sorted(self.root.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        for path in entries:
            if self.stats.bytes <= self.budget:
                break
            if path == keep:
                continue
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            path.with_suffix(".sha256").unlink(missing_ok=True)
            self.stats.bytes -= size
            self.stats.evictions += 1

    def _discard(self, key: str, why: str) -> None:
        log.warning("disk cache entry %s discarded: %s", key[:12], why)
        self.stats.corrupt += 1
        for path in self._paths(key):
            path.unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.safetensors"))
