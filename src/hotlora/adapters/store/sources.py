"""Where adapters come from: local disk, HTTPS, S3-compatible storage (the Hugging Face Hub: ``hub``).

Each source answers two questions: ``probe`` (a cheap identity of the current content, or None
when only a download can tell) and ``fetch`` (bring the adapter to local disk, size-capped,
with timeouts and retries). Downloads land in a work directory the store owns. Errors are
translated here: a missing object is AdapterNotFound, a refusal is UnsafeReference, an outage
after retries is SourceUnavailable. Messages use ``Reference.display``: never a query string or
a credential, and never what a remote answered (status, body, exception type, timing): "not
found or not allowed", "not allowed", "not available". The detail goes to the operator's log.

Every remote byte comes through one client (``remote.Remote``): the egress policy's pinned connections
(``egress``), one total deadline per probe or download (``download_deadline_s``) shared by its
attempts, and the size cap while streaming. httpx's timeouts restart with every byte received,
so without the deadline a server that drips bytes would hold a fetch worker forever. S3 objects
are fetched by boto3-presigned URLs and Hub files by their resolve URLs through that client, so
the S3 and Hub endpoints (and the CDNs they redirect to) meet the same policy and deadline.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from hotlora.adapters.store.egress import EgressPolicy, EgressRefused
from hotlora.adapters.store.references import Reference, UnsafeReference, confine_local_path, confine_tree
from hotlora.adapters.store.remote import Deadline, Remote, check_size
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterNotFound, SourceUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fetched:
    path: Path  # a weights file, or a directory holding one (PEFT layout, Hub snapshot)
    identity: str  # what the content is: etag, revision or content hash
    nbytes: int
    # Where reading may go (symlinks followed): the local roots, the download's work directory, the
    # Hub repository's cache folder. Empty: not confined (adapters handed over in memory, tests).
    roots: tuple[Path, ...] = ()


class Source(Protocol):
    """``deadline``: the whole fetch's, started when it was asked for (queue, probe and download
    together); None: ``download_deadline_s`` from now."""

    def probe(self, ref: Reference, deadline: Deadline | None = None) -> str | None: ...

    def fetch(self, ref: Reference, workdir: Path, deadline: Deadline | None = None) -> Fetched: ...






def _file_name(path: str, default: str = "adapter.safetensors") -> str:
    name = os.path.basename(path.rstrip("/"))
    return name if name and name not in (".", "..") else default


class LocalSource:
    """Files and directories inside the local roots; every file of a directory checked too."""

    def __init__(self, config: StoreConfig, roots: tuple[Path, ...] | None = None):
        self.config = config
        self.roots = tuple(config.local_roots if roots is None else roots)

    def _located(self, ref: Reference) -> Path:
        path = confine_local_path(ref.location, self.roots)
        if not path.exists():
            raise AdapterNotFound(f"adapter not found: {ref.display} does not exist")
        confine_tree(path, self.roots)
        return path

    def probe(self, ref: Reference, deadline: Deadline | None = None) -> str:
        path = self._located(ref)
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        return "file|" + hashlib.sha256(f"{path}|{stats}".encode()).hexdigest()

    def fetch(self, ref: Reference, workdir: Path, deadline: Deadline | None = None) -> Fetched:
        identity = self.probe(ref)
        path = self._located(ref)
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else path.stat().st_size
        check_size(size, ref, self.config)
        return Fetched(path, identity, size, self.roots)  # read where it lies: nothing to copy




class HttpSource:
    """HTTPS downloads: streamed, size-capped, retried, under one deadline; every hop under the
    egress policy (``allowed_hosts`` exclusive when set)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.remote = Remote(config, EgressPolicy.of(config, exclusive=True))

    def probe(self, ref: Reference, deadline: Deadline | None = None) -> str | None:
        headers = self.remote.head(ref, ref.location, deadline=deadline)
        etag = headers.get("etag") if headers is not None else None
        return f"https|{_stable_url(ref.location)}|{etag}" if etag else None

    def fetch(self, ref: Reference, workdir: Path, deadline: Deadline | None = None) -> Fetched:
        target = workdir / _file_name(urlsplit(ref.location).path)
        received, digest, headers = self.remote.download(ref, ref.location, target, deadline=deadline)
        etag = headers.get("etag")
        identity = f"https|{_stable_url(ref.location)}|{etag}" if etag else f"sha256|{digest}"
        return Fetched(target, identity, received, (workdir,))




