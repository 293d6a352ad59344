"""The FastAPI application: three APIs over one worker, errors mapped once, metrics."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from hotlora.adapters.references import parse_reference
from hotlora.adapters.resolver import split_spec
from hotlora.config import ServerConfig
from hotlora.engine.worker import Job, NotAccepting, Overloaded, Worker
from hotlora.errors import HotloraError, InvalidRequest, RequestError, RequestTooLarge
from hotlora.server.images import MEDIA_TYPES, encode, format_from_accept
from hotlora.server.limits import BodyLimit
from hotlora.server.metrics import Metrics
from hotlora.server.schemas import (
    MAX_REF_CHARS, GenerateRequest, HFRequest, OpenAIImagesRequest, PrefetchRequest, specs,
)

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a waiting request checks that its client is still there
PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


class Service:
    """What the routes share: the worker, the resolver, admission control, metrics."""

    def __init__(self, worker: Worker, config: ServerConfig):
        self.worker = worker
        self.config = config
        self.metrics = Metrics(worker)
        # Requests being resolved count against the bound too: a flood of cold adapters must
        # not pile up unbounded fetches in front of the queue.
        self.max_pending = 2 * config.max_queue
        self._pending = 0
        self._lock = threading.Lock()
        self._prefetches: set[asyncio.Task] = set()

    def admit(self) -> None:
        if not self.worker.ready:
            raise NotAccepting("the engine is not ready (starting, rebuilding or shutting down)")
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"too many requests in flight ({self._pending})", retry_after_s=5)
            self._pending += 1

    def release(self) -> None:
        with self._lock:
            self._pending -= 1

    async def generate(self, request: Request, *, prompt: str, adapters: dict, fmt: str, num_images: int = 1,
                       timeout_s: float | None = None, progress=None, **params) -> dict:
        """Validate, resolve, queue, wait (watching the client), encode. Returns images and timings."""
        began = time.monotonic()
        self.admit()
        try:
            engine, resolver = self.worker.engine, self.worker.resolver
            if engine is None or resolver is None:
                raise NotAccepting("the engine is rebuilding")
            engine.check_request(prompt, num_images, params.get("num_inference_steps"), params.get("guidance_scale"),
                                 params.get("height"), params.get("width"), params.get("seed") or 0, "pil",
                                 params.get("negative_prompt"))
            fetch_began = time.monotonic()
            resolved = await self.resolve(resolver, adapters)
            fetch_ms = (time.monotonic() - fetch_began) * 1000
            timeout = timeout_s or self.config.request_timeout_s
            call = {k: v for k, v in params.items() if v is not None}
            call.setdefault("seed", 0)
            job = Job(prompt=prompt, params={**call, "num_images": num_images, "output_type": "pil", "progress": progress},
                      adapters=resolved, deadline=time.monotonic() + timeout)
            future = asyncio.wrap_future(self.worker.submit(job))
            while True:
                done, _ = await asyncio.wait({future}, timeout=POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancelled.set()
            result = future.result()
        finally:
            self.release()
        encode_began = time.monotonic()
        images = await asyncio.to_thread(lambda: [encode(img, fmt) for img in result.images])
        timings = {
            "queue_ms": round((job.started - job.enqueued) * 1000, 3),
            "fetch_ms": round(fetch_ms, 3),
            "swap_ms": round(result.timings.swap_ms, 3),
            "generate_ms": round(sum(result.timings.generate_ms), 3),
            "encode_ms": round((time.monotonic() - encode_began) * 1000, 3),
        }
        timings["total_ms"] = round((time.monotonic() - began) * 1000, 3)
        self.metrics.observe(timings)
        return {"images": images, "seeds": result.seeds, "adapters": result.adapters, "timings": timings,
                "recompiles": result.recompiles}


    async def resolve(self, resolver, adapters: dict) -> dict:
        """Fetch every slot's adapter concurrently on the store's own fetch pool (a RAM-cached
        adapter returns at once, never behind someone's slow download), then validate and pack."""
        resolver.check_slots(adapters)
        store = resolver.store

        async def fetch(slot, spec):
            source, scale = split_spec(spec, slot)
            if scale is None and store is not None and isinstance(source, str):
                scale = store.default_scale(source)
            scale = 1.0 if scale is None else scale
            resolver.check_scale(slot, scale)  # before any download
            if isinstance(source, str) and store is not None:
                source = await store.aget(source)
            return slot, (source, scale)

        fetched = await asyncio.gather(*(fetch(slot, spec) for slot, spec in adapters.items() if spec is not None))
        return await asyncio.to_thread(resolver.resolve, dict(fetched))

    async def prefetch(self, store, refs: list[str]) -> None:
        """Fetch in the background under an admission bound: 429 when too many fetches are running."""
        running = store.fetches_in_flight
        if running + len(refs) > self.config.max_prefetch_inflight:
            raise Overloaded(f"{running} adapter fetches are running; a prefetch may add up to "
                             f"{self.config.max_prefetch_inflight - running} now", retry_after_s=5)

        async def fetch(ref):
            try:
                await store.aget(ref)
            except HotloraError as exc:
                log.warning("prefetch of %s failed: %s", ref, exc)

        for ref in refs:
            task = asyncio.get_running_loop().create_task(fetch(ref))
            self._prefetches.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._prefetches.discard)


