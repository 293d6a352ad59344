"""One replica of one base model: a warm worker behind the very app ``hotlora serve`` runs.

The ingress forwards the raw HTTP request; the replica replays it against ``create_app``'s ASGI
app in-process (httpx's ASGI transport), so every route, its validation, errors, metrics and
timings are exactly the single-process server's. Serve's model multiplexing keys the replica
on the request's identity adapter (by a hash of its reference, ``reference_id``): the first request
for an identity loads it into the store's RAM cache, Serve reports the replica as holding it, and
later requests for it are routed here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from ray import serve

from hotlora.adapters.store.references import redact_reference, reference_id
from hotlora.scaleout.config import ModelDeployment
from hotlora.scaleout.routing import REPLICA_HEADER
from hotlora.errors import HotloraError
from hotlora.lru import LRU

log = logging.getLogger(__name__)
# Recomputed by whoever re-frames the body (Starlette on the ingress); never forwarded as is.
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}
# The client's Host header does reach the app: its Host allow list (DNS rebinding) and same-origin
# check judge the name the client used, not the in-process transport's.
REQUEST_HOP_HEADERS = HOP_HEADERS - {"host"}


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    identity: str | None = None  # the identity adapter's reference; Serve's model id is its hash


@dataclass
class ForwardedReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def adapters_that_fit(spec: ModelDeployment, store, adapter_bytes_estimate: int) -> int:
    """Serve's per-replica model count, matched to the RAM cache: the budget left beside the catalog
    (what is in RAM right after start-up), in typical identity adapters (at least one)."""
    if spec.max_adapters_per_replica:
        return spec.max_adapters_per_replica
    catalog_bytes = sum(a.nbytes for a in store.ram.values()) if store else 0
    return max(1, (spec.store.ram_budget_bytes - catalog_bytes) // max(1, adapter_bytes_estimate))


@serve.deployment
class ModelReplica:
    def __init__(self, spec: ModelDeployment, adapter_bytes_estimate: int):
        from hotlora.server.app import create_app
        from hotlora.server.run import build_serving

        self.spec = spec
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        # A replica is a process of its own already (Ray restarts it when it dies): the engine runs here.
        self.serving = build_serving(spec.server.replace(engine_process=False), spec.store)
        self.worker = self.serving.worker
        # Build and warm the engine, pre-cache the catalog: Serve routes nothing here until __init__
        # returns, so a replica is only ever offered traffic once it is warm.
        self.worker.start()
        self.app = create_app(self.serving, spec.server, start_worker=False)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://replica",
                                        timeout=None)
        self.max_adapters = adapters_that_fit(spec, self.serving.store, adapter_bytes_estimate)

        # Applied here rather than as a class decorator because the count is only known once the
        # catalog is loaded; Serve detects multiplexed functions stored on the instance.
        # Serve's model id is a hash (reference_id); the reference it stands for is noted by
        # ``handle`` just before the multiplexed call, bounded like Serve's own model table.
        self._identity_refs: LRU[str, str] = LRU(max_entries=4 * self.max_adapters)

        @serve.multiplexed(max_num_models_per_replica=self.max_adapters)
        async def hold_identity(model_id: str):
            ref = self._identity_refs.get(model_id)
            return await self._fetch(ref) if ref is not None else None

        self.hold_identity = hold_identity
        log.info("replica %s ready: %s, up to %d identity adapters", self.replica_id, spec.server.model,
                 self.max_adapters)

    async def _fetch(self, ref: str):
        """Load the identity adapter into the store's RAM cache (and so register this replica as
        holding it). A bad reference is not an error here: the app resolves it again and answers it."""
        try:
            return await self.serving.store.aget(ref)  # a request waits for it: the request lane
        except HotloraError as exc:  # its message names the reference redacted (Reference.display)
            log.info("identity adapter %s did not load: %s", redact_reference(ref), exc)
            return None

    async def handle(self, request: ForwardedRequest) -> ForwardedReply:
        model_id = serve.get_multiplexed_model_id()
        if model_id and request.identity and reference_id(request.identity) == model_id:
            self._identity_refs.put(model_id, request.identity)
            await self.hold_identity(model_id)
        response = await self.client.request(request.method, request.path, params=request.query or None,
                                              headers=[(k, v) for k, v in request.headers if k.lower() not in REQUEST_HOP_HEADERS],
                                              content=request.body)
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in HOP_HEADERS]
        headers.append((REPLICA_HEADER, self.replica_id))
        return ForwardedReply(response.status_code, headers, response.content)

    def describe(self) -> dict:
        """For tests and operators: who this replica is and what its caches hold."""
        store = self.serving.store
        return {"replica": self.replica_id, "model": self.spec.server.model, "max_adapters": self.max_adapters,
                "ready": self.worker.ready, "stats": store.stats() if store else None}

    def __del__(self):
        # Serve calls this on graceful shutdown or scale-down: finish what is queued first.
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop(self.spec.server.drain_timeout_s)
