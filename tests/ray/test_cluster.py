"""hotlora on a local Ray Serve cluster: routing by base model, identity affinity, equality with the
single-process engine, and a replica killed under load. A real HTTP client against Serve's proxy."""

import base64
import io
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import numpy as np
import pytest
import ray
from PIL import Image

from hotlora.scaleout.routing import ATTEMPTS_HEADER, REPLICA_HEADER

from ..helpers import CORE_FAMILIES
from .conftest import HUB_SDXL_LORA

STEPS = 2
TIMEOUT_S = 120  # per HTTP request: nothing in these tests may hang


def deployment_of(response) -> str:
    """``SERVE_REPLICA::app#model-flux#id`` -> ``flux``."""
    return response.headers[REPLICA_HEADER].split("#")[1].removeprefix("model-")


def pixels(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("image/"):
        return np.asarray(Image.open(io.BytesIO(response.content)))[None]
    images = response.json()["images"] if "images" in response.json() else [d["b64_json"] for d in response.json()["data"]]
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in images])


def generate(url, identity=None, model=None, n=1, seed=0, steps=STEPS, client=None):
    body = {"prompt": "a portrait", "num_images": n, "seed": seed, "num_inference_steps": steps,
            "adapters": {"identity": identity, "style": "style-diffusers"} if identity else {}}
    if model:
        body["model"] = model
    return (client or httpx).post(f"{url}/v1/generate", json=body, timeout=TIMEOUT_S)


def local_engine_pixels(model_dir, config, identity, n=1, seed=0, steps=STEPS) -> np.ndarray:
    """The same request on a single-process engine built like a replica's (same settings, same catalog)."""
    from hotlora import Engine

    spec = next(s for s in config.models.values() if s.server.model == str(model_dir))
    engine = Engine.from_pretrained(model_dir, slots=spec.server.slots, target_rank=spec.server.target_rank,
                                    batch_size=spec.server.batch_size, compile=False, store=spec.store)
    adapters = {"identity": identity, "style": "style-diffusers"} if identity else {}
    result = engine.generate("a portrait", adapters=adapters, num_images=n, seed=seed, num_inference_steps=steps,
                             output_type="pil")
    return np.stack([np.asarray(img) for img in result.images])


def assert_same_image(a: np.ndarray, b: np.ndarray):
    # Equal up to the last bit of the 8-bit encoding: replicas and this process may use different
    # thread counts, which reorders float sums by ~1e-6.
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_routes_each_request_to_its_base_model(cluster):
    url, _ = cluster
    by_field = {m: generate(url, "identity-diffusers", model=m) for m in ("flux", "hotlora/tiny-sdxl", "tiny-sdxl")}
    assert [deployment_of(r) for r in by_field.values()] == ["flux", "sdxl", "sdxl"]
    default = generate(url, "identity-diffusers")
    assert deployment_of(default) == "flux"  # no model named: the default (the first one)
    flux, sdxl = pixels(by_field["flux"]), pixels(by_field["tiny-sdxl"])
    assert flux.shape != sdxl.shape  # the tiny models draw at different sizes: each went to its own model
    # The inference API: the model in the path, the identity in the `lora` header.
    hf = httpx.post(f"{url}/models/hotlora/tiny-sdxl", content=b"a dog", headers={"lora": "identity-peft"},
                    timeout=TIMEOUT_S)
    assert hf.status_code == 200 and hf.headers["content-type"] == "image/png"
    assert deployment_of(hf) == "sdxl"
    # ... and a Hub LoRA repository in the path, as the Hugging Face API serves one: routed by its card's base model.
    hub_lora = httpx.post(f"{url}/models/{HUB_SDXL_LORA}", json={"inputs": "a dog"}, timeout=TIMEOUT_S)
    assert hub_lora.status_code == 200 and deployment_of(hub_lora) == "sdxl", hub_lora.text
    # The OpenAI images API carries its own `model` field.
    openai = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "model": "sdxl", "n": 2},
                        timeout=TIMEOUT_S)
    assert deployment_of(openai) == "sdxl" and pixels(openai).shape[0] == 2
    # Reads go where ?model= says; readiness describes that model's engine.
    ready = httpx.get(f"{url}/readyz", params={"model": "sdxl"}, timeout=TIMEOUT_S).json()
    assert ready["ready"] and ready["engine"]["family"] == "sdxl"
    listed = httpx.get(f"{url}/v1/models", timeout=TIMEOUT_S).json()
    assert listed["routes"]["hotlora/tiny-flux"] == "flux" and listed["default"] == "flux"


