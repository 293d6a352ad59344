"""API keys: who may ask this server for what, and which adapter sources each key may name.

Plain Python (no web framework), so ``hotlora keys new`` works without the server's extras;
``server/access.py`` turns it into FastAPI dependencies.

Keys are random (``hlk_`` + 32 random bytes, URL-safe base64) and sent as ``Authorization: Bearer
<key>``, which is what huggingface_hub's ``InferenceClient(token=...)`` and the ``openai`` client
send. The server keeps only their SHA-256: a keys file (``api_keys_file``) or ``HOTLORA_API_KEYS``
holds one line per key (``;`` also separates entries, for the variable)::

    sha256:<64 hex digits> [name=<id>] [scopes=generate,prefetch] [sources=s3://tenant-a/,catalog:]

``hotlora keys new`` prints a new key once, and the line to add. A plain SHA-256 is enough for keys
with 256 random bits (no dictionary to try); the digests are compared with ``hmac.compare_digest``,
against every line, so the time taken says nothing about which line (if any) came close.

Scopes: ``generate`` (the three generation APIs), ``prefetch`` (warm the cache), ``metrics``
(``/metrics``), ``admin`` (everything, the whole adapter listing and the fault hook). Listing
adapters needs ``generate`` or ``prefetch``. ``sources``: reference prefixes the key's requests may
name (``s3://tenant-a/``, ``https://cdn.example/tenant-a/``, ``hf://owner/``, ``catalog:`` for every
catalog entry or ``catalog:name``); a key without ``sources`` may name any reference the store allows.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from hotlora.adapters.store.references import parse_reference, redact_reference
from hotlora.errors import Forbidden, HotloraError

log = logging.getLogger(__name__)

SCOPES = ("generate", "prefetch", "metrics", "admin")
DEFAULT_SCOPES = ("generate", "prefetch")
KEY_PREFIX = "hlk_"
AUTH_MODES = ("auto", "on", "off")


class AuthConfigError(HotloraError):
    """The key settings cannot be used (a start-up fault): no keys where keys are required, a bad line."""


@dataclass(frozen=True)
class Principal:
    """Who is asking: a key's name, its scopes and the reference prefixes it may use (none: any)."""

    name: str
    scopes: frozenset[str]
    sources: tuple[str, ...] = ()

    def allows(self, *scopes: str) -> bool:
        """Whether the principal has any of ``scopes`` (``admin`` has every scope)."""
        return "admin" in self.scopes or any(s in self.scopes for s in scopes)

    def check_references(self, refs, catalog_names=()) -> None:
        """Refuse (403) any reference outside this key's sources, before anything is fetched."""
        if not self.sources:
            return
        refused = [r for r in refs if not self._may_use(r, catalog_names)]
        if refused:
            shown = ", ".join(repr(redact_reference(r)) for r in refused[:4])
            # The key's prefixes are the operator's business (they name other tenants' paths, buckets,
            # hosts): the log has them, the client reads only what it asked for.
            log.warning("key %r refused %s: outside its sources %s", self.name, shown, ", ".join(self.sources))
            raise Forbidden(f"this key may not use {shown}: outside the adapter sources it is allowed")

    def _may_use(self, ref, catalog_names) -> bool:
        canonical = canonical_reference(ref, catalog_names)
        return canonical is not None and any(canonical.startswith(prefix) for prefix in self.sources)


ANONYMOUS = Principal("anonymous", frozenset(SCOPES))  # auth off: one tenant, every scope


def canonical_reference(ref, catalog_names=()) -> str | None:
    """The form a source prefix is matched against: scheme and host lower-cased, no user info,
    query or revision (``hf://owner/repo/file``). None for a reference that holds ``.`` or ``..``
    path segments, percent-encoded or not: a prefix check on a path the far end normalises
    (``tenant-a/../tenant-b``) would be no check at all."""
    reference = parse_reference(ref, catalog_names=catalog_names)  # InvalidReference when malformed
    if reference.kind == "catalog":
        return f"catalog:{reference.location}"
    if reference.kind == "https":
        parts = urlsplit(reference.location)
        path = parts.path or "/"
        try:
            canonical = f"{parts.scheme.lower()}://{_netloc(parts)}{path}"
        except ValueError:  # parse_reference refuses a bad port; should one pass, it matches no prefix
            return None
    elif reference.kind == "s3":
        path = canonical = f"s3://{reference.location}"
    elif reference.kind == "hf":
        path = reference.filename or ""
        canonical = f"hf://{reference.location}/{path}"
    else:
        path = canonical = reference.location
    return None if _has_dot_segments(path) else canonical


def _netloc(parts) -> str:
    """``host[:port]`` lower-cased; ValueError for a port that is not one."""
    host = (parts.hostname or "").lower()
    port = parts.port
    return f"{host}:{port}" if port else host


def _has_dot_segments(path: str) -> bool:
    for _ in range(3):  # %252e%252e decodes to %2e%2e, then to ..
        path = unquote(path)
    return any(segment in (".", "..") for segment in path.replace("\\", "/").split("/"))