def _stable_url(url: str) -> str:
    """The URL without its query: presigned URLs name the same object with a new signature each time."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path}"


class S3Source:
    """S3-compatible storage: buckets (or bucket/prefix) in ``allowed_s3`` only, since the server's
    credentials may read far more than clients should. boto3 resolves credentials and signs; the
    bytes come through the egress client by presigned URL, so the endpoint is address-checked and
    pinned and the download deadline holds however the endpoint drips."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._s3 = None
        self.remote = Remote(config, EgressPolicy.of(config, exclusive=False))

    def endpoint(self) -> str | None:
        return (self.config.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))

    def client(self):
        if self._s3 is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                raise SourceUnavailable("s3:// references need the 's3' extra: pip install 'hotlora[s3]'") from exc
            endpoint = self.endpoint()
            # Path-style addressing on a custom endpoint: the bucket stays out of the host name, so
            # the host the policy (and allowed_hosts) sees is the endpoint's own.
            s3 = {"addressing_style": "path"} if endpoint else {}
            self._s3 = boto3.client(
                "s3", endpoint_url=endpoint, region_name=self.config.s3_region or os.environ.get("AWS_REGION"),
                config=Config(signature_version="s3v4", s3=s3),
            )
        return self._s3

    def _allowed(self, ref: Reference) -> None:
        for entry in self.config.allowed_s3:
            entry = entry.strip("/")
            if entry and (ref.location == entry or ref.location.startswith(entry + "/")):
                return
        log.warning("%s: not in allowed_s3", ref.display)
        raise UnsafeReference(f"{ref.display}: not allowed")

    def _url(self, ref: Reference, method: str) -> str:
        self._allowed(ref)
        endpoint = self.endpoint()
        try:
            if endpoint:
                self.remote.policy.check_endpoint(endpoint)
            bucket, key = ref.location.split("/", 1)
            expires = int(min(7 * 24 * 3600, max(60, Deadline.of(self.config).seconds + 60)))
            return self.client().generate_presigned_url(method, Params={"Bucket": bucket, "Key": key},
                                                        ExpiresIn=expires)
        except EgressRefused as exc:
            log.warning("%s: S3 endpoint refused by the egress policy: %s", ref.display, exc)
            raise UnsafeReference(f"{ref.display}: not allowed") from None
        except (OSError, ValueError) as exc:
            log.warning("%s: S3 endpoint unusable (%s)", ref.display, type(exc).__name__)
            raise SourceUnavailable(f"{ref.display}: not available") from None
        except Exception as exc:  # botocore's credential and configuration errors
            if isinstance(exc, (UnsafeReference, SourceUnavailable)):
                raise
            log.warning("%s: cannot sign an S3 request (%s)", ref.display, type(exc).__name__)
            raise SourceUnavailable(f"{ref.display}: not available") from None

    def probe(self, ref: Reference, deadline: Deadline | None = None) -> str | None:
        headers = self.remote.head(ref, self._url(ref, "head_object"), deadline=deadline)
        if headers is None:
            return None
        return f"s3|{ref.location}|{headers.get('etag')}|{headers.get('x-amz-version-id')}"

    def fetch(self, ref: Reference, workdir: Path, deadline: Deadline | None = None) -> Fetched:
        target = workdir / _file_name(ref.location.split("/", 1)[1])
        received, _, headers = self.remote.download(ref, self._url(ref, "get_object"), target, deadline=deadline)
        identity = f"s3|{ref.location}|{headers.get('etag')}|{headers.get('x-amz-version-id')}"
        return Fetched(target, identity, received, (workdir,))
