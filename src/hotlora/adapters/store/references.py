"""Adapter references: one string names an adapter. Parsing and the safety rules live here.

    /abs/path or rel/path or file:///abs/path     local file or directory (inside configured roots)
    https://host/path[?query]                      HTTPS (http:// only when allowed)
    s3://bucket/key                                S3-compatible storage (AWS, R2, MinIO)
    hf://owner/repo[@revision][/file.safetensors]  Hugging Face Hub, through huggingface_hub
    catalog:name  (or a bare catalog name)         an entry of the adapter catalog

Confined by construction: a Hub file part and revision, and an S3 key, are relative paths of
plain components (no ``..``, ``.``, empty components, backslashes or percent-escapes), so what
they name cannot climb out of the snapshot, the prefix or the bucket however it is joined or
URL-normalised later. Where a reference reaches the network is ``egress``'s business.

Parsed fully, once: a reference with a control character, a URL with whitespace, no host, a port
outside 1-65535, a broken IPv6 literal or anything else httpx would refuse, an S3 bucket that is
not a bucket name, is an ``InvalidReference`` (422) here, so nothing after ``parse_reference``
(egress, auth's source prefixes, the remote client, redaction) meets a malformed one.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hotlora.errors import AdapterFormatError, InvalidRequest, UnsafeReference

_HF = re.compile(r"^hf://(?P<repo>[\w.\-]+/[\w.\-]+)(?:@(?P<revision>[\w.\-/]+?))?(?:/(?P<file>[^@]+))?$")
# S3 bucket names (AWS's rules, loosened for legacy and S3-compatible stores: case and "_" allowed).
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,254}$")


class InvalidReference(InvalidRequest):
    """A reference that is not well-formed (a URL that does not parse, a control character).
    Its message never quotes the reference: a malformed URL may still carry a signature."""


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)


def _plain_components(path: str) -> bool:
    """A relative path of ordinary names: what may be joined onto a folder or a URL path."""
    if not path or "\\" in path or "%" in path or path.startswith("/"):
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


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
    """Drop user info, query and fragment: presigned URLs carry their signature there. Never
    raises: a URL that does not parse is shown as its hash."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a broken IPv6 literal, a port that is not one
        return f"<unparseable URL {reference_id(url)[:12]}>"
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets, or the port would read as part of it
        host = f"[{host}]"
    if port:
        host = f"{host}:{port}"
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
        raise InvalidReference("adapter reference must be a non-empty string")
    ref = ref.strip()
    if "\x00" in ref:
        raise UnsafeReference("adapter reference contains a NUL byte")
    if _has_control(ref):  # CR/LF would forge log lines; httpx refuses them in URLs
        raise InvalidReference("adapter reference contains a control character")
    if ref.startswith("catalog:"):
        return Reference("catalog", ref.removeprefix("catalog:"))
    if ref in catalog_names:
        return Reference("catalog", ref)
    lowered = ref.lower()
    if lowered.startswith(("https://", "http://")):
        _check_url(ref)
        return Reference("https", ref)
    if lowered.startswith("s3://"):
        bucket, _, key = ref[5:].partition("/")
        if not bucket or not key:
            raise InvalidReference(f"S3 reference must be s3://bucket/key, got {redact_url(ref)!r}")
        if not _BUCKET.match(bucket):
            raise InvalidReference("S3 reference names no valid bucket (letters, digits, '.', '-', '_')")
        if not _plain_components(key) or "?" in key or "#" in key:
            # URL clients drop dot segments ("a/../b" is fetched as "b"): a key with them would
            # leave the prefix the bucket allow list granted.
            raise UnsafeReference(f"S3 key of {redact_url(ref)!r} must be a plain relative path")
        return Reference("s3", f"{bucket}/{key}")
    if lowered.startswith("hf://"):
        match = _HF.match(ref)
        if not match:
            raise InvalidReference("Hub reference must be hf://owner/repo[@revision][/file]")
        _check_hub_parts(match["repo"], match["revision"], match["file"])
        return Reference("hf", match["repo"], match["revision"], match["file"])
    if lowered.startswith("file://"):
        return Reference("file", ref[len("file://"):])
    if "://" in ref:
        raise InvalidReference(f"unsupported reference scheme {ref.split('://')[0]!r}://")
    return Reference("file", ref)