def server_timing(timings: dict) -> str:
    return ", ".join(f"{k.removesuffix('_ms')};dur={v}" for k, v in timings.items())


def error_body(exc: Exception, openai: bool = False) -> dict:
    message = str(exc)
    kind = type(exc).__name__
    return {"error": {"message": message, "type": kind}} if openai else {"error": message, "type": kind}


def error_response(exc: Exception, openai: bool = False) -> JSONResponse:
    status = getattr(exc, "status_code", 500) if isinstance(exc, HotloraError) else 500
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return JSONResponse(error_body(exc, openai), status_code=status, headers=headers)


def outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "server_error"


def create_app(worker: Worker, config: ServerConfig, *, start_worker: bool = True) -> FastAPI:
    service = Service(worker, config)
    worker.on_event = service.metrics.on_event

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_worker:
            # Listen at once (healthz answers, readyz says "not yet") while the engine warms up.
            app.state.starting = asyncio.create_task(asyncio.to_thread(worker.start))
        yield
        log.info("shutting down: draining the queue")
        drained = await asyncio.to_thread(worker.stop, config.drain_timeout_s)
        if worker.store is not None:
            worker.store.close()  # the fetch pool's threads
        log.info("shutdown %s", "complete, queue drained" if drained else "timed out; waiting requests were answered 503")

    app = FastAPI(title="hotlora", version="0.1.0", lifespan=lifespan)
    app.state.service = service

    class CountRequests:
        """Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from the endpoints)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or scope["method"] != "POST":
                return await self.inner(scope, receive, send)
            status = {}

            async def watch(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                await send(message)

            try:
                await self.inner(scope, receive, watch)
            finally:
                route = scope.get("route")
                service.metrics.requests.labels(route.path if route else "unmatched",
                                                outcome(status.get("code", 500))).inc()

    app.add_middleware(BodyLimit, limit=config.max_body_bytes, refuse=error_response)
    app.add_middleware(CountRequests)

    @app.exception_handler(HotloraError)
    async def hotlora_error(request: Request, exc: HotloraError):
        if not isinstance(exc, RequestError):
            log.error("%s %s: %s", request.method, request.url.path, exc)
        return error_response(exc, openai=request.url.path.startswith("/v1/images"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return error_response(InvalidRequest(f"invalid request: {problems}"), request.url.path.startswith("/v1/images"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)

    # ---------------------------------------------------------------- health

    @app.get("/healthz")
    async def healthz():
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz():
        engine = worker.engine
        body = {"ready": worker.ready, "rebuilds": worker.rebuilds, "queue_depth": worker.depth,
                "engine": engine.describe() if engine else None, "failed": worker.failed}
        return JSONResponse(body, status_code=200 if worker.ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- the richer JSON API

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        payload = await generate_json(body, request)
        return JSONResponse(payload, headers={"Server-Timing": server_timing(payload["timings"])})

    @app.post("/v1/generate/stream")
    async def generate_stream(body: GenerateRequest, request: Request):
        """Server-Sent Events: ``progress`` {step, total} per denoising step, then ``result`` (the
        /v1/generate body) or ``error`` {error, type, status}. Schema errors are plain 422s."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def progress(done: int, total: int) -> None:  # called on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, ("progress", {"step": done, "total": total}))

        async def run():
            try:
                out = await generate_json(body, request, progress=progress)
                await events.put(("result", out))
            except HotloraError as exc:
                await events.put(("error", {**error_body(exc), "status": exc.status_code}))
            except Exception as exc:  # the stream must end with an answer, whatever happened
                log.exception("stream generation failed")
                await events.put(("error", {"error": f"internal error: {type(exc).__name__}", "status": 500}))
            finally:
                await events.put(None)

        task = asyncio.create_task(run())

        async def stream():
            yield "event: accepted\ndata: {}\n\n"
            while (item := await events.get()) is not None:
                name, data = item
                yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
            await task

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def generate_json(body: GenerateRequest, request: Request, progress=None) -> dict:
        out = await service.generate(
            request, prompt=body.prompt, adapters=specs(body.adapters), fmt=body.output_format,
            num_images=body.num_images, timeout_s=body.timeout_s, negative_prompt=body.negative_prompt,
            num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale, width=body.width,
            height=body.height, seed=body.seed, progress=progress,
        )
        return {**out, "images": [base64.b64encode(b).decode() for b in out["images"]], "format": body.output_format}

    # ---------------------------------------------------------------- playground

    @app.get("/")
    async def root(request: Request):
        """A browser gets the playground; anything else a short JSON pointer (POST / is the inference API)."""
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(PLAYGROUND.read_text())
        return {"name": "hotlora", "playground": "open / in a browser", "docs": "/docs"}

    # ---------------------------------------------------------------- Hugging Face inference API

    async def inference_api(request: Request) -> Response:
        raw = await request.body()
        content_type = request.headers.get("content-type", "")
        try:
            if "json" in content_type or raw.lstrip().startswith(b"{"):
                body = HFRequest.model_validate_json(raw)
            else:
                body = HFRequest(inputs=raw.decode("utf-8"))
        except (ValidationError, UnicodeDecodeError, ValueError) as exc:
            raise InvalidRequest(f"expected {{\"inputs\": prompt, \"parameters\": {{...}}}} or a raw prompt: {exc}") from None
        params = body.parameters
        adapters = specs(params.adapters)
        header = request.headers.get("lora")
        if header and len(header) > MAX_REF_CHARS:
            raise RequestTooLarge(f"the lora header has {len(header)} characters; the limit is {MAX_REF_CHARS}")
        if header:
            adapters[config.lora_header_slot] = {"ref": header, "scale": params.lora_scale}
        fmt = format_from_accept(request.headers.get("accept"))
        out = await service.generate(
            request, prompt=body.inputs, adapters=adapters, fmt=fmt, negative_prompt=params.negative_prompt,
            num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
            width=params.width, height=params.height, seed=params.seed,
        )
        return Response(out["images"][0], media_type=MEDIA_TYPES[fmt],
                        headers={"Server-Timing": server_timing(out["timings"])})

    @app.post("/")
    async def inference_root(request: Request):
        return await inference_api(request)

    @app.post("/models/{model_id:path}")
    async def inference_model(model_id: str, request: Request):
        return await inference_api(request)

    # ---------------------------------------------------------------- OpenAI images API

    @app.post("/v1/images/generations")
    async def openai_images(body: OpenAIImagesRequest, request: Request):
        if body.response_format != "b64_json":
            raise InvalidRequest("only response_format=b64_json is supported (hotlora keeps no image URLs)")
        width, height = body.dimensions()
        out = await service.generate(request, prompt=body.prompt, adapters=specs(body.adapters), fmt="png",
                                     num_images=body.n, width=width, height=height, seed=body.seed)
        data = [{"b64_json": base64.b64encode(b).decode()} for b in out["images"]]
        return JSONResponse({"created": int(time.time()), "data": data},
                            headers={"Server-Timing": server_timing(out["timings"])})

    # ---------------------------------------------------------------- adapters

    @app.get("/v1/adapters")
    async def list_adapters():
        store = worker.store
        catalog = [{"name": e.name, "ref": e.ref, "scale": e.scale, "pin": e.pin}
                   for e in (store.catalog.values() if store else [])]
        cached = [{"name": a.name, "sha256": a.sha256, "layout": a.layout, "rank": a.rank, "bytes": a.nbytes}
                  for a in (store.ram.values() if store else [])]
        return {"slots": list(config.slots), "catalog": catalog, "cached": cached,
                "stats": store.stats() if store else None}

    @app.post("/v1/adapters/prefetch", status_code=202)
    async def prefetch(body: PrefetchRequest):
        store = worker.store
        if store is None:
            raise InvalidRequest("this server has no adapter store")
        for ref in body.refs:
            parse_reference(ref, catalog_names=store.catalog)  # malformed references fail now, not later
        await service.prefetch(store, body.refs)
        return {"accepted": body.refs}

    if config.enable_fault_injection:
        @app.post("/admin/fault")
        async def inject_fault():
            """Test hook (off by default): corrupt one base weight so the next request hits an engine fault."""
            worker.inject_fault()
            return {"armed": True}

    return app

