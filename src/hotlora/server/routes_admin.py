"""Operating the server: liveness, readiness, Prometheus metrics, the adapter store (list,
prefetch) and, only when enabled, the fault-injection test hook.

``/healthz`` and ``/readyz`` answer without a key (load balancers); the rest need a key with the
scope named in their ``Depends`` when keys are required (``server/auth.py``).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hotlora.adapters.store.references import parse_reference, redact_reference
from hotlora.errors import InvalidRequest
from hotlora.server.access import catalog_listing, public_model
from hotlora.server.schemas import PrefetchRequest
from hotlora.server.service import Service


def admin_routes(service: Service) -> APIRouter:
    router = APIRouter()
    worker, config, access = service.worker, service.config, service.access

    @router.get("/healthz")
    async def healthz():
        # Alive through engine restarts and rebuilds (readiness takes the server out of service then);
        # not once the worker gave up rebuilding: only a restart of the server can help.
        if worker.failed:
            return JSONResponse({"status": "engine down", "failed": worker.failed}, status_code=503)
        return {"status": "alive"}

    @router.get("/readyz")
    async def readyz():
        engine = worker.engine
        # Open to anyone: the model by its id, never its path on this machine.
        body = {"ready": worker.ready, "rebuilds": worker.rebuilds, "queue_depth": worker.depth,
                "engine": public_model(engine) if engine else None, "failed": worker.failed,
                "engine_restarts": worker.restarts, "last_engine_exit": worker.last_exit,
                "crash_loop_delay_s": worker.crash_loop_delay_s}
        return JSONResponse(body, status_code=200 if worker.ready else 503)

    @router.get("/metrics", dependencies=[Depends(access.require("metrics"))])
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/adapters")
    async def list_adapters(request: Request, principal=Depends(access.require("generate", "prefetch"))):
        """The catalog, and the cached adapters this caller fetched (every one for admin). Cache
        counters are the whole server's traffic: admin only."""
        store = service.store
        admin = principal.allows("admin")
        return {"slots": list(config.slots), "catalog": catalog_listing(store),
                "cached": access.cached(principal, store), "stats": store.stats() if store and admin else None}

    @router.post("/v1/adapters/prefetch", status_code=202)
    async def prefetch(body: PrefetchRequest, request: Request, principal=Depends(access.require("prefetch"))):
        store = service.store
        service.check_sources(principal, body.refs)
        if store is None:
            raise InvalidRequest("this server has no adapter store")
        for ref in body.refs:
            parse_reference(ref, catalog_names=store.catalog)  # malformed references fail now, not later
        await service.prefetch(store, body.refs, principal, access.client_of(request))
        return {"accepted": [redact_reference(ref) for ref in body.refs]}  # a presigned URL's signature stays out

    if config.enable_fault_injection:
        @router.post("/admin/fault", dependencies=[Depends(access.require("admin"))])
        async def inject_fault():
            """Test hook (off by default): corrupt one base weight so the next request hits an engine fault."""
            worker.inject_fault()
            return {"armed": True}

    return router
