"""The FastAPI application: three APIs over one worker, errors mapped once, metrics.

Where things are: ``run`` (the serving object: worker and adapter store), ``service`` (admission,
fetch, queue, wait, encode; prefetch), ``errors`` (error -> status, body, headers; no web
framework), ``handlers`` (the app's exception handlers), ``middleware`` (request counting, body
limits, Host and Origin checks, CORS), ``auth`` (API keys) and ``access`` (the key check per route,
each caller's view of the cache), one ``routes_*`` module per API family.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from hotlora import __version__
from hotlora.settings import ServerConfig
from hotlora.engine.worker import Worker
from hotlora.server.handlers import error_response, install_error_handlers
from hotlora.server.jobs import Jobs, JobStore
from hotlora.server.logs import redact_url_logs
from hotlora.server.middleware import BodyLimit, CountRequests, body_limits, browser_guards
from hotlora.server.routes_admin import admin_routes
from hotlora.server.routes_inference import inference_routes
from hotlora.server.routes_jobs import jobs_routes
from hotlora.server.routes_json import json_routes
from hotlora.server.routes_openai import openai_routes
from hotlora.server.routes_playground import playground_routes
from hotlora.server.routes_videos import videos_routes
from hotlora.server.run import Serving
from hotlora.server.service import Service
from hotlora.server.tracing import Tracing
from hotlora.server.webhooks import Webhooks

log = logging.getLogger(__name__)


def create_app(serving: Serving, config: ServerConfig, *, start_worker: bool = True,
               tracing: Tracing | None = None) -> FastAPI:
    """The app over ``serving`` (its worker and adapter store); with ``start_worker`` the lifespan
    builds and warms its engine (in the background: /healthz answers at once, /readyz once warm) and
    drains it at shutdown. ``tracing``: where spans go (default: ``config.otlp_endpoint``'s
    collector, or nowhere)."""
    service = Service(serving, config, tracing)  # reads the API keys: raises AuthConfigError before anything starts
    # Unfinished jobs a previous server left are failed now; webhooks go where client URLs may.
    jobs = Jobs(service, JobStore(config.jobs_dir, config.jobs_max_bytes),
                Webhooks.of(config, service.image_policy))
    redact_url_logs()  # httpx logs every adapter download's URL, presigned signature included
    serving.worker.on_event = service.metrics.on_event
    app = FastAPI(title="hotlora", version=__version__, lifespan=_lifespan(service, jobs, start_worker))
    app.state.service = service
    app.state.jobs = jobs
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, refuse=error_response, limit_of=body_limits(config))
    browser_guards(app, config, service.access.enabled, refuse=error_response)  # Host, CORS, Origin
    app.add_middleware(CountRequests, metrics=service.metrics)  # added last: outermost, sees every answer
    install_error_handlers(app)
    for router in (admin_routes(service), json_routes(service, jobs), jobs_routes(jobs), playground_routes(),
                   inference_routes(service), openai_routes(service), videos_routes(jobs)):
        app.include_router(router)
    return app


def _lifespan(service: Service, jobs: Jobs, start_worker: bool):
    worker, config = service.worker, service.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_worker:
            # Listen at once (healthz answers, readyz says "not yet") while the engine warms up.
            app.state.starting = asyncio.create_task(asyncio.to_thread(worker.start))
            app.state.starting.add_done_callback(lambda task: _report_start(task, worker, app))
        yield
        log.info("shutting down: draining the queue")
        drained = await asyncio.to_thread(worker.stop, config.drain_timeout_s)
        await jobs.close()  # webhooks still retrying stop; unfinished jobs read as failed at the next start
        if service.store is not None:
            service.store.close()  # the fetch pool's threads
        service.tracing.shutdown()  # the spans still buffered go out
        log.info("shutdown %s", "complete, queue drained" if drained else "timed out; waiting requests were answered 503")

    return lifespan


def _report_start(task: asyncio.Task, worker: Worker, app: FastAPI) -> None:
    """A start-up that failed is said at once (the log, and /readyz's ``failed``), not left as a
    task exception nobody retrieves while /readyz answers "not yet" forever; then
    ``app.state.on_start_failed`` (``hotlora serve`` sets it) ends the server, so that it exits
    non-zero and an orchestrator shows a failed container instead of one that never gets ready."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    log.error("the engine failed to start: %s: %s", type(exc).__name__, exc, exc_info=exc)
    worker.failed = f"start-up failed: {type(exc).__name__}: {exc}"
    on_start_failed = getattr(app.state, "on_start_failed", None)
    if on_start_failed is not None:
        on_start_failed()
