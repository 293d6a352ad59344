"""The Hugging Face inference API's ``/models/{id}`` naming a LoRA repository, as the Hugging Face
API serves one: huggingface_hub's ``InferenceClient`` pointed at ``/models/someone/flux-style`` gets
that Hub adapter in the identity slot (its model card's ``base_model`` checked against the served
model), the served model's own id gets the base, and an adapter whose card names another family's
base is refused with both families named. The Hub is a pre-filled offline cache (no network)."""

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from ..helpers import fake_hub_cache


@pytest.fixture
def hf_client(monkeypatch):
    """huggingface_hub's InferenceClient (the suite's HF_HUB_OFFLINE would stop it reaching 127.0.0.1 too)."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    return InferenceClient


def card(base: str) -> bytes:
    return f"---\nbase_model: {base}\ntags: [lora, text-to-image]\n---\n# a LoRA\n".encode()


def test_a_models_path_naming_a_hub_lora_serves_it_on_its_base(tiny_models, tmp_path, start_server, hf_client):
    flux, sdxl = tiny_models["flux"], tiny_models["sdxl"]
    weights = (flux / "adapters" / "style-diffusers" / "pytorch_lora_weights.safetensors").read_bytes()
    other = (sdxl / "adapters" / "style-diffusers" / "pytorch_lora_weights.safetensors").read_bytes()
    hub = tmp_path / "hub"
    fake_hub_cache(hub, "someone/flux-style", {"pytorch_lora_weights.safetensors": weights,
                                               "README.md": card("hotlora/tiny-flux")})
    fake_hub_cache(hub, "someone/sdxl-style", {"pytorch_lora_weights.safetensors": other,
                                               "README.md": card("stabilityai/stable-diffusion-xl-base-1.0")})
    server = start_server(flux, tmp_path, compile=False, store_overrides={"hf_cache_dir": str(hub)})
    url, params = server.url, {"seed": 4, "num_inference_steps": 2}

    def image(path, **headers):
        response = httpx.post(f"{url}{path}", json={"inputs": "a dog", "parameters": params}, headers=headers,
                              timeout=300)
        assert response.status_code == 200, response.text
        return np.asarray(Image.open(io.BytesIO(response.content)))

    through_path = hf_client(model=f"{url}/models/someone/flux-style", timeout=300).text_to_image(
        "a dog", seed=4, num_inference_steps=2)
    through_header = image("/", lora="hf://someone/flux-style")
    assert np.array_equal(np.asarray(through_path), through_header)
    base = image("/")
    assert np.abs(through_header.astype(int) - base.astype(int)).max() > 0  # the adapter was applied
    assert np.array_equal(image("/models/hotlora/tiny-flux"), base)  # the served model's id: the base

    foreign = httpx.post(f"{url}/models/someone/sdxl-style", json={"inputs": "a dog"}, timeout=300)
    assert foreign.status_code == 422, foreign.text
    assert "sdxl" in foreign.text and "flux" in foreign.text and "stable-diffusion-xl-base-1.0" in foreign.text
    both = httpx.post(f"{url}/models/someone/flux-style", json={"inputs": "a dog"}, timeout=300,
                      headers={"lora": "style-diffusers"})
    assert both.status_code == 422 and "give the adapter one way" in both.text
    missing = httpx.post(f"{url}/models/someone/not-on-the-hub", json={"inputs": "a dog"}, timeout=300)
    assert missing.status_code == 404, missing.text
