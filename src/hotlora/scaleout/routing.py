"""Which deployment a request goes to, and which identity adapter it carries (the affinity key).

Pure functions over the raw request (method, path, query, headers, body), no Ray: testable without
a cluster. The request schemas and the error messages are the HTTP server's own; importing this
module imports neither torch, FastAPI nor prometheus-client (tests/unit/test_server_errors.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping

from pydantic import ValidationError

from hotlora.errors import InvalidRequest, UnknownModel
from hotlora.families.recognize import base_model_compatible
from hotlora.server.errors import validation_error
from hotlora.server.schemas import GenerateRequest, OpenAIImagesRequest, prefers_async

MODEL_HEADER = "x-hotlora-model"  # names the model when neither the path nor the body does
REPLICA_HEADER = "x-hotlora-replica"  # which replica answered (its Serve replica id)
ATTEMPTS_HEADER = "x-hotlora-attempts"  # how many replicas the ingress tried
HF_MODEL_PREFIX = "/models/"
# /v1/generate forbids unknown fields, so the ingress-only `model` field is taken out before forwarding;
# the OpenAI API has a `model` field of its own and keeps it.
STRIP_MODEL_FIELD = {"/v1/generate"}
SCHEMAS = {"/v1/generate": GenerateRequest, "/v1/images/generations": OpenAIImagesRequest}
JOB_PATHS = ("/v1/jobs", "/v1/videos")  # a job's resources, and OpenAI's videos (each video a job)


class JobsNotRouted(InvalidRequest):
    """A job asked of the Ray ingress. Each replica keeps its own jobs (its ``jobs_dir``), and Serve
    routes a poll to any replica of the model, which would answer 404 for a job another one holds:
    refused at the edge instead, before any job exists."""


@dataclass(frozen=True)
class Route:
    deployment: str
    identity: str | None  # the identity adapter's reference; None: no affinity, any replica
    body: bytes  # what the replica receives
    # The path the replica receives: the request's, except the inference API's /models/{id} naming a
    # served model by a name only the ingress knows (a deployment name, a [ray] alias), sent as "/":
    # the replica would take an id its model does not answer to for a Hub LoRA repository.
    path: str = ""


def route(method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str], body: bytes,
          table: Mapping[str, str], default: str, identity_slot: Mapping[str, str],
          form: Mapping | None = None, hub_base_model: Callable[[str], str | None] | None = None) -> Route:
    """Pick the deployment (path ``/models/{id}``, body ``model``, header, query ``model``, else the
    default) and read the identity adapter. ``form``: a multipart body's text fields, nested as the
    server nests them (``schemas.place``; the OpenAI edits route, as the openai client sends it),
    read like a JSON body's. ``hub_base_model``: a Hub repository's declared base model (blocking
    I/O: call ``route`` off the event loop), by which ``/models/{id}`` naming a LoRA repository is
    routed. Raises RequestError for what no replica could serve."""
    _refuse_jobs(method, path, headers)
    data = _json_body(path, headers, body) if method == "POST" and form is None else None
    model_id = _model_id(path, query, headers, data if form is None else form)
    path_adapter = None
    if model_id is None:
        deployment = default
    elif model_id in table:
        deployment = table[model_id]
    elif path.startswith(HF_MODEL_PREFIX) and hub_base_model is not None:
        deployment, path_adapter = _hub_adapter_route(model_id, table, default, hub_base_model), f"hf://{model_id}"
    else:
        raise UnknownModel(f"no model {model_id!r} is served here; models: {', '.join(sorted(table))}")
    if data is not None and path in STRIP_MODEL_FIELD and "model" in data:
        del data["model"]
        body = json.dumps(data).encode()
    if data is not None and path in SCHEMAS:
        _validate(SCHEMAS[path], data)
    slot = identity_slot[deployment]
    forwarded = "/" if path.startswith(HF_MODEL_PREFIX) and path_adapter is None else path
    return Route(deployment, _identity(path, headers, data if form is None else form, slot) or path_adapter, body,
                 forwarded)


def _hub_adapter_route(model_id: str, table: Mapping[str, str], default: str,
                       hub_base_model: Callable[[str], str | None]) -> str:
    """``/models/{id}`` naming no deployment: a Hub LoRA repository, as the Hugging Face inference API
    serves one, goes to the deployment whose model its card's ``base_model`` names (the default among
    several). The replica then serves it as that adapter (``routes_inference.path_adapter``)."""
    base = hub_base_model(model_id)
    if base is None:
        raise UnknownModel(f"no model {model_id!r} is served here, and it is no Hub repository whose model card "
                           f"declares a base model; models: {', '.join(sorted(table))}")
    owners = {deployment for served, deployment in table.items() if base_model_compatible(base, (served,))}
    if len(owners) == 1 or default in owners:
        return owners.pop() if len(owners) == 1 else default
    raise UnknownModel(f"{model_id!r} is a LoRA for base model {base!r}, which "
                       + (f"several models serve ({', '.join(sorted(owners))}): post to /models/<one of them> "
                          f"with the header 'lora: hf://{model_id}'" if owners else "no model here serves")
                       + f"; models: {', '.join(sorted(table))}")


def _refuse_jobs(method: str, path: str, headers: Mapping[str, str]) -> None:
    prefer = headers.getlist("prefer") if hasattr(headers, "getlist") else [headers.get("prefer", "")]
    asked_async = method == "POST" and path.startswith("/v1/generate") and prefers_async(prefer)
    if asked_async or any(path == p or path.startswith(p + "/") for p in JOB_PATHS):
        raise JobsNotRouted(
            "jobs ('Prefer: respond-async', /v1/jobs, /v1/videos) are not served through the Ray ingress: each "
            "replica keeps its own, and a poll could reach another replica; send the request without "
            "'Prefer: respond-async' (a video model answers /v1/generate with the MP4), or serve this model "
            "with 'hotlora serve'")


def _json_body(path: str, headers: Mapping[str, str], body: bytes) -> dict | None:
    """The JSON object of a POST, or None for a raw prompt (the inference API takes plain text)."""
    json_expected = path in SCHEMAS or "json" in headers.get("content-type", "")
    if not json_expected and not body.lstrip().startswith(b"{"):
        return None
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        if not json_expected:
            return None  # a raw prompt that happens to start with "{": the replica decides
        raise InvalidRequest(f"invalid request: body is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidRequest("invalid request: body must be a JSON object")
    return data


def _model_id(path, query, headers, data) -> str | None:
    if path.startswith(HF_MODEL_PREFIX) and len(path) > len(HF_MODEL_PREFIX):
        return path[len(HF_MODEL_PREFIX):]
    if data is not None and isinstance(data.get("model"), str) and data["model"]:
        return data["model"]
    return headers.get(MODEL_HEADER) or query.get("model") or None


def _identity(path: str, headers: Mapping[str, str], data: dict | None, slot: str) -> str | None:
    """The identity adapter's reference as written in the request: the inference API's ``lora``
    header (it fills the identity slot), else ``adapters[slot]`` (``parameters.adapters`` there)."""
    if path == "/" or path.startswith(HF_MODEL_PREFIX):
        if headers.get("lora"):
            return headers["lora"]
        data = (data or {}).get("parameters")
    adapters = data.get("adapters") if isinstance(data, dict) else None
    spec = adapters.get(slot) if isinstance(adapters, dict) else None
    if isinstance(spec, dict):
        spec = spec.get("ref")
    return spec if isinstance(spec, str) and spec else None


def _validate(schema, data: dict) -> None:
    """The replica validates again (it is the same app as ``hotlora serve``); this answers a malformed
    request at the edge, without taking a slot on a model replica."""
    try:
        schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
