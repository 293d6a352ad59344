"""Where adapters come from: local disk, HTTPS, S3-compatible storage, the Hugging Face Hub.

Each source answers two questions: ``probe`` (a cheap identity of the current content, or None
when only a download can tell) and ``fetch`` (bring the adapter to local disk, size-capped,
with timeouts and retries). Downloads land in a work directory the store owns. Errors are
translated here: a missing object is AdapterNotFound, a refusal is UnsafeReference, an outage
after retries is SourceUnavailable. Messages use ``Reference.display``: never a query string or
a credential.

An HTTPS probe or download has one total deadline (``download_deadline_s``) shared by its
attempts: httpx's timeouts restart with every byte received, so without it a server that drips
bytes would hold a fetch worker forever.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlsplit

from hotlora.adapters.references import Reference, UnsafeReference, confine_local_path
from hotlora.config import StoreConfig
from hotlora.errors import AdapterFormatError, AdapterNotFound, SourceUnavailable

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Fetched:
    path: Path  # a weights file, or a directory holding one (PEFT layout, Hub snapshot)
    identity: str  # what the content is: etag, revision or content hash
    nbytes: int


class Source(Protocol):
    def probe(self, ref: Reference) -> str | None: ...

    def fetch(self, ref: Reference, workdir: Path) -> Fetched: ...


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
    or as soon as ``deadline`` passes (or would pass during the backoff)."""
    delay = config.backoff_s
    for attempt in range(1, config.retries + 1):
        try:
            if deadline is not None:
                deadline.check(ref)
            return action()
        except transient as exc:
            if deadline is not None and (deadline.passed or deadline.left() <= delay):
                raise deadline.error(ref) from None
            if attempt == config.retries:
                raise SourceUnavailable(
                    f"{ref.display}: unavailable after {attempt} attempts ({type(exc).__name__})"
                ) from None
            log.warning("%s: attempt %d failed (%s), retrying in %.2fs", ref.display, attempt, type(exc).__name__, delay)
            time.sleep(delay)
            delay *= 2


def _check_size(nbytes: int | None, ref: Reference, config: StoreConfig) -> None:
    if nbytes is not None and nbytes > config.max_adapter_bytes:
        raise AdapterFormatError(f"{ref.display}: {nbytes} bytes exceeds the {config.max_adapter_bytes}-byte adapter size cap")


def _check_host(host: str | None, ref: Reference, config: StoreConfig) -> None:
    if config.allowed_hosts and (host or "").lower() not in config.allowed_hosts:
        raise UnsafeReference(f"{ref.display}: host {host!r} is not in the allowed hosts")


def _file_name(path: str, default: str = "adapter.safetensors") -> str:
    name = os.path.basename(path.rstrip("/"))
    return name if name and name not in (".", "..") else default


class LocalSource:
    def __init__(self, config: StoreConfig):
        self.config = config

    def probe(self, ref: Reference) -> str:
        path = confine_local_path(ref.location, self.config.local_roots)
        if not path.exists():
            raise AdapterNotFound(f"adapter not found: {ref.display} does not exist")
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        return "file|" + hashlib.sha256(f"{path}|{stats}".encode()).hexdigest()

    def fetch(self, ref: Reference, workdir: Path) -> Fetched:
        identity = self.probe(ref)
        path = confine_local_path(ref.location, self.config.local_roots)
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else path.stat().st_size
        _check_size(size, ref, self.config)
        return Fetched(path, identity, size)  # read where it lies: nothing to copy


class HttpSource:
    """HTTPS downloads with httpx: streamed, size-capped, retried, under one deadline; redirects re-checked."""

    def __init__(self, config: StoreConfig):
        self.config = config

    def _client(self, ref: Reference, deadline: Deadline):
        import httpx

        def check(request):
            if request.url.scheme != "https" and not self.config.allow_http:
                raise UnsafeReference(f"{ref.display}: plain http is not allowed")
            _check_host(request.url.host, ref, self.config)

        # No single wait (connect, each read) may outlast the deadline; the watchdog ends the rest.
        timeout = min(self.config.timeout_s, deadline.left())
        return httpx.Client(timeout=timeout, follow_redirects=True, event_hooks={"request": [check]})

    def _status(self, response, ref: Reference) -> None:
        if response.status_code in (404, 410):
            raise AdapterNotFound(f"adapter not found: {ref.display} answered {response.status_code}")
        if response.status_code in (401, 403):
            raise AdapterNotFound(f"access denied: {ref.display} answered {response.status_code}")
        if response.status_code >= 500 or response.status_code == 429:
            raise _Transient(response.status_code)
        if response.status_code >= 400:
            raise AdapterNotFound(f"{ref.display} answered {response.status_code}")

    def probe(self, ref: Reference) -> str | None:
        import httpx

        deadline = Deadline.of(self.config)

        def head():
            with _Watchdog(deadline) as watchdog, self._client(ref, deadline) as client:
                response = client.head(ref.location, extensions={"trace": watchdog.trace})
                if response.status_code == 405:  # HEAD not allowed: the download will tell
                    return None
                self._status(response, ref)
                _check_size(_content_length(response), ref, self.config)
                return response.headers.get("etag")

        etag = _retrying(head, ref, self.config, (httpx.TransportError, _Transient), deadline)
        return f"https|{_stable_url(ref.location)}|{etag}" if etag else None

    def fetch(self, ref: Reference, workdir: Path) -> Fetched:
        import httpx

        target = workdir / _file_name(urlsplit(ref.location).path)
        deadline = Deadline.of(self.config)

        def download():
            digest = hashlib.sha256()
            received = 0
            with (_Watchdog(deadline) as watchdog, self._client(ref, deadline) as client,
                  client.stream("GET", ref.location, extensions={"trace": watchdog.trace}) as response):
                self._status(response, ref)
                _check_size(_content_length(response), ref, self.config)
                with open(target, "wb") as out:
                    # iter_bytes() without a size: each read as it arrives (a size would buffer up
                    # to it), so the deadline is checked however slowly the bytes come.
                    for chunk in response.iter_bytes():
                        deadline.check(ref)
                        received += len(chunk)
                        _check_size(received, ref, self.config)
                        digest.update(chunk)
                        out.write(chunk)
                etag = response.headers.get("etag")
            identity = f"https|{_stable_url(ref.location)}|{etag}" if etag else f"sha256|{digest.hexdigest()}"
            return Fetched(target, identity, received)

        return _retrying(download, ref, self.config, (httpx.TransportError, _Transient), deadline)


