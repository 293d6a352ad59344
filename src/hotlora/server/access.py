"""Who is asking and what they may see: the key check as a FastAPI dependency per scope, and the
per-caller view of the adapter cache (tenancy).

The store is content-addressed and shared: two callers' references to the same bytes are one cache
entry, whose ``Adapter.name`` is the *first* fetcher's reference. So the server never shows that
name to anyone else: each request's adapters are renamed after the caller's own reference before
the engine sees them (responses and error messages name what the caller sent), and the listing
shows each caller only the adapters it fetched itself, under its own names (a bounded LRU per key).
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from hotlora.adapters.store.references import parse_reference, redact_reference
from hotlora.errors import Forbidden, InvalidRequest, Unauthorized
from hotlora.lru import LRU
from hotlora.server.auth import ANONYMOUS, Keyring, Principal, keyring_for

REFS_PER_CALLER = 1024  # adapters remembered per key for its listing (least recently fetched forgotten)

# One scheme object for every route, so the OpenAPI page shows one "Bearer" security scheme.
# auto_error=False: a missing or non-Bearer header is our 401 in our error shape, not FastAPI's.
_bearer = Depends(HTTPBearer(auto_error=False, description="an API key made by `hotlora keys new`"))


class Access:
    def __init__(self, config):
        self.keyring: Keyring | None = keyring_for(config)  # None: auth off (one anonymous tenant)
        self._seen: dict[str, LRU[str, str]] = {}  # principal name -> adapter sha256 -> the caller's name
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.keyring is not None

    # ------------------------------------------------------------------ authentication

    def require(self, *scopes: str):
        """A dependency: the caller's key must be known and hold one of ``scopes``; the principal is
        left on ``request.state`` for the service."""

        async def dependency(request: Request, credentials: HTTPAuthorizationCredentials | None = _bearer):
            principal = self.authenticate(credentials)
            if not principal.allows(*scopes):
                raise Forbidden(f"this key lacks the {' or '.join(scopes)} scope")
            request.state.principal = principal
            return principal

        return dependency

    def authenticate(self, credentials: HTTPAuthorizationCredentials | None) -> Principal:
        if self.keyring is None:
            return ANONYMOUS
        if credentials is None:
            raise Unauthorized("an API key is required: send it as 'Authorization: Bearer <key>'")
        principal = self.keyring.authenticate(credentials.credentials)
        if principal is None:
            raise Unauthorized("unknown API key")
        return principal

    @staticmethod
    def principal_of(request: Request) -> Principal:
        """The principal the route's dependency found. A route without one serves nobody."""
        principal = getattr(request.state, "principal", None)
        if principal is None:
            raise Unauthorized("this route checks no key: refused")
        return principal

    @staticmethod
    def client_of(request: Request) -> str:
        """Whose share a request counts against (fetch workers, prefetches, requests waiting on
        fetches): its API key, else (auth off: one anonymous principal) its peer address."""
        principal = getattr(request.state, "principal", None)
        if principal is not None and principal is not ANONYMOUS:
            return f"key:{principal.name}"
        return f"peer:{request.client.host if request.client else 'unknown'}"

    # ------------------------------------------------------------------ tenancy

    def named(self, principal: Principal, adapter, ref: str):
        """``adapter`` under the caller's own (redacted) reference, remembered for its listing. A shallow
        copy: the tensors and the content key (side tables, banks, memos) are shared."""
        name = redact_reference(ref)
        with self._lock:
            self._seen.setdefault(principal.name, LRU(max_entries=REFS_PER_CALLER)).put(adapter.sha256, name)
        if adapter.name == name:
            return adapter
        adapter.key  # computed once on the shared adapter, so the copy inherits it (not rehashed per request)
        renamed = copy.copy(adapter)
        renamed.name = name
        return renamed

    def cached(self, principal: Principal, store) -> list[dict]:
        """The RAM-cached adapters this caller may see: its own, under its own names; ``admin`` (and
        the single tenant when auth is off) sees every entry, catalog entries by their catalog name."""
        if store is None:
            return []
        with self._lock:  # keys and values read together: a put in between would misalign them
            seen = self._seen.get(principal.name)
            own = dict(zip(seen.keys(), seen.values())) if seen is not None else {}
        everything = principal.allows("admin")
        catalog = _catalog_names(store) if everything else {}
        out, shown = [], set()
        for adapter in store.ram.values():
            name = own.get(adapter.sha256)
            if name is None and everything:
                name = catalog.get(adapter.sha256) or adapter.name
            if name is None or adapter.sha256 in shown:
                continue
            shown.add(adapter.sha256)
            out.append({"name": name, "sha256": adapter.sha256, "layout": adapter.layout, "rank": adapter.rank,
                        "bytes": adapter.nbytes})
        return out


def _catalog_names(store) -> dict[str, str]:
    """sha256 -> catalog name for catalog entries RAM holds (found without a network round trip)."""
    names = {}
    for name in store.catalog:
        try:
            adapter = store.cached(f"catalog:{name}")
        except Exception:  # a listing must not fail because one entry went missing
            adapter = None
        if adapter is not None:
            names.setdefault(adapter.sha256, name)
    return names


def catalog_listing(store) -> list[dict]:
    """The catalog as anyone may see it: names, scales, and references redacted; a local file is
    shown relative to the catalog's folder, or by its name (where the server keeps its files is
    not the client's business)."""
    if store is None:
        return []
    catalog_file = getattr(store.config, "catalog", None)
    folder = Path(catalog_file).resolve().parent if isinstance(catalog_file, (str, Path)) else None
    return [{"name": e.name, "ref": public_reference(e.ref, folder), "scale": e.scale, "pin": e.pin}
            for e in store.catalog.values()]


def public_reference(ref: str, folder: Path | None = None) -> str:
    try:
        if parse_reference(ref).kind == "file":
            path = Path(ref.removeprefix("file://"))
            if folder is not None and path.is_relative_to(folder):
                return str(path.relative_to(folder))
            return path.name
    except InvalidRequest:
        pass
    return redact_reference(ref)


def public_model(engine) -> dict:
    """``engine.describe()`` naming the model by its id (``hotlora.json``'s ``model_id``, a hub id,
    or the directory's name), never by its path on this machine."""
    described = engine.describe()
    described["model"] = public_model_id(engine, described.get("model"))
    return described


def public_model_id(engine, model=None) -> str:
    """The served model's id as ``public_model`` names it (``model``: ``engine.model``, the default)."""
    model = str((model if model is not None else getattr(engine, "model", None)) or "")
    model_id = (getattr(engine, "defaults", None) or {}).get("model_id")
    return model_id or (Path(model).name if model and Path(model).exists() else model)
