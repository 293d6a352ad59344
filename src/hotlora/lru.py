"""One least-recently-used map for the memos and side tables (thread-safe, bounded).

Written here: the standard library's ``functools.lru_cache`` memoizes a function, not a map
that several threads put into and read from, and none of this project's dependencies has one.
The store's RAM tier (pinned entries) and the mixed-batch banks (evict only what a batch does not
need) have eviction rules of their own and keep them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
_MISSING = object()


class LRU(Generic[K, V]):
    """Forgets the least recently used entries beyond ``max_entries`` entries or ``max_cost`` total
    ``cost(value)``; the newest entry is always kept, whatever its cost."""

    def __init__(self, max_entries: int | None = None, max_cost: int | None = None,
                 cost: Callable[[V], int] | None = None):
        self.max_entries = max_entries
        self.max_cost = max_cost
        self._cost = cost or (lambda value: 0)
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.total_cost = 0

    def get(self, key: K, default=None):
        with self._lock:
            value = self._entries.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if key in self._entries:
                self.total_cost -= self._cost(self._entries.pop(key))
            self._entries[key] = value
            self.total_cost += self._cost(value)
            while len(self._entries) > 1 and self._over():
                _, evicted = self._entries.popitem(last=False)
                self.total_cost -= self._cost(evicted)

    def _over(self) -> bool:
        return ((self.max_entries is not None and len(self._entries) > self.max_entries)
                or (self.max_cost is not None and self.total_cost > self.max_cost))

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
