"""One least-recently-used map for every cache and table that forgets (thread-safe, bounded).

Used by the store's RAM tier (pinned catalog entries) and disk index (evicted files are removed by
the caller, outside the lock), the mixed-batch banks (recycle the oldest entry a batch does not
need), the pack side table, the resolver's memos and the remembered source identities.

Written here: the standard library's ``functools.lru_cache`` memoizes a function, not a map that
several threads put into and read from, and ``cachetools.LRUCache`` has no pinned entries, no
"oldest except these" and no record of what a put evicted (the disk tier must delete those files).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Collection, Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
_MISSING = object()


class LRU(Generic[K, V]):
    """Forgets the least recently used entries beyond ``max_entries`` entries or ``max_cost`` total
    ``cost(value)``. The newest entry is always kept, whatever its cost. Pinned entries are never
    forgotten (once pinned, always pinned); they count against both bounds, and when they alone
    exceed them, they and the newest entry are all that is kept."""

    def __init__(self, max_entries: int | None = None, max_cost: int | None = None,
                 cost: Callable[[V], int] | None = None):
        self.max_entries = max_entries
        self.max_cost = max_cost
        self._cost = cost or (lambda value: 0)
        self._entries: OrderedDict[K, V] = OrderedDict()  # evictable, least recently used first
        self._pinned: dict[K, V] = {}  # kept apart: eviction pops the LRU end, never scans
        self._costs: dict[K, int] = {}
        self._lock = threading.Lock()
        self.total_cost = 0

    def get(self, key: K, default=None):
        """The value, now the most recently used; ``default`` when absent."""
        with self._lock:
            if key in self._pinned:
                return self._pinned[key]
            value = self._entries.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V, pin: bool = False) -> list[tuple[K, V]]:
        """Insert or replace ``key`` as the most recent entry; returns what it evicted, oldest first."""
        with self._lock:
            pin = pin or key in self._pinned
            self._drop(key)
            (self._pinned if pin else self._entries)[key] = value
            self._costs[key] = cost = self._cost(value)
            self.total_cost += cost
            evicted = []
            while self._entries and self._over():
                oldest = next(iter(self._entries))
                if oldest == key:  # the entry just put is the newest: it is all that is left to evict
                    break
                evicted.append((oldest, self._drop(oldest)))
            return evicted

    def pop(self, key: K, default=None):
        with self._lock:
            value = self._drop(key)
            return default if value is _MISSING else value

    def pop_oldest(self, exclude: Collection[K] = ()) -> tuple[K, V] | None:
        """Remove and return the least recently used unpinned entry not in ``exclude`` (None if none)."""
        with self._lock:
            for key in self._entries:
                if key not in exclude:
                    return key, self._drop(key)
            return None

    def replace_all(self, items: Iterable[tuple[K, V]]) -> None:
        """Swap the whole content at once (least recently used first), pinned entries included."""
        with self._lock:
            self._entries, self._pinned, self._costs, self.total_cost = OrderedDict(), {}, {}, 0
            for key, value in items:
                self._entries[key] = value
                self._costs[key] = self._cost(value)
                self.total_cost += self._costs[key]

    def _drop(self, key: K):
        cost = self._costs.pop(key, None)
        if cost is None:
            return _MISSING
        self.total_cost -= cost
        value = self._entries.pop(key, _MISSING)
        return self._pinned.pop(key) if value is _MISSING else value

    def _over(self) -> bool:
        return ((self.max_entries is not None and len(self._costs) > self.max_entries)
                or (self.max_cost is not None and self.total_cost > self.max_cost))

    def __contains__(self, key: K) -> bool:
        return key in self._costs

    def __len__(self) -> int:
        return len(self._costs)

    def keys(self) -> list[K]:
        """Pinned first, then least recently used first."""
        with self._lock:
            return [*self._pinned, *self._entries]

    def values(self) -> list[V]:
        with self._lock:
            return [*self._pinned.values(), *self._entries.values()]
