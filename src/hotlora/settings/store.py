"""The adapter store's settings (``StoreConfig``): how adapters are fetched, checked and cached."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from hotlora.settings.base import Settings
from hotlora.settings.fields import setting

GiB = 1024**3
MiB = 1024**2


class StoreConfig(Settings):
    """How the adapter store fetches, checks and caches adapters."""

    cache_dir: Path = setting(Path(".cache/hotlora"), "adapter cache directory")
    disk_budget_bytes: int = setting(20 * GiB, "the disk tier's byte budget")
    ram_budget_bytes: int = setting(4 * GiB, "the RAM tier's byte budget")
    # Never the working directory by default: a client could name any file the server can read.
    local_roots: tuple[Path, ...] = setting((), "folders local adapter references may read, symlinks followed "
                                                "(default: only the catalog file's folder)")
    # Egress (adapters.egress): every remote connection goes to a public address only, resolved
    # once and pinned. An entry is how a test server on 127.0.0.1 is reached; the S3 and Hub
    # endpoints need one only when they are internal.
    allowed_hosts: tuple[str, ...] = setting((), "hosts (host or host:port) allowed even when internal; when "
                                                 "set, the only hosts https:// references may name")
    allow_http: bool = setting(False, "allow plain http:// references (loopback test servers, trusted networks)")
    # The server's credentials may read far more than its clients should.
    allowed_s3: tuple[str, ...] = setting((), "s3:// buckets or bucket/prefix folders references may name "
                                              "(default: s3:// refused)")
    # Any other hf:// repository is fetched anonymously, so private and gated repos the token
    # reaches stay unreachable to clients.
    allowed_hub_repos: tuple[str, ...] = setting((), "Hub repositories (owner/repo or owner/*) fetched with the "
                                                     "server's HF token (default: the token is never used)")
    allow_pickle: bool = setting(False, "allow .bin / .pt adapters (torch.load(weights_only=True))")
    max_adapter_bytes: int = setting(2 * GiB, "an adapter's size cap")
    max_header_bytes: int = setting(16 * MiB, "a safetensors header's size cap")
    timeout_s: float = setting(30.0, "seconds per network read (connect, each chunk)")
    # A source that drips bytes cannot hold a fetch (and the request waiting on it) longer.
    download_deadline_s: float = setting(120.0, "seconds for a whole fetch from the moment it is asked for: "
                                                "queued, HEAD, download and retries together")
    max_fetch_workers: int = setting(4, "threads that download and convert (RAM-cached adapters never wait)")
    # A client never holds every worker, prefetches never take the last one, and requests go first.
    fetch_workers_per_client: int = setting(0, "fetch workers one client (API key, else peer address) may hold "
                                               "per lane (0: half of max_fetch_workers, at least 1)")
    ram_max_entries: int = setting(10_000, "the RAM tier's entry cap, besides its byte budget")
    retries: int = setting(3, "retries of a failed download")
    backoff_s: float = setting(0.25, "the first retry's wait (doubled each time)")
    s3_endpoint_url: str | None = setting(None, "S3-compatible endpoint (R2, MinIO, ...; default "
                                                "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    s3_region: str | None = setting(None, "S3 region")
    catalog: str | None = setting(None, "catalog file (TOML/YAML) of adapters to pre-cache at start-up")
    # Online, Hub files download into the store's work folder instead.
    hf_cache_dir: str | None = setting(None, "a pre-filled Hub cache read in offline mode (HF_HUB_OFFLINE; "
                                             "default: huggingface_hub's own)")
    # 0: never stale, and each request, even for an adapter in RAM, waits for a HEAD on a worker.
    revalidate_after_s: float = setting(30.0, "seconds a remote reference's content identity (ETag, revision) "
                                              "is trusted; an object replaced at its address may be served "
                                              "that long after the change (0: ask every time)")

    @classmethod
    def from_env(cls, file_values: dict | None = None, **overrides) -> "StoreConfig":
        """Defaults, then a config file's ``[store]`` table (``file_values``), then ``HOTLORA_*``
        variables (e.g. HOTLORA_RAM_BUDGET_BYTES), then ``overrides`` (None: not given)."""
        return cls.layered(file_values=file_values, **overrides)

    @classmethod
    def load(cls, config_file=None, **flags) -> "StoreConfig":
        """``hotlora serve``'s store settings: flags > ``HOTLORA_*`` > ``[store]`` of ``config_file``."""
        return cls.layered(config_file, "store", **flags)

    def tiny_model_dir(self, family: str) -> Path:
        """Where ``hotlora serve`` without ``--model`` builds (once) and serves a family's tiny model."""
        return Path(self.cache_dir) / f"tiny-{family}"

    @field_validator("local_roots")
    @classmethod
    def _roots(cls, value):
        return tuple(Path(p) for p in value if str(p))

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value):
        return tuple(h.strip().lower() for h in value)

    @field_validator("allowed_s3")
    @classmethod
    def _buckets(cls, value):
        return tuple(e.strip().strip("/") for e in value if e.strip().strip("/"))

    @field_validator("allowed_hub_repos")
    @classmethod
    def _repos(cls, value):
        return tuple(e.strip() for e in value)
