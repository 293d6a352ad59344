"""`hotlora serve` for every registered family: its tiny model served over the three APIs (the
JSON API with an adapter pair, OpenAI images, the Hugging Face inference API with its own client),
the JSON API's pixels equal to plain diffusers' with the same adapters, and the options a family
does not take refused with what it takes. Eager engines: the compiled contract per family is
tests/integration/test_contract.py. The families beyond flux and sdxl run here in
`make test-families` (a server per family is CI time; the serving path is the same code)."""

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from hotlora.families import family_named

from ..helpers import GENERATE_STEPS, family_params, pixels

SCALES = {"identity": 0.9, "style": 0.7}


@pytest.fixture
def hf_client(monkeypatch):
    """huggingface_hub's InferenceClient (the suite's HF_HUB_OFFLINE would stop it reaching 127.0.0.1 too)."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    return InferenceClient


@pytest.mark.parametrize("family", family_params(images=True))
def test_each_family_is_served_over_the_three_apis(family, tiny_models, tmp_path, start_server, hf_client):
    from hotlora.testing import plain_diffusers_reference

    model = tiny_models[family]
    adapters = model / "adapters"
    server = start_server(model, tmp_path, roots=(adapters,), catalog=str(adapters / "catalog.toml"), compile=False)
    url = server.url
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["engine"]["family"] == family
    height, width = ready["engine"]["height"], ready["engine"]["width"]

    pair = {"identity": adapters / "identity-diffusers", "style": adapters / "style-diffusers"}
    body = {"prompt": "a portrait", "num_images": 1, "seed": 3, "num_inference_steps": GENERATE_STEPS,
            "adapters": {slot: {"ref": str(path), "scale": SCALES[slot]} for slot, path in pair.items()}}
    served = pixels(httpx.post(f"{url}/v1/generate", json=body, timeout=300))
    reference = plain_diffusers_reference(
        model, {slot: (path, SCALES[slot]) for slot, path in pair.items()}, prompt="a portrait", num_images=1,
        num_inference_steps=GENERATE_STEPS, guidance_scale=ready["engine"]["defaults"]["guidance_scale"],
        height=height, width=width, seed=3, output_type="np")
    expected = (np.clip(reference, 0, 1) * 255).round().astype(np.uint8)
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1

    openai = httpx.post(f"{url}/v1/images/generations", timeout=300,
                        json={"prompt": "a cat", "n": 1, "size": f"{width}x{height}", "adapters": {"style": "style-diffusers"}})
    assert openai.status_code == 200, openai.text
    Image.open(io.BytesIO(base64.b64decode(openai.json()["data"][0]["b64_json"]))).verify()

    image = hf_client(model=url, timeout=300, headers={"lora": "style-diffusers"}).text_to_image(
        "a dog", num_inference_steps=GENERATE_STEPS)
    assert image.size == (width, height)

    fam = family_named(family)
    negative = httpx.post(f"{url}/v1/generate", json={**body, "negative_prompt": "blurry"}, timeout=300)
    if fam.negative_prompts:
        assert negative.status_code == 200, negative.text
    else:
        assert negative.status_code == 422 and f"not taken by the {family} family" in negative.text
        assert ", ".join(fam.request_options()) in negative.text
    # A pipeline's own argument that is no field of the API: refused, with what this model does take.
    true_cfg = httpx.post(f"{url}/v1/generate", json={**body, "true_cfg_scale": 4.0}, timeout=30)
    assert true_cfg.status_code == 422 and "true_cfg_scale: Extra inputs are not permitted" in true_cfg.text
    assert f"true_cfg_scale not taken by the {family} family (it takes: " in true_cfg.text
    assert ", ".join(fam.request_options()) in true_cfg.text

