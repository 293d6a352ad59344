"""The OpenAI images API: ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits``
(multipart: ``image`` one or several files, ``mask``, the other fields as form fields), answered
``b64_json`` only; errors nest, see ``server/errors.py``."""

from __future__ import annotations

import base64
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from hotlora.errors import InvalidRequest, UnsupportedMediaType
from hotlora.server.errors import validation_error
from hotlora.server.inputs import ImageInput
from hotlora.server.schemas import MAX_FORM_FIELDS, MAX_INPUT_IMAGES, OpenAIEditsRequest, OpenAIImagesRequest, place
from hotlora.server.service import Generated, Service, result_headers

IMAGE_FIELDS = ("image", "image[]")  # the openai client names a list of files "image[]"


def openai_routes(service: Service) -> APIRouter:
    router = APIRouter(dependencies=[Depends(service.access.require("generate"))])

    @router.post("/v1/images/generations")
    async def openai_images(body: OpenAIImagesRequest, request: Request):
        refuse_url_format(body.response_format)
        out = await service.generate(request, body.to_request(), fmt="png", kind="images")
        return openai_answer(out)

    @router.post("/v1/images/edits")
    async def openai_edits(request: Request):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "multipart/form-data":
            raise UnsupportedMediaType("POST /v1/images/edits takes multipart/form-data (image files, mask, prompt, ...)")
        # The body is already bounded (BodyLimit); these bound what it may be split into.
        form = await request.form(max_files=MAX_INPUT_IMAGES + 1, max_fields=MAX_FORM_FIELDS)
        try:
            fields, images, mask = await edit_form(form)
            try:
                body = OpenAIEditsRequest.model_validate(fields)
            except ValidationError as exc:
                raise InvalidRequest(validation_error(exc.errors())) from None
        finally:
            await form.close()
        refuse_url_format(body.response_format)
        out = await service.generate(request, body.to_request(images, mask), fmt="png", kind="images")
        return openai_answer(out)

    return router


def refuse_url_format(response_format: str) -> None:
    if response_format != "b64_json":
        raise InvalidRequest("only response_format=b64_json is supported (hotlora keeps no image URLs)")


def openai_answer(out: Generated) -> JSONResponse:
    data = [{"b64_json": base64.b64encode(b).decode()} for b in out.images]
    # `size` is in OpenAI's own answers (gpt-image-1); `snapped_from` is hotlora's, when size_policy
    # "nearest" served another size than the one asked for.
    answer = {"created": int(time.time()), "data": data, "size": out.size}
    if out.snapped_from:
        answer["snapped_from"] = out.snapped_from
    if out.input_notes:  # hotlora's too: what decoding did to the input images
        answer["input_notes"] = list(out.input_notes)
    if out.adapter_defaults:  # and the steps / guidance the adapters declared, where the request ran at them
        answer["adapter_defaults"] = out.adapter_defaults
    return JSONResponse(answer, headers=result_headers(out))


async def edit_form(form) -> tuple[dict, list[ImageInput], ImageInput | None]:
    """The edit form's text fields (bracketed keys nested, as the openai client flattens them; a
    field holding a JSON object read as one), its image files in order, and its mask."""
    fields: dict = {}
    images, mask = [], None
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            upload = ImageInput(data=await value.read(), content_type=value.content_type)
            if key in IMAGE_FIELDS:
                images.append(upload)
            elif key == "mask":
                if mask is not None:
                    raise InvalidRequest("the form has more than one mask file")
                mask = upload
            else:
                raise InvalidRequest(f"form field {key!r} is a file; files are taken as image, image[] or mask")
            continue
        if key in IMAGE_FIELDS or key == "mask":
            raise InvalidRequest(f"form field {key!r} must be a file (an image upload), not text")
        place(fields, key, value)
    return fields, images, mask
