"""The Hugging Face inference API: ``POST /`` and ``POST /models/{model_id}``, a JSON body
``{"inputs": prompt, "parameters": {...}}`` or a raw prompt, a ``lora`` header for the
identity slot, the image's bytes back in the type the ``Accept`` header asks for."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from hotlora.errors import InvalidRequest, RequestTooLarge
from hotlora.server.errors import validation_error
from hotlora.server.images import MEDIA_TYPES, format_from_accept
from hotlora.server.schemas import MAX_REF_CHARS, HFRequest, specs
from hotlora.server.service import Service, server_timing


EXPECTED = 'expected {"inputs": prompt, "parameters": {...}} or a raw prompt'


def inference_routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.post("/")
    async def inference_root(request: Request):
        return await inference_api(service, request)

    @router.post("/models/{model_id:path}")
    async def inference_model(model_id: str, request: Request):
        return await inference_api(service, request)

    return router


async def inference_api(service: Service, request: Request) -> Response:
    raw = await request.body()
    content_type = request.headers.get("content-type", "")
    try:
        if "json" in content_type or raw.lstrip().startswith(b"{"):
            body = HFRequest.model_validate_json(raw)
        else:
            body = HFRequest(inputs=raw.decode("utf-8"))
    except ValidationError as exc:  # the same formatter as every other schema error
        raise InvalidRequest(f"{EXPECTED}; {validation_error(exc.errors())}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"{EXPECTED}: {exc}") from None
    params = body.parameters
    adapters = specs(params.adapters)
    header = request.headers.get("lora")
    if header and len(header) > MAX_REF_CHARS:
        raise RequestTooLarge(f"the lora header has {len(header)} characters; the limit is {MAX_REF_CHARS}")
    if header:
        adapters[service.config.lora_header_slot] = {"ref": header, "scale": params.lora_scale}
    fmt = format_from_accept(request.headers.get("accept"))
    out = await service.generate(
        request, prompt=body.inputs, adapters=adapters, fmt=fmt, negative_prompt=params.negative_prompt,
        num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
        width=params.width, height=params.height, seed=params.seed,
    )
    return Response(out["images"][0], media_type=MEDIA_TYPES[fmt],
                    headers={"Server-Timing": server_timing(out["timings"])})
