"""Served sizes through every API of a real server (tiny Flux, not compiled: the compiled side is
tests/integration/test_sizes.py): the OpenAI `size`, the inference API's width/height and
/v1/generate all go through the size policy, and every answer says which size it was served at."""

import base64
import io

import httpx
import pytest
from PIL import Image

from ..helpers import GENERATE_STEPS


@pytest.fixture(scope="module")
def nearest(tiny_models, tmp_path_factory, start_server):
    return start_server(tiny_models["flux"], tmp_path_factory.mktemp("sizes"), compile=False, batch_size=2,
                        sizes="32x32,48x32", size_policy="nearest")


def dims(png: bytes) -> str:
    width, height = Image.open(io.BytesIO(png)).size
    return f"{width}x{height}"


def test_every_api_serves_the_size_set_and_says_when_it_snapped(nearest):
    url, steps = nearest.url, GENERATE_STEPS
    assert httpx.get(f"{url}/readyz").json()["engine"]["sizes"] == ["32x32", "48x32"]
    exact = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "48x32"}, timeout=120)
    assert exact.status_code == 200, exact.text
    assert exact.json()["size"] == "48x32" and "snapped_from" not in exact.json()
    assert dims(base64.b64decode(exact.json()["data"][0]["b64_json"])) == "48x32"
    assert "x-hotlora-snapped-from" not in exact.headers

    snapped = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "96x64"}, timeout=120)
    assert snapped.status_code == 200, snapped.text
    assert (snapped.json()["size"], snapped.json()["snapped_from"]) == ("48x32", "96x64")
    assert dims(base64.b64decode(snapped.json()["data"][0]["b64_json"])) == "48x32"

    hf = httpx.post(f"{url}/", timeout=120, json={"inputs": "a dog", "parameters": {
        "width": 40, "height": 40, "num_inference_steps": steps}})
    assert hf.status_code == 200, hf.text
    assert (hf.headers["x-hotlora-size"], hf.headers["x-hotlora-snapped-from"]) == ("32x32", "40x40")
    assert dims(hf.content) == "32x32"

    native = httpx.post(f"{url}/v1/generate", timeout=120, json={
        "prompt": "a dog", "width": 64, "height": 40, "num_inference_steps": steps})
    assert native.status_code == 200, native.text
    assert (native.json()["size"], native.json()["snapped_from"]) == ("48x32", "64x40")
    assert native.headers["x-hotlora-size"] == "48x32"


def test_a_size_that_is_not_a_size_is_a_422_naming_the_form(nearest):
    bad = httpx.post(f"{nearest.url}/v1/images/generations", json={"prompt": "a cat", "size": "huge"}, timeout=30)
    assert bad.status_code == 422 and "WIDTHxHEIGHT" in bad.text
