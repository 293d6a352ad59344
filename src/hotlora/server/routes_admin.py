"""Operating the server: liveness, readiness, Prometheus metrics, the adapter store (list,
prefetch) and, only when enabled, the fault-injection test hook."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hotlora.adapters.references import parse_reference
from hotlora.errors import InvalidRequest
from hotlora.server.schemas import PrefetchRequest
from hotlora.server.service import Service


def admin_routes(service: Service) -> APIRouter:
    router = APIRouter()
    worker, config = service.worker, service.config

    @router.get("/healthz")
    async def healthz():
        return {"status": "alive"}

    @router.get("/readyz")
    async def readyz():
        engine = worker.engine
        body = {"ready": worker.ready, "rebuilds": worker.rebuilds, "queue_depth": worker.depth,
                "engine": engine.describe() if engine else None, "failed": worker.failed}
        return JSONResponse(body, status_code=200 if worker.ready else 503)

    @router.get("/metrics")
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/adapters")
    async def list_adapters():
        store = worker.store
        catalog = [{"name": e.name, "ref": e.ref, "scale": e.scale, "pin": e.pin}
                   for e in (store.catalog.values() if store else [])]
        cached = [{"name": a.name, "sha256": a.sha256, "layout": a.layout, "rank": a.rank, "bytes": a.nbytes}
                  for a in (store.ram.values() if store else [])]
        return {"slots": list(config.slots), "catalog": catalog, "cached": cached,
                "stats": store.stats() if store else None}

    @router.post("/v1/adapters/prefetch", status_code=202)
    async def prefetch(body: PrefetchRequest):
        store = worker.store
        if store is None:
            raise InvalidRequest("this server has no adapter store")
        for ref in body.refs:
            parse_reference(ref, catalog_names=store.catalog)  # malformed references fail now, not later
        await service.prefetch(store, body.refs)
        return {"accepted": body.refs}

    if config.enable_fault_injection:
        @router.post("/admin/fault")
        async def inject_fault():
            """Test hook (off by default): corrupt one base weight so the next request hits an engine fault."""
            worker.inject_fault()
            return {"armed": True}

    return router
