"""The HTTP entry of the Ray application: route by base model, forward with the identity as affinity key.

Serve's HTTP proxy hands every request to this deployment. It answers what needs no model
(liveness, the model list, requests no model could serve) and forwards the rest, unparsed beyond
routing, to one replica of the chosen model's deployment through a Serve handle with
``multiplexed_model_id`` set to the identity adapter's reference: Serve then prefers a replica
that already holds it.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hotlora.adapters.store.hub import HubBaseModels, HubSource
from hotlora.adapters.store.references import reference_id
from hotlora.scaleout.config import RayServeConfig
from hotlora.scaleout.replica import ForwardedReply, ForwardedRequest
from hotlora.scaleout.routing import ATTEMPTS_HEADER, Route, route
from hotlora.errors import HotloraError, InvalidRequest, ModelsOverloaded, ReplicasUnavailable, RequestTooLarge
from hotlora.server.errors import error_reply, is_openai
from hotlora.server.middleware import body_limits, too_large
from hotlora.server.schemas import MAX_FORM_FIELDS, MAX_INPUT_IMAGES, place

log = logging.getLogger(__name__)
# A replica process that died (killed, OOM, node lost) under a request, or one Serve already
# knows to be gone. Serve's router does not resend such a request; the ingress does (below).
REPLICA_GONE = (RayActorError, ReplicaUnavailableError)


@serve.deployment
class Ingress:
    def __init__(self, models: dict, config: RayServeConfig):
        self.handles = models  # deployment name -> DeploymentHandle (Serve resolves the bound apps)
        self.config = config
        self.table = config.routing_table()
        self.identity_slot = {name: spec.server.lora_header_slot for name, spec in config.models.items()}
        # Each model's server caps bodies per path; here, before the model is known, the largest of them.
        self.body_limits = [body_limits(spec.server) for spec in config.models.values()]
        # /models/{Hub LoRA repository}: routed by its card's base_model, read with the default model's store settings.
        store = config.models[config.default_model].store
        self.hub_base_model = HubBaseModels(HubSource(store, store.hf_cache_dir))

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/healthz":
            return JSONResponse({"status": "alive"})
        if request.method == "GET" and path == "/v1/models":
            return JSONResponse({"default": self.config.default_model, "routes": self.table})
        try:
            body = await _bounded_body(request, max(limit_of(path) for limit_of in self.body_limits))
            form = await _form_fields(request, body)
            # Off the event loop: a /models/{id} naming no model reads that Hub repository's card.
            chosen = await asyncio.to_thread(route, request.method, path, request.query_params, request.headers, body,
                                             self.table, self.config.default_model, self.identity_slot, form=form,
                                             hub_base_model=self.hub_base_model)
            forwarded = ForwardedRequest(request.method, chosen.path, request.url.query, list(request.headers.items()),
                                         chosen.body, identity=chosen.identity)
            reply, attempts = await self._forward(chosen, forwarded)
        except HotloraError as exc:  # answered in the shape and status ``hotlora serve`` gives
            reply = error_reply(exc, openai=is_openai(path))
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        headers = dict(reply.headers)
        headers[ATTEMPTS_HEADER] = str(attempts)
        return Response(reply.body, status_code=reply.status, headers=headers)

    async def _forward(self, chosen: Route, forwarded: ForwardedRequest) -> tuple[ForwardedReply, int]:
        """Send to the model's deployment; resend, boundedly, when the replica died under the request.

        Written by hand because Serve does not retry a request whose replica died. Resending is safe:
        a request is deterministic (its seed defaults to 0) and a dead replica returned nothing.
        """
        handle = self.handles[chosen.deployment]
        if chosen.identity:
            handle = handle.options(multiplexed_model_id=reference_id(chosen.identity))
        config = self.config
        problems = []
        for attempt in range(1, config.max_attempts + 1):
            response = handle.handle.remote(forwarded)
            try:
                return await asyncio.wait_for(_result(response), config.request_timeout_s), attempt
            except asyncio.TimeoutError:
                response.cancel()
                raise ReplicasUnavailable(f"no answer from model {chosen.deployment!r} within "
                                          f"{config.request_timeout_s:g}s") from None
            except BackPressureError as exc:
                raise ModelsOverloaded(f"model {chosen.deployment!r} is at capacity: {exc}") from None
            except REPLICA_GONE as exc:
                problems.append(f"try {attempt}: {type(exc).__name__}")
                log.warning("replica of %s lost a request (try %d/%d): %s", chosen.deployment, attempt,
                            config.max_attempts, exc)
                if attempt < config.max_attempts:
                    await asyncio.sleep(config.retry_backoff_s * attempt)
        raise ReplicasUnavailable(f"model {chosen.deployment!r}: the replica died under the request "
                                  f"{config.max_attempts} times ({'; '.join(problems)})")


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused (RequestTooLarge, 413) past ``limit`` bytes: by its declared length before a
    byte is read, else as soon as what arrived passes it. The replica caps it again (BodyLimit)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(too_large(int(declared), limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(too_large(size, limit, at_least=True))
        chunks.append(chunk)
    return b"".join(chunks)


async def _form_fields(request: Request, body: bytes) -> dict | None:
    """A multipart POST's text fields nested (``adapters[identity][ref]``), for the affinity key; None
    for any other body. Files are not kept; a form the server would refuse is the replica's to answer
    (its fields are then read as far as they go)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method != "POST" or media != "multipart/form-data":
        return None

    async def replay():  # the body was read already: the form parser reads it again from here
        return {"type": "http.request", "body": body, "more_body": False}

    fields: dict = {}
    try:
        form = await Request(request.scope, replay).form(max_files=MAX_INPUT_IMAGES + 1, max_fields=MAX_FORM_FIELDS)
    except Exception:  # noqa: BLE001 - starlette's parse errors vary; the replica parses and answers again
        return fields
    try:
        for key, value in form.multi_items():
            if isinstance(value, str):
                try:
                    place(fields, key, value)
                except InvalidRequest:
                    continue
    finally:
        await form.close()
    return fields


async def _result(response):
    return await response
