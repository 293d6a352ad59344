"""Every remote byte an adapter fetch reads: one client for HTTPS, S3 and the Hub.

``Remote`` does HEAD, GET-as-JSON and streamed GET-to-file through the egress policy's pinned
connections (``egress``), under one total deadline per fetch (``download_deadline_s``, from the
moment the fetch was asked for) shared by its probe, its downloads and all their attempts, retried
with backoff on transport errors, 5xx and 429, size-capped while streaming. httpx's timeouts restart with every byte received, so without the deadline a server
that drips bytes would hold a fetch worker forever: a watchdog shuts the socket when it passes.
Clients read "not available" or "not found or not allowed"; what the remote answered (status,
exception type) goes to the operator's log, with ``Reference.display``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from hotlora.adapters.store import egress
from hotlora.adapters.store.egress import EgressPolicy, EgressRefused
from hotlora.adapters.store.references import InvalidReference, Reference, UnsafeReference
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterFormatError, AdapterNotFound, SourceUnavailable

log = logging.getLogger(__name__)


class Deadline:
    """A total time budget: for one download, shared by its attempts and each of their reads."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds if seconds and seconds > 0 else math.inf  # None or 0: no deadline
        self._ends = time.monotonic() + self.seconds

    @classmethod
    def of(cls, config: StoreConfig) -> "Deadline":
        return cls(config.download_deadline_s)

    def left(self) -> float:
        return max(0.0, self._ends - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self._ends

    def error(self, ref: Reference) -> SourceUnavailable:
        return SourceUnavailable(f"{ref.display}: did not finish within {self.seconds:g} s")

    def check(self, ref: Reference) -> None:
        if self.passed:
            raise self.error(ref)


class _Watchdog:
    """Shuts an attempt's connections when the deadline passes.

    A per-read timeout cannot end a server that drips one byte at a time, in its headers or its
    body: every byte restarts it. Shutting the socket down wakes a blocked read at once (it sees
    end-of-stream, which httpx reports as a transport error). The sockets come from httpcore's
    ``trace`` request extension, which reports each new connection's network stream.
    """

    def __init__(self, deadline: Deadline):
        self._deadline = deadline
        self._streams: list = []
        self._lock = threading.Lock()
        self._fired = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "_Watchdog":
        left = self._deadline.left()
        if math.isfinite(left):
            self._timer = threading.Timer(left, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def trace(self, event: str, info: dict) -> None:
        stream = info.get("return_value") if event.endswith(".complete") else None
        if not hasattr(stream, "get_extra_info"):  # only connect_tcp / start_tls return streams
            return
        with self._lock:
            self._streams.append(stream)
            fired = self._fired
        if fired:  # connected just as the deadline passed
            _shut(stream)

    def _fire(self) -> None:
        with self._lock:
            self._fired = True
            streams = list(self._streams)
        for stream in streams:
            _shut(stream)


def _shut(stream) -> None:
    sock = stream.get_extra_info("socket")
    try:
        # The plain socket call, under TLS too: SSLSocket.shutdown would also tear down its TLS
        # state, which the reading thread is still using.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, TypeError, ValueError):  # already closed, or not a socket
        pass


def _retrying(action: Callable, ref: Reference, config: StoreConfig, transient: tuple[type[BaseException], ...],
              deadline: Deadline | None = None):
    """Run ``action`` with exponential backoff on transient errors; SourceUnavailable at the end,
    or as soon as ``deadline`` passes (or would pass during the backoff). The client reads "not
    available"; which error it was goes to the log."""
    delay = config.backoff_s
    for attempt in range(1, config.retries + 1):
        try:
            if deadline is not None:
                deadline.check(ref)
            return action()
        except EgressRefused as exc:
            log.warning("%s: refused by the egress policy: %s", ref.display, exc)
            raise UnsafeReference(f"{ref.display}: {exc.shown}") from None
        except transient as exc:
            if deadline is not None and (deadline.passed or deadline.left() <= delay):
                log.warning("%s: deadline passed on attempt %d (%s)", ref.display, attempt, type(exc).__name__)
                raise deadline.error(ref) from None
            if attempt == config.retries:
                log.warning("%s: giving up after %d attempts (%s)", ref.display, attempt, type(exc).__name__)
                raise SourceUnavailable(f"{ref.display}: not available") from None
            log.warning("%s: attempt %d failed (%s), retrying in %.2fs", ref.display, attempt, type(exc).__name__, delay)
            time.sleep(delay)
            delay *= 2


def over_cap(ref: Reference, config: StoreConfig) -> AdapterFormatError:
    return AdapterFormatError(f"{ref.display}: exceeds the {config.max_adapter_bytes}-byte adapter size cap")


def check_size(nbytes: int | None, ref: Reference, config: StoreConfig) -> None:
    if nbytes is not None and nbytes > config.max_adapter_bytes:
        raise over_cap(ref, config)


class _Transient(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")


class Remote:
    """HEAD, GET-as-JSON and streamed GET-to-file through the egress client, under one deadline
    each, retried on transport errors, 5xx and 429. ``policy`` decides where it may connect."""

    def __init__(self, config: StoreConfig, policy: EgressPolicy):
        self.config = config
        self.policy = policy

    def _client(self, deadline: Deadline):
        # No single wait (connect, each read) may outlast the deadline; the watchdog ends the rest.
        return egress.client(self.policy, min(self.config.timeout_s, deadline.left()))

    def _status(self, response, ref: Reference) -> None:
        if response.status_code < 400:
            return
        log.warning("%s: answered HTTP %d", ref.display, response.status_code)
        if response.status_code >= 500 or response.status_code == 429:
            raise _Transient(response.status_code)
        raise AdapterNotFound(f"adapter not found or not allowed: {ref.display}")

    def _run(self, ref: Reference, action: Callable, deadline: Deadline | None = None):
        import httpx

        deadline = deadline or Deadline.of(self.config)
        try:
            return _retrying(lambda: action(deadline), ref, self.config, (httpx.TransportError, _Transient), deadline)
        except httpx.InvalidURL:  # parse_reference refuses malformed URLs; one built from its parts may still be
            log.warning("%s: httpx refused the URL as invalid", ref.display)
            raise InvalidReference(f"{ref.display}: not a valid URL") from None
        except (httpx.HTTPError, httpx.StreamError) as exc:  # not transport: too many redirects, undecodable body
            log.warning("%s: failed (%s)", ref.display, type(exc).__name__)
            raise SourceUnavailable(f"{ref.display}: not available") from None

    def head(self, ref: Reference, url: str, headers: dict | None = None, deadline: Deadline | None = None):
        """The response headers, or None when HEAD is not allowed (the download will tell)."""

        def head(deadline):
            with _Watchdog(deadline) as watchdog, self._client(deadline) as client:
                response = client.head(url, headers=headers, extensions={"trace": watchdog.trace})
                if response.status_code == 405:
                    return None
                self._status(response, ref)
                check_size(content_length(response), ref, self.config)
                return response.headers

        return self._run(ref, head, deadline)

    def json(self, ref: Reference, url: str, headers: dict | None = None, params: dict | None = None,
             deadline: Deadline | None = None, max_bytes: int = 16 * 1024 * 1024):
        """A small JSON document (Hub metadata), size-capped and under the deadline like a download."""

        def get(deadline):
            body = bytearray()
            with (_Watchdog(deadline) as watchdog, self._client(deadline) as client,
                  client.stream("GET", url, headers=headers, params=params,
                                extensions={"trace": watchdog.trace}) as response):
                self._status(response, ref)
                for chunk in response.iter_bytes():
                    deadline.check(ref)
                    body += chunk
                    if len(body) > max_bytes:
                        raise SourceUnavailable(f"{ref.display}: not available")
            try:
                return json.loads(bytes(body))
            except ValueError:
                log.warning("%s: metadata is not JSON", ref.display)
                raise SourceUnavailable(f"{ref.display}: not available") from None

        return self._run(ref, get, deadline)

    def download(self, ref: Reference, url: str, target: Path, headers: dict | None = None,
                 deadline: Deadline | None = None, budget: int | None = None):
        """Stream ``url`` into ``target``: (bytes, sha256 hex, response headers). ``budget``: bytes
        this file may take (what is left of the adapter's cap when it has several files)."""
        budget = self.config.max_adapter_bytes if budget is None else budget

        def download(deadline):
            digest = hashlib.sha256()
            received = 0
            with (_Watchdog(deadline) as watchdog, self._client(deadline) as client,
                  client.stream("GET", url, headers=headers, extensions={"trace": watchdog.trace}) as response):
                self._status(response, ref)
                declared = content_length(response)
                if declared is not None and declared > budget:
                    raise over_cap(ref, self.config)
                with open(target, "wb") as out:
                    # iter_bytes() without a size: each read as it arrives (a size would buffer up
                    # to it), so the deadline is checked however slowly the bytes come.
                    for chunk in response.iter_bytes():
                        deadline.check(ref)
                        received += len(chunk)
                        if received > budget:
                            raise over_cap(ref, self.config)
                        digest.update(chunk)
                        out.write(chunk)
                return received, digest.hexdigest(), response.headers

        return self._run(ref, download, deadline)


def content_length(response) -> int | None:
    value = response.headers.get("content-length")
    return int(value) if value and value.isdigit() else None