def _check_url(url: str) -> None:
    """An http(s) reference that httpx, the egress policy and redaction will all read the same way:
    no whitespace (urlsplit silently drops tabs and newlines; httpx refuses them or encodes spaces),
    a host, a port in 1-65535, and nothing else httpx would refuse (an invalid IDNA name, say)."""
    import httpx

    if any(c.isspace() for c in url):
        raise InvalidReference("adapter URL contains whitespace (percent-encode it)")
    if "\\" in url:  # browsers read it as "/", urlsplit and httpx as a plain character: two hosts
        raise InvalidReference("adapter URL contains a backslash (percent-encode it)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # "Invalid IPv6 URL", "Port out of range 0-65535", a port that is not a number
        raise InvalidReference("adapter URL has a malformed host or port") from None
    if not parts.hostname:
        raise InvalidReference("adapter URL names no host")
    if port == 0:
        raise InvalidReference("adapter URL has a malformed host or port")
    try:
        host = httpx.URL(url).host  # the host decoded too: an invalid IDNA label ("xn--") fails there
    except (httpx.InvalidURL, ValueError, UnicodeError):  # idna's errors are UnicodeErrors
        raise InvalidReference("adapter URL is malformed") from None
    if not host:
        raise InvalidReference("adapter URL names no host")


def _check_hub_parts(repo: str, revision: str | None, filename: str | None) -> None:
    """hf:// parts that name something inside one repository's snapshot, nothing else."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)  # the hub's own rule: no "..", "--", leading/trailing "." or "-"
    except HFValidationError:
        raise InvalidReference("Hub reference names no valid owner/repo") from None
    if revision is not None and not _plain_components(revision):
        raise UnsafeReference(f"hf://{repo}: the revision must be a plain name")
    if filename is not None and not _plain_components(filename):
        raise UnsafeReference(f"hf://{repo}: the file must be a relative path inside the repository")


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` is ``folder`` or below it (both taken as given: resolve them first)."""
    path, folder = Path(path), Path(folder)
    return path == folder or folder in path.parents


def confine_local_path(path: str, roots) -> Path:
    """Resolve ``path`` (relative paths against the first root) and require it inside a root.

    ``..`` components are refused outright; symlinks are followed before the check, so a link
    that leads out of the roots is refused too.
    """
    if any(part == ".." for part in Path(path).parts):
        raise UnsafeReference(f"adapter path {path!r} contains '..'")
    roots = [Path(os.path.realpath(r)) for r in roots]
    if not roots:
        raise UnsafeReference("local adapter references are disabled (no local roots configured)")
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    resolved = Path(os.path.realpath(candidate))
    if any(inside(resolved, root) for root in roots):
        return resolved
    # The same words whether or not something exists there: no probing outside the roots.
    raise UnsafeReference(f"adapter path {path!r} is outside the allowed directories")


def confine_tree(path: Path, roots) -> None:
    """Every file a local adapter directory holds stays inside ``roots`` once symlinks are followed
    (a file reference is checked by ``confine_local_path``; this covers what lies beside or below),
    and is a regular file or a directory: a FIFO, a socket or a device (``/dev/zero`` by a link)
    never ends or never answers, and would hold a fetch worker forever."""
    roots = [Path(os.path.realpath(r)) for r in roots]
    entries = [path, *path.iterdir()] if path.is_dir() else [path]
    for entry in entries:
        if not any(inside(os.path.realpath(entry), root) for root in roots):
            raise UnsafeReference("adapter directory holds a link to outside the allowed directories")
        check_plain_file(entry)


def check_plain_file(path: Path, mode: int | None = None) -> None:
    """A regular file or a directory (symlinks followed), else ``AdapterFormatError`` (422).
    ``mode``: an ``st_mode`` already at hand (``os.fstat`` of an open file)."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:  # a dangling link, a file removed meanwhile: whoever opens it says so
            return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise AdapterFormatError(f"adapter file {Path(path).name!r} is not a regular file "
                                 "(a pipe, socket or device is never read)")
