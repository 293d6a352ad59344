"""The OpenAI edits form as the openai client writes it (``image[]`` for several files, ``extra_body``
flattened into bracketed keys) read back into the edit request's fields, and the input-image texts
of the JSON bodies (base64, data URLs, URLs) told apart, without a server."""

import asyncio
import base64
import io

import pytest
from starlette.datastructures import FormData, Headers, UploadFile

from hotlora.errors import InvalidRequest, RequestTooLarge
from hotlora.server.inputs import ImageInput, _base64_image
from hotlora.server.routes_openai import edit_form
from hotlora.server.schemas import OpenAIEditsRequest


def upload(name: str, data: bytes, content_type: str = "image/png") -> UploadFile:
    return UploadFile(io.BytesIO(data), filename=name, headers=Headers({"content-type": content_type}))


def read(items):
    return asyncio.run(edit_form(FormData(items)))


def test_several_images_a_mask_and_nested_extensions_are_read_as_the_client_sent_them():
    fields, images, mask = read([
        ("prompt", "make it winter"), ("n", "2"), ("image[]", upload("a.png", b"A")),
        ("image[]", upload("b.webp", b"B", "image/webp")), ("mask", upload("m.png", b"M")),
        ("adapters[identity][ref]", "user-1"), ("adapters[identity][scale]", "0.8"), ("adapters[style]", "ink"),
        ("strength", "0.5")])
    assert [i.data for i in images] == [b"A", b"B"] and images[1].content_type == "image/webp"
    assert mask.data == b"M"
    body = OpenAIEditsRequest.model_validate(fields)
    request = body.to_request(images, mask)
    assert request.num_images == 2 and request.strength == 0.5 and request.task is None  # implied by the engine
    assert request.adapters["identity"].ref == "user-1" and request.adapters["identity"].scale == 0.8
    assert request.adapters["style"].ref == "ink"
    # A field holding a JSON object is read as one (curl -F 'adapters={"style": "ink"}').
    fields, _, _ = read([("prompt", "x"), ("adapters", '{"style": "ink"}'), ("image", upload("a.png", b"A"))])
    assert OpenAIEditsRequest.model_validate(fields).to_request([], None).adapters["style"].ref == "ink"


@pytest.mark.parametrize("items, message", [
    ([("image", "aGk=")], "must be a file"),
    ([("other", upload("x.png", b"x"))], "files are taken as image"),
    ([("mask", upload("a.png", b"a")), ("mask", upload("b.png", b"b"))], "more than one mask"),
    ([("adapters[style]", "a"), ("adapters[style]", "b")], "given twice"),
    ([("adapters", "x"), ("adapters[style]", "b")], "conflicts"),
    ([("tags[]", "a")], "lists are taken for image files only"),
    ([("a]b", "x")], "malformed"),
])
def test_a_form_the_edit_cannot_be_read_from_is_a_422_naming_the_field(items, message):
    with pytest.raises(InvalidRequest, match=message):
        read(items)


def test_input_image_texts_base64_data_urls_and_urls():
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8
    assert _base64_image(base64.b64encode(png).decode(), "image", 1000) == (png, None)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert _base64_image(data_url, "image", 1000) == (png, "image/png")
    assert ImageInput(text="HTTPS://example.com/a.png").url and ImageInput(text=data_url).url is None
    with pytest.raises(InvalidRequest, match="data URL must be base64"):
        _base64_image("data:image/png,%89PNG", "image", 1000)
    with pytest.raises(InvalidRequest, match="valid base64"):
        _base64_image("not base64!", "image", 1000)
    with pytest.raises(RequestTooLarge, match="input_image_max_bytes"):  # known from the length, nothing decoded
        _base64_image("A" * 4000, "image", 1000)
