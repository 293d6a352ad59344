"""The Hugging Face inference API: ``POST /`` and ``POST /models/{model_id}``, a JSON body
``{"inputs": prompt, "parameters": {...}}`` or a raw prompt, a ``lora`` header for the
identity slot, the image's bytes back in the type the ``Accept`` header asks for.

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

from hotlora.engine.request import UnservedTask
from hotlora.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from hotlora.server.errors import validation_error
from hotlora.server.images import MEDIA_TYPES, format_from_accept
from hotlora.server.schemas import MAX_REF_CHARS, HFRequest
from hotlora.server.service import Service, result_headers


EXPECTED = 'expected {"inputs": prompt, "parameters": {...}} or a raw prompt'
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
        return await inference_api(service, request)

    return router


async def inference_api(service: Service, request: Request) -> Response:
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
    if is_json and b'"prompt"' in raw:
        refuse_image_to_image(raw)
    try:
        if is_json:
            body = HFRequest.model_validate_json(raw)
        else:
            body = HFRequest(inputs=raw.decode("utf-8"))
    except ValidationError as exc:  # the same formatter as every other schema error
        raise InvalidRequest(f"{EXPECTED}; {validation_error(exc.errors())}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"{EXPECTED}: {exc}") from None
    header = request.headers.get("lora")
    if header and len(header) > MAX_REF_CHARS:
        raise RequestTooLarge(f"the lora header has {len(header)} characters; the limit is {MAX_REF_CHARS}")
    fmt = format_from_accept(request.headers.get("accept"))
    out = await service.generate(request, body.to_request(header, service.config.lora_header_slot), fmt=fmt)
    return Response(out.images[0], media_type=MEDIA_TYPES[fmt], headers=result_headers(out))


def refuse_image_to_image(raw: bytes) -> None:
    """The Hugging Face image-to-image task's body (``inputs``: the image as base64, the prompt in
    ``parameters.prompt``, as ``InferenceClient.image_to_image`` sends it) is refused as the task it
    is: read as text-to-image, the base64 text would be the prompt and the prompt dropped."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: the schema's own error follows
        return
    parameters = data.get("parameters") if isinstance(data, dict) else None
    if isinstance(parameters, dict) and "prompt" in parameters:
        raise UnservedTask("this body is the Hugging Face image-to-image task (an input image, parameters.prompt); "
                           "this route serves text-to-image only: send {\"inputs\": prompt}", ("text-to-image",))
