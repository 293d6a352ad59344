"""How many of something each client holds at once (requests waiting on fetches, prefetches,
input-image decodes: ``Service``), bounded per client: one client's load cannot take everyone's places."""

from __future__ import annotations

import threading

from hotlora.errors import Overloaded


class Shares:
    """How many of something each client holds at once, bounded per client (429 beyond)."""

    def __init__(self, per_client: int, what: str):
        self.per_client = per_client
        self.what = what
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str, count: int = 1) -> list["_Hold"]:
        """``count`` places for ``client``, each released once (a context manager), or Overloaded."""
        with self._lock:
            held = self._held.get(client, 0)
            if held + count > self.per_client:
                raise Overloaded(f"this client has {held} {self.what} and asks for {count} more; at most "
                                 f"{self.per_client}", retry_after_s=5)
            self._held[client] = held + count
        return [_Hold(self, client) for _ in range(count)]

    def hold(self, client: str) -> "_Hold":
        return self.take(client)[0]

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)

    def _release(self, client: str) -> None:
        with self._lock:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]


class _Hold:
    """One place in a client's share; released once, however often it is asked to."""

    def __init__(self, shares: Shares, client: str):
        self._shares, self._client, self._released = shares, client, False

    def __enter__(self) -> "_Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._shares._release(self._client)