class _Transient(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")


def _content_length(response) -> int | None:
    value = response.headers.get("content-length")
    return int(value) if value and value.isdigit() else None


def _stable_url(url: str) -> str:
    """The URL without its query: presigned URLs name the same object with a new signature each time."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path}"


class S3Source:
    """S3-compatible storage through boto3 (multipart, ranged downloads; botocore retries)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._s3 = None

    def client(self):
        if self._s3 is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                raise SourceUnavailable("s3:// references need the 's3' extra: pip install 'hotlora[s3]'") from exc
            endpoint = (self.config.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                        or os.environ.get("AWS_ENDPOINT_URL"))
            if endpoint:
                _check_host(urlsplit(endpoint).hostname, Reference("s3", endpoint), self.config)
            self._s3 = boto3.client(
                "s3", endpoint_url=endpoint, region_name=self.config.s3_region or os.environ.get("AWS_REGION"),
                config=Config(retries={"max_attempts": self.config.retries, "mode": "standard"},
                              connect_timeout=self.config.timeout_s, read_timeout=self.config.timeout_s),
            )
        return self._s3

    def _translate(self, exc, ref: Reference):
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound"):
                return AdapterNotFound(f"adapter not found: {ref.display}")
            if code in ("403", "AccessDenied", "Forbidden"):
                return AdapterNotFound(f"access denied: {ref.display}")
        return SourceUnavailable(f"{ref.display}: storage error ({type(exc).__name__})")

    def probe(self, ref: Reference) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = ref.location.split("/", 1)
        try:
            head = self.client().head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, ref) from None
        _check_size(head.get("ContentLength"), ref, self.config)
        return f"s3|{bucket}/{key}|{head.get('ETag')}|{head.get('VersionId')}"

    def fetch(self, ref: Reference, workdir: Path) -> Fetched:
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        identity = self.probe(ref)
        bucket, key = ref.location.split("/", 1)
        target = workdir / _file_name(key)
        try:
            self.client().download_file(bucket, key, str(target), Config=TransferConfig(multipart_chunksize=8 * CHUNK))
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, ref) from None
        size = target.stat().st_size
        _check_size(size, ref, self.config)
        return Fetched(target, identity, size)


class HubSource:
    """``hf://owner/repo[@revision][/file]`` through huggingface_hub (its cache, HF_HOME, offline mode)."""

    PATTERNS = ["*.safetensors", "adapter_config.json", "README.md"]

    def __init__(self, config: StoreConfig, cache_dir: str | None = None):
        self.config = config
        self.cache_dir = cache_dir

    def probe(self, ref: Reference) -> None:
        return None  # huggingface_hub's own cache makes a repeated fetch cheap; the commit is the identity

    def fetch(self, ref: Reference, workdir: Path) -> Fetched:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
        )

        patterns = [ref.filename, "adapter_config.json", "README.md"] if ref.filename else self.PATTERNS
        try:
            folder = Path(snapshot_download(ref.location, revision=ref.revision, allow_patterns=patterns,
                                            cache_dir=self.cache_dir, etag_timeout=self.config.timeout_s))
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, LocalEntryNotFoundError) as exc:
            raise AdapterNotFound(f"adapter not found: {ref.display} ({type(exc).__name__})") from None
        except Exception as exc:  # network errors of every kind from the hub client
            raise SourceUnavailable(f"{ref.display}: hub error ({type(exc).__name__})") from None
        path = folder / ref.filename if ref.filename else folder
        if not path.exists():
            raise AdapterNotFound(f"adapter not found: {ref.display} has no such file")
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        _check_size(size, ref, self.config)
        # snapshots/<commit>/...: the commit hash pins the content.
        return Fetched(path, f"hf|{ref.location}|{folder.name}|{ref.filename or ''}", size)