def _prefix(value: str, where: str = "sources") -> str:
    """A source prefix in the canonical form (URL scheme and host lower-cased)."""
    if value.lower().startswith(("https://", "http://")):
        try:
            parts = urlsplit(value)
            return f"{parts.scheme.lower()}://{_netloc(parts)}{parts.path}"
        except ValueError:  # a broken IPv6 literal or port: a start-up error, not a 500 per request
            raise AuthConfigError(f"{where}: a sources= prefix is not a valid URL (its host or port)") from None
    return value


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class Keyring:
    """The known keys, by digest; ``authenticate`` returns the key's principal or None."""

    def __init__(self, entries: list[_Entry]):
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def authenticate(self, key: str) -> Principal | None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for entry in self.entries:  # every entry, no early exit: the time does not depend on the match
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        return found

    @classmethod
    def parse(cls, text: str, origin: str) -> "Keyring":
        entries = []
        for number, line in enumerate(text.replace(";", "\n").splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append(_parse_line(line, f"{origin} entry {number}"))
        names = [e.principal.name for e in entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise AuthConfigError(f"{origin}: key names must be unique; repeated: {', '.join(duplicates)}")
        return cls(entries)

    @classmethod
    def load(cls, keys_file: str | None, keys_text: str | None) -> "Keyring":
        """The keys of ``api_keys_file`` and ``HOTLORA_API_KEYS`` (or ``api_keys`` in a config file)."""
        text, origins = [], []
        if keys_file:
            try:
                text.append(Path(keys_file).read_text())
            except OSError as exc:
                raise AuthConfigError(f"cannot read the API keys file {keys_file}: {exc.strerror or exc}") from None
            origins.append(str(keys_file))
        if keys_text:
            text.append(keys_text if isinstance(keys_text, str) else "\n".join(keys_text))
            origins.append("HOTLORA_API_KEYS / api_keys")
        return cls.parse("\n".join(text), " + ".join(origins) or "api keys")


def _parse_line(line: str, where: str) -> _Entry:
    digest, *fields = line.split()
    hex_digest = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:") or len(hex_digest) != 64 or not _is_hex(hex_digest):
        # Never echo the line: it may be a key pasted where its hash belongs.
        raise AuthConfigError(f"{where}: expected 'sha256:<64 hex digits> [name=..] [scopes=..] [sources=..]' "
                              "(the file holds hashes, never keys: `hotlora keys new` prints both)")
    values = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or name not in ("name", "scopes", "sources") or name in values:
            raise AuthConfigError(f"{where}: unknown or repeated field {name!r} (known: name, scopes, sources)")
        values[name] = value
    scopes = _scopes(values.get("scopes", ",".join(DEFAULT_SCOPES)), where)
    sources = tuple(_prefix(s, where) for s in values.get("sources", "").split(",") if s)
    principal = Principal(values.get("name") or hex_digest[:8], scopes, sources)
    return _Entry(bytes.fromhex(hex_digest), principal)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _scopes(value: str, where: str) -> frozenset[str]:
    scopes = frozenset(s for s in value.split(",") if s)
    unknown = sorted(scopes - set(SCOPES))
    if unknown or not scopes:
        raise AuthConfigError(f"{where}: scopes must be some of {', '.join(SCOPES)}; got {value!r}")
    return scopes


def new_key(name: str | None = None, scopes=DEFAULT_SCOPES, sources=()) -> tuple[str, str]:
    """A new key and its keys-file line. The key is shown once; the server keeps only the line."""
    scopes = sorted(_scopes(",".join(scopes), "--scopes"), key=SCOPES.index)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    line = f"sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    for field, value in (("name", name), ("scopes", ",".join(scopes)), ("sources", ",".join(sources))):
        if value:
            if any(c.isspace() or c in "#;" for c in value):
                raise AuthConfigError(f"--{field} may not hold spaces, '#' or ';': {value!r}")
            line += f" {field}={value}"
    return key, line


def is_loopback(host: str) -> bool:
    """Whether a bind address only takes connections from this machine."""
    host = (host or "").strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def keyring_for(config) -> Keyring | None:
    """The keys a server built from ``config`` requires, or None when it serves without keys.

    ``auth = "auto"`` (the default): keys are required when the server binds a non-loopback address
    or when keys are configured (a loopback server behind a reverse proxy on the same host is reached
    from anywhere). Required but none configured: a start-up error, not a server that answers 401
    to everyone. ``auth = "off"``: no keys, whatever the address; loudly logged when not loopback.
    """
    keyring = Keyring.load(config.api_keys_file, config.api_keys)
    loopback = is_loopback(config.host)
    if config.auth == "off":
        if not loopback:
            log.warning("AUTHENTICATION IS OFF on %s: anyone who reaches this port can generate, fetch adapters "
                        "into the cache and list them (auth = \"off\")", config.host)
        return None
    if config.auth == "auto" and loopback and not len(keyring):
        return None
    if not len(keyring):
        reason = "auth = \"on\"" if config.auth == "on" else f"it binds {config.host}, which is not a loopback address"
        raise AuthConfigError(
            f"this server needs API keys ({reason}) and none are configured: create one with `hotlora keys new`, "
            "put its line in a file given as --api-keys-file (or in HOTLORA_API_KEYS); or bind 127.0.0.1; "
            "or serve without keys with --auth off (anyone who reaches the port may then use it)")
    log.info("API keys required: %d key(s) known", len(keyring))
    return keyring
