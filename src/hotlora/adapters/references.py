"""Adapter references: one string names an adapter. Parsing and the safety rules live here.

    /abs/path or rel/path or file:///abs/path     local file or directory (inside configured roots)
    https://host/path[?query]                      HTTPS (http:// only when allowed)
    s3://bucket/key                                S3-compatible storage (AWS, R2, MinIO)
    hf://owner/repo[@revision][/file.safetensors]  Hugging Face Hub, through huggingface_hub
    catalog:name  (or a bare catalog name)         an entry of the adapter catalog
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hotlora.errors import InvalidRequest

_HF = re.compile(r"^hf://(?P<repo>[\w.\-]+/[\w.\-]+)(?:@(?P<revision>[\w.\-/]+?))?(?:/(?P<file>[^@]+))?$")


class UnsafeReference(InvalidRequest):
    """A reference that points outside what this server may read."""

    status_code = 403


@dataclass(frozen=True)
class Reference:
    kind: str  # file | https | s3 | hf | catalog
    location: str  # path, URL, bucket/key, repo, or catalog name
    revision: str | None = None
    filename: str | None = None

    @property
    def display(self) -> str:
        """Safe to log and to show in errors: no query strings, no credentials."""
        if self.kind == "https":
            return redact_url(self.location)
        if self.kind == "hf":
            rev = f"@{self.revision}" if self.revision else ""
            return f"hf://{self.location}{rev}" + (f"/{self.filename}" if self.filename else "")
        if self.kind == "s3":
            return f"s3://{self.location}"
        if self.kind == "catalog":
            return f"catalog:{self.location}"
        return self.location


def redact_url(url: str) -> str:
    """Drop user info, query and fragment: presigned URLs carry their signature there."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    redacted_query = "<redacted>" if parts.query else ""
    return urlunsplit((parts.scheme, host, parts.path, redacted_query, ""))


def redact_reference(ref) -> str:
    """The one redaction used by logs, errors, metrics, listings and the playground: a raw
    client-supplied reference as it may be shown. URLs lose user info, query and fragment (presigned
    signatures, tokens); anything that does not parse is shown as its hash, never as its text."""
    try:
        return parse_reference(ref).display
    except InvalidRequest:
        return f"<unparseable reference {reference_id(ref)[:12]}>"


def reference_id(ref) -> str:
    """A stable, opaque id for a raw reference (the Ray multiplexed model id): a hash, so a presigned
    URL's signature never travels as a routing key, a log field or a metric label."""
    return hashlib.sha256(str(ref).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def parse_reference(ref: str, catalog_names=()) -> Reference:
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidRequest("adapter reference must be a non-empty string")
    ref = ref.strip()
    if "\x00" in ref:
        raise UnsafeReference("adapter reference contains a NUL byte")
    if ref.startswith("catalog:"):
        return Reference("catalog", ref.removeprefix("catalog:"))
    if ref in catalog_names:
        return Reference("catalog", ref)
    lowered = ref.lower()
    if lowered.startswith(("https://", "http://")):
        return Reference("https", ref)
    if lowered.startswith("s3://"):
        bucket, _, key = ref[5:].partition("/")
        if not bucket or not key:
            raise InvalidRequest(f"S3 reference must be s3://bucket/key, got {redact_url(ref)!r}")
        return Reference("s3", f"{bucket}/{key}")
    if lowered.startswith("hf://"):
        match = _HF.match(ref)
        if not match:
            raise InvalidRequest(f"Hub reference must be hf://owner/repo[@revision][/file], got {ref!r}")
        return Reference("hf", match["repo"], match["revision"], match["file"])
    if lowered.startswith("file://"):
        return Reference("file", ref[len("file://"):])
    if "://" in ref:
        raise InvalidRequest(f"unsupported reference scheme {ref.split('://')[0]!r}://")
    return Reference("file", ref)


def confine_local_path(path: str, roots) -> Path:
    """Resolve ``path`` (relative paths against the first root) and require it inside a root.

    ``..`` components are refused outright; symlinks are followed before the check, so a link
    that leads out of the roots is refused too.
    """
    if any(part == ".." for part in Path(path).parts):
        raise UnsafeReference(f"adapter path {path!r} contains '..'")
    roots = [Path(r).resolve() for r in roots]
    if not roots:
        raise UnsafeReference("local adapter references are disabled (no local roots configured)")
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    resolved = Path(os.path.realpath(candidate))
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    raise UnsafeReference(f"adapter path {path!r} is outside the allowed directories")
