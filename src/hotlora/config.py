"""Typed settings in one place. Environment variables use the prefix ``HOTLORA_``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

ENV_PREFIX = "HOTLORA_"
GiB = 1024**3
MiB = 1024**2


@dataclass
class StoreConfig:
    """How the adapter store fetches, checks and caches adapters."""

    cache_dir: Path = Path(".cache/hotlora")
    disk_budget_bytes: int = 20 * GiB
    ram_budget_bytes: int = 4 * GiB
    # Local references must resolve (symlinks followed) inside one of these directories.
    local_roots: tuple[Path, ...] = (Path("."),)
    # Remote hosts (HTTPS hosts and S3 endpoint hosts) allowed; empty = any host.
    allowed_hosts: tuple[str, ...] = ()
    allow_http: bool = False  # plain http:// (loopback test servers, trusted networks)
    allow_pickle: bool = False  # .bin / .pt adapters: torch.load(weights_only=True), still opt-in
    max_adapter_bytes: int = 2 * GiB
    max_header_bytes: int = 16 * MiB
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.25
    s3_endpoint_url: str | None = None  # R2, MinIO, ...; else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    s3_region: str | None = None

    @classmethod
    def from_env(cls, **overrides) -> "StoreConfig":
        """Defaults, then ``HOTLORA_*`` variables (e.g. HOTLORA_RAM_BUDGET_BYTES), then ``overrides``."""
        values = {}
        for f in fields(cls):
            raw = os.environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(raw, f.type)
        values.update(overrides)
        return cls(**values)

    def __post_init__(self):
        self.cache_dir = Path(self.cache_dir)
        self.local_roots = tuple(Path(p) for p in self.local_roots)
        self.allowed_hosts = tuple(h.lower() for h in self.allowed_hosts)


def _parse(raw: str, annotation: str):
    if "bool" in annotation:
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if annotation.startswith("int"):
        return int(raw)
    if annotation.startswith("float"):
        return float(raw)
    if annotation.startswith("tuple"):
        return tuple(p for p in raw.split(os.pathsep if "Path" in annotation else ",") if p)
    if annotation.startswith("Path"):
        return Path(raw)
    return raw or None
