"""The server checks its memory plan before it loads anything: too little memory refuses to
start with the plan in the message; enough starts and serves."""

import httpx
import pytest

from hotlora.settings import ServerConfig, StoreConfig
from hotlora.errors import DoesNotFit
from hotlora.server.run import build_serving


def test_a_server_that_cannot_fit_refuses_to_start_with_its_plan(tiny_models, tmp_path):
    config = ServerConfig(model=str(tiny_models["flux"]), memory="1MiB", compile=False, batch_size=1)
    with pytest.raises(DoesNotFit) as refused:
        build_serving(config, StoreConfig(cache_dir=tmp_path / "cache"))
    message = str(refused.value)
    assert "DOES NOT FIT" in message and "transformer" in message and "memory 1MiB" in message
    assert refused.value.plan.fits is False and refused.value.plan.budget == 2**20


def test_a_server_that_fits_starts_and_serves(tiny_models, tmp_path, start_server):
    server = start_server(tiny_models["flux"], tmp_path, memory="2GiB", compile=False, batch_size=1)
    response = httpx.post(f"{server.url}/v1/generate", json={"prompt": "a cat", "num_images": 1, "seed": 0,
                                                             "num_inference_steps": 2}, timeout=120)
    assert response.status_code == 200, response.text
