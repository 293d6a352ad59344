"""The Hugging Face inference API: ``POST /`` and ``POST /models/{model_id}``, a JSON body
``{"inputs": prompt, "parameters": {...}}`` or a raw prompt, a ``lora`` header for the
identity slot, the image's bytes back in the type the ``Accept`` header asks for. A
``model_id`` that is not the served model is a Hub LoRA repository, as the Hugging Face API
serves one (``path_adapter``).

The image-to-image task's body (``inputs``: the image as base64 or a URL, the prompt in
``parameters.prompt``, as ``InferenceClient.image_to_image`` sends it) is served as that task where
the engine serves one with an input image, and refused as that task where it does not: read as
text-to-image, the base64 text would be the prompt and the prompt dropped.

Only a body labelled JSON is read as JSON. A raw prompt is taken from a request no web page can
make a browser send without asking this server first (a CORS preflight it does not grant): one
with a ``lora`` or ``Authorization`` header, or a content type other than the three a page may
send freely (text/plain, the two form types) or none. huggingface_hub's ``InferenceClient`` sends
JSON; ``curl -d PROMPT -H 'lora: ...'`` a form type with a custom header: both are served.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from hotlora.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from hotlora.server.errors import validation_error
from hotlora.server.images import format_from_accept
from hotlora.server.outputs import media_types
from hotlora.server.schemas import MAX_REF_CHARS, HFImageRequest, HFRequest
from hotlora.server.service import Service, result_headers


EXPECTED = 'expected {"inputs": prompt, "parameters": {...}} or a raw prompt'
EXPECTED_IMAGE = 'expected {"inputs": base64 image or URL, "parameters": {"prompt": ..., ...}} (image-to-image)'
# Content types a page may POST anywhere without a preflight (the Fetch standard's CORS-safelisted
# ones); no content type at all is one too (a Blob body).
SIMPLE_TYPES = {"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}


def inference_routes(service: Service) -> APIRouter:
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/")
    async def inference_root(request: Request):
        return await inference_api(service, request)

    @router.post("/models/{model_id:path}")
    async def inference_model(model_id: str, request: Request):
        return await inference_api(service, request, model_id)

    return router


def path_adapter(service: Service, model_id: str | None, header: str | None) -> str | None:
    """The identity slot's reference: the ``lora`` header, or the repository ``/models/{model_id}``
    names when that is not the served model. The Hugging Face inference API serves a LoRA
    repository under its own id (its model card's ``base_model`` says which base it runs on), so such
    an id is the Hub adapter ``hf://{model_id}``: fetched, then checked like any adapter, a declared
    base model of another family refused with both named. A model not ready yet decides nothing
    (the request is answered 503)."""
    engine = service.worker.engine if service.worker.ready else None
    if model_id is None or engine is None or engine.front.answers_to(model_id):
        return header
    if len(model_id) > MAX_REF_CHARS:
        raise RequestTooLarge(f"the model id has {len(model_id)} characters; the limit is {MAX_REF_CHARS}")
    if header:
        raise InvalidRequest(f"the path names the Hub adapter {model_id!r} (this server serves another model) and "
                             f"the lora header names {header!r}: give the adapter one way")
    return f"hf://{model_id}"


async def inference_api(service: Service, request: Request, model_id: str | None = None) -> Response:
    raw = await request.body()
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    if not is_json:
        if raw.lstrip().startswith(b"{"):
            raise UnsupportedMediaType("a JSON body needs 'Content-Type: application/json'")
        if media in SIMPLE_TYPES and "lora" not in request.headers and "authorization" not in request.headers:
            raise UnsupportedMediaType(
                f"send {{\"inputs\": prompt}} as application/json, or a raw prompt with a 'lora' header, an API "
                f"key or a content type such as text/x-prompt: any web page can POST "
                f"{media or 'a body without a type'} here")
    if media.startswith("image/"):
        raise InvalidRequest("an image body alone is not a request: the image-to-image task sends "
                             '{"inputs": base64 image, "parameters": {"prompt": ...}} as application/json')
    body = hf_body(json_of(raw) if is_json else {"inputs": decoded_prompt(raw)})
    header = request.headers.get("lora")
    if header and len(header) > MAX_REF_CHARS:
        raise RequestTooLarge(f"the lora header has {len(header)} characters; the limit is {MAX_REF_CHARS}")
    header = path_adapter(service, model_id, header)
    # What the Accept header names among what the model makes; nothing named: the model's default.
    fmt = format_from_accept(request.headers.get("accept"), media_types(service.worker.engine))
    out = await service.generate(request, body.to_request(header, service.config.lora_header_slot), fmt=fmt)
    return Response(out.images[0], media_type=out.media_type, headers=result_headers(out))


def json_of(raw: bytes):
    """The body parsed once (an image task's holds megabytes of base64)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidRequest(f"{EXPECTED}: the JSON is nested too deeply") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise InvalidRequest(f"{EXPECTED}: the body is not JSON ({exc})") from None


def hf_body(data) -> HFRequest | HFImageRequest:
    """The text-to-image task's request or, with a ``parameters.prompt`` beside ``inputs``, the
    image-to-image task's."""
    parameters = data.get("parameters") if isinstance(data, dict) else None
    schema = HFImageRequest if isinstance(parameters, dict) and "prompt" in parameters else HFRequest
    try:
        return schema.model_validate(data)
    except ValidationError as exc:  # the same formatter as every other schema error
        expected = EXPECTED_IMAGE if schema is HFImageRequest else EXPECTED
        raise InvalidRequest(f"{expected}; {validation_error(exc.errors())}") from None


def decoded_prompt(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{EXPECTED}: {exc}") from None
