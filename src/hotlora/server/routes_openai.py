"""The OpenAI images API: ``POST /v1/images/generations`` (``b64_json`` only; errors nest, see
``server/errors.py``)."""

from __future__ import annotations

import base64
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from hotlora.errors import InvalidRequest
from hotlora.server.schemas import OpenAIImagesRequest
from hotlora.server.service import Service, result_headers


def openai_routes(service: Service) -> APIRouter:
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/v1/images/generations")
    async def openai_images(body: OpenAIImagesRequest, request: Request):
        if body.response_format != "b64_json":
            raise InvalidRequest("only response_format=b64_json is supported (hotlora keeps no image URLs)")
        out = await service.generate(request, body.to_request(), fmt="png")
        data = [{"b64_json": base64.b64encode(b).decode()} for b in out.images]
        # `size` is in OpenAI's own answers (gpt-image-1); `snapped_from` is hotlora's, when size_policy
        # "nearest" served another size than the one asked for.
        answer = {"created": int(time.time()), "data": data, "size": out.size}
        if out.snapped_from:
            answer["snapped_from"] = out.snapped_from
        return JSONResponse(answer, headers=result_headers(out))

    return router