def test_the_edge_refuses_what_no_replica_could_serve(cluster):
    url, _ = cluster
    unknown = generate(url, "identity-diffusers", model="stabilityai/sdxl-turbo")
    assert unknown.status_code == 404 and "tiny-flux" in unknown.json()["error"]
    assert REPLICA_HEADER not in unknown.headers  # answered by the ingress
    bad = httpx.post(f"{url}/v1/generate", json={"prompt": "x", "num_images": "many"}, timeout=TIMEOUT_S)
    assert bad.status_code == 422 and "num_images" in bad.json()["error"]
    openai_bad = httpx.post(f"{url}/v1/images/generations", content=b"{not json", timeout=TIMEOUT_S)
    assert openai_bad.status_code == 422 and "message" in openai_bad.json()["error"]
    # What only the model knows is answered by the replica, in the single server's words.
    missing = generate(url, "no-such-adapter", model="sdxl")
    assert missing.status_code == 404 and deployment_of(missing) == "sdxl"
    assert missing.json()["type"] == "AdapterNotFound"


@pytest.mark.parametrize("family", CORE_FAMILIES)  # the models the cluster deploys (conftest.ray_config)
def test_results_through_the_cluster_equal_the_single_process_engine(cluster, tiny_models, family):
    url, config = cluster
    response = generate(url, "identity-peft", model=family, n=3, seed=11)
    assert deployment_of(response) == family
    assert_same_image(pixels(response), local_engine_pixels(tiny_models[family], config, "identity-peft", n=3, seed=11))


def test_a_repeated_identity_is_served_by_the_replica_that_holds_it(cluster):
    url, _ = cluster
    identities = ["identity-diffusers", "identity-peft", "style-kohya", "style-xlabs"]
    with httpx.Client() as client:
        first = {i: generate(url, i, model="flux", client=client).headers[REPLICA_HEADER] for i in identities}
        # Replicas report what they hold to Serve's controller every 0.1 s; let the routers hear it.
        time.sleep(1.5)
        later = {i: {generate(url, i, model="flux", client=client).headers[REPLICA_HEADER] for _ in range(4)}
                 for i in identities}
    assert later == {i: {replica} for i, replica in first.items()}
    assert len(set(first.values())) == 2  # new identities go to the replica holding fewer: both work


def test_a_replica_killed_under_load_loses_no_request(cluster):
    url, _ = cluster
    identity, n = "identity-diffusers", 8
    first = generate(url, identity, model="flux", seed=5, steps=12)
    expected, victim = pixels(first), first.headers[REPLICA_HEADER]  # the replica that holds the identity
    with ThreadPoolExecutor(n) as pool:
        # One identity: requests queue on the replica that holds it (Serve spills to the other one when
        # it is busy). Once one has been answered, that replica is killed with the rest in flight.
        futures = [pool.submit(generate, url, identity, "flux", 1, 5, 12) for _ in range(n)]
        wait(futures, timeout=TIMEOUT_S, return_when=FIRST_COMPLETED)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        responses = [f.result(timeout=TIMEOUT_S) for f in futures]
    assert len(responses) == n
    retried = [r for r in responses if int(r.headers.get(ATTEMPTS_HEADER, 1)) > 1]
    assert retried, "the kill hit no request in flight; the test proved nothing"
    for response in responses:
        if response.status_code == 200:
            assert_same_image(pixels(response), expected)
        else:  # failing is allowed only clearly: 503, a JSON error, a Retry-After
            assert response.status_code == 503 and response.json()["type"] == "ReplicasUnavailable"
            assert "Retry-After" in response.headers
    assert all(r.status_code == 200 for r in responses if r not in retried)  # untouched requests just succeed
    assert all(r.headers[REPLICA_HEADER] != victim for r in retried if r.status_code == 200)
