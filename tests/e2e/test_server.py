"""``hotlora serve`` end to end: a real uvicorn server on 127.0.0.1, a real HTTP client (httpx)."""

import base64
import io
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import TARGET_RANK, generate, metric, pixels, sse_events

FAST_S = 3.0  # a caller's fault must be answered well within this (it is milliseconds in practice)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory, start_server):
    """The main server (compiled tiny Flux, batch 3) and ten random adapters it may read."""
    tmp = tmp_path_factory.mktemp("e2e")
    root = tmp / "loras"
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(tiny_models["flux"] / "transformer")
    linears = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    rng = random.Random(7)
    for i in range(10):
        rank = rng.randint(1, TARGET_RANK)
        modules = rng.sample(sorted(linears), rng.randint(5, len(linears)))
        save_diffusers_lora(root / f"user-{i}", "flux", random_lora(linears, rank, seed=100 + i, modules=modules),
                            rank=rank, alpha=rng.choice([rank, 2 * rank]))
    # Hostile files the server must refuse without touching the engine.
    good = load_file(str(root / "user-0" / "pytorch_lora_weights.safetensors"))
    nan = {k: v.clone() for k, v in good.items()}
    next(iter(nan.values()))[0, 0] = float("nan")
    save_file(nan, str(root / "nan.safetensors"))
    module = sorted(linears)[0]
    save_file({f"transformer.{module}.lora_A.weight": torch.randn(TARGET_RANK * 2, linears[module][0]),
               f"transformer.{module}.lora_B.weight": torch.randn(linears[module][1], TARGET_RANK * 2)},
              str(root / "rank-too-big.safetensors"))
    save_file(good, str(root / "foreign.safetensors"), metadata={"base_model": "stabilityai/sdxl-turbo"})
    (root / "garbage.safetensors").write_bytes(b"\x00" * 40)
    tiny_adapters = tiny_models["flux"] / "adapters"
    server = start_server(tiny_models["flux"], tmp, roots=(root, tiny_adapters), catalog=str(tiny_adapters / "catalog.toml"),
                          enable_fault_injection=True)
    return server, root


def test_every_endpoint(served):
    server, root = served
    url = server.url
    assert httpx.get(f"{url}/healthz").json() == {"status": "alive"}
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["ready"] and ready["engine"]["family"] == "flux"

    listing = httpx.get(f"{url}/v1/adapters").json()
    assert listing["slots"] == ["identity", "style"]
    assert {e["name"] for e in listing["catalog"]} >= {"identity-diffusers", "style-kohya"}

    accepted = httpx.post(f"{url}/v1/adapters/prefetch", json={"refs": [str(root / "user-3")]})
    assert accepted.status_code == 202
    for _ in range(100):  # bounded: the prefetch runs in the background
        if any("user-3" in a["name"] for a in httpx.get(f"{url}/v1/adapters").json()["cached"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("prefetched adapter never reached the RAM cache")

    response = generate(url, identity=(str(root / "user-1"), 0.9), style=("style-kohya", 0.7), n=2, seed=5)
    body = response.json()
    assert len(body["images"]) == 2 and body["seeds"] == [5, 6] and body["recompiles"] == 0
    assert body["adapters"]["style"]["layout"] == "kohya" and len(body["adapters"]["identity"]["sha256"]) == 64
    assert set(body["timings"]) == {"queue_ms", "fetch_ms", "prepare_ms", "swap_ms", "text_encoders_ms", "generate_ms",
                                    "encode_ms", "total_ms"}
    assert "generate;dur=" in response.headers["server-timing"]
    assert pixels(response).shape[0] == 2

    for path in ("/", "/models/hotlora/tiny-flux"):
        raw = httpx.post(f"{url}{path}", content="a dog in the snow", headers={"lora": "style-xlabs"}, timeout=300)
        assert raw.status_code == 200 and raw.headers["content-type"] == "image/png"
        Image.open(io.BytesIO(raw.content)).verify()
    as_json = httpx.post(f"{url}/", json={"inputs": "a dog", "parameters": {"seed": 3, "num_inference_steps": 2}},
                         headers={"accept": "image/webp", "lora": str(root / "user-2")}, timeout=300)
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(as_json.content)).format == "WEBP"
    bad_lora = httpx.post(f"{url}/", content="a dog", headers={"lora": "no-such-adapter"})
    assert bad_lora.status_code == 404 and "error" in bad_lora.json()

    openai = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "n": 2, "size": "32x32",
                                                              "adapters": {"style": "style-diffusers"}}, timeout=300)
    assert openai.status_code == 200 and len(openai.json()["data"]) == 2
    Image.open(io.BytesIO(base64.b64decode(openai.json()["data"][0]["b64_json"]))).verify()
    url_format = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "response_format": "url"})
    assert url_format.status_code == 422 and "b64_json" in url_format.json()["error"]["message"]

    text = httpx.get(f"{url}/metrics").text
    for name in ("hotlora_requests_total", "hotlora_stage_seconds_bucket", "hotlora_queue_wait_seconds_count",
                 "hotlora_recompiles_total", "hotlora_cache_hits_total", "hotlora_queue_depth", "hotlora_engine_rebuilds_total"):
        assert name in text, name


def pairs(root):
    rng = random.Random(11)
    return [((str(root / f"user-{rng.randrange(10)}"), round(rng.uniform(0.2, 1.4), 2)),
             (str(root / f"user-{rng.randrange(10)}"), round(rng.uniform(0.0, 1.2), 2)) if i % 4 else None)
            for i in range(20)]


def test_twenty_concurrent_requests_each_equal_their_single_request_result(served):
    server, root = served
    work = pairs(root)
    alone = [pixels(generate(server.url, identity, style, n=2, seed=i)) for i, (identity, style) in enumerate(work)]
    with ThreadPoolExecutor(max_workers=20) as pool:
        together = list(pool.map(lambda item: generate(server.url, item[1][0], item[1][1], n=2, seed=item[0]),
                                 enumerate(work)))
    for i, response in enumerate(together):
        assert np.abs(pixels(response).astype(int) - alone[i].astype(int)).max() <= 1, f"request {i} differs"
    distinct = {alone[i].tobytes() for i in range(len(work))}
    assert len(distinct) == len(work), "different adapters should give different images"
    assert metric(server.url, "hotlora_recompiles_total") == 0


BAD = [
    ("/v1/generate", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "unknown_field": 1}}, 422),
    ("/v1/generate", {"json": {"prompt": ""}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "num_inference_steps": -3}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "num_images": 1000}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "width": 33}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"face": "style-kohya"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "../../etc/passwd"}}}, 403),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "/etc/passwd"}}}, 403),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ROOT/missing.safetensors"}}}, 404),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ROOT/nan.safetensors"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ROOT/rank-too-big.safetensors"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ROOT/foreign.safetensors"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ROOT/garbage.safetensors"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": "ftp://host/x"}}}, 422),
    ("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": {"ref": "style-kohya", "scale": "big"}}}}, 422),
    ("/", {"content": b"\xff\xfe\xfa", "headers": {"content-type": "text/plain", "lora": "style-kohya"}}, 422),
    ("/", {"content": b"a dog", "headers": {"content-type": "text/plain"}}, 415),  # any web page could send it
    ("/", {"json": {"parameters": {}}}, 422),
    ("/v1/images/generations", {"json": {"prompt": "x", "size": "huge"}}, 422),
    ("/v1/images/generations", {"json": {"prompt": "x", "n": 0}}, 422),
]


def test_bad_inputs_fail_fast_and_good_ones_stay_exact(served):
    server, root = served
    good = ((str(root / "user-4"), 0.8), ("style-kohya", 0.6))
    expected = pixels(generate(server.url, *good, n=2, seed=3))
    for path, kwargs, status in BAD:
        if "json" in kwargs:
            kwargs = {**kwargs, "json": _rooted(kwargs["json"], root)}
        began = time.perf_counter()
        response = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
        elapsed = time.perf_counter() - began
        assert response.status_code == status, (path, kwargs, response.status_code, response.text)
        assert "error" in response.json()
        assert elapsed < FAST_S, f"{path} {kwargs}: {elapsed:.2f}s"
        assert np.array_equal(pixels(generate(server.url, *good, n=2, seed=3)), expected)
    foreign = httpx.post(f"{server.url}/v1/generate",
                         json={"prompt": "x", "adapters": {"identity": str(root / "foreign.safetensors")}}).json()
    assert "declares base model 'stabilityai/sdxl-turbo'" in foreign["error"]
    assert metric(server.url, "hotlora_engine_rebuilds_total") == 0
    assert metric(server.url, "hotlora_recompiles_total") == 0


def _rooted(body, root):
    import json

    return json.loads(json.dumps(body).replace("ROOT", str(root)))


def test_an_engine_fault_rebuilds_once_and_later_requests_succeed(served):
    server, root = served
    good = ((str(root / "user-5"), 1.0), ("style-diffusers", 0.5))
    expected = pixels(generate(server.url, *good, n=2, seed=9))
    assert httpx.post(f"{server.url}/admin/fault").json() == {"armed": True}
    faulted = generate(server.url, *good, n=2, seed=9)
    assert faulted.status_code == 500 and "non-finite" in faulted.json()["error"]
    deadline = time.monotonic() + 300
    while httpx.get(f"{server.url}/readyz").status_code != 200:  # readiness is false while rebuilding
        assert time.monotonic() < deadline, "the engine never came back"
        time.sleep(0.2)
    assert np.abs(pixels(generate(server.url, *good, n=2, seed=9)).astype(int) - expected.astype(int)).max() <= 1
    assert metric(server.url, "hotlora_engine_rebuilds_total") == 1
    assert httpx.get(f"{server.url}/readyz").json()["rebuilds"] == 1


def test_queue_overflow_client_drop_and_draining_shutdown(tiny_models, tmp_path, start_server):
    server = start_server(tiny_models["flux"], tmp_path, roots=(tiny_models["flux"] / "adapters",), max_queue=1,
                          compile=False, batch_size=6)
    slow = {"prompt": "a slow one", "num_images": 6, "num_inference_steps": 40}
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/generate", json=slow, timeout=300), range(8)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
    assert set(codes) <= {200, 429}

    # A client that gives up while its request waits behind another is dropped, not generated.
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(httpx.post, f"{server.url}/v1/generate", json=slow, timeout=300)
        time.sleep(0.3)
        quitter = pool.submit(httpx.post, f"{server.url}/v1/generate", json=slow, timeout=0.5)
        with pytest.raises(httpx.TimeoutException):
            quitter.result()
        assert first.result().status_code == 200
    for _ in range(50):
        if metric(server.url, "hotlora_requests_dropped_total") == 1:
            break
        time.sleep(0.1)
    assert metric(server.url, "hotlora_requests_dropped_total") == 1

    # Shutdown stops taking work and finishes what is in flight.
    with ThreadPoolExecutor(max_workers=2) as pool:
        inflight = pool.submit(httpx.post, f"{server.url}/v1/generate", json=slow, timeout=300)
        time.sleep(0.3)
        server.server.should_exit = True
        assert inflight.result().status_code == 200
    server.thread.join(timeout=120)
    assert not server.thread.is_alive()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/healthz", timeout=2)


def test_pivotal_tuning_adapters_over_http(served, tiny_models):
    """An adapter folder as diffusers' advanced scripts leave it (LoRA with CLIP-L layers and
    ``<name>_emb.safetensors``): served with its tokens, or under names the request gives them,
    with the same pixels; tokens for an adapter without embeddings, and reserved tokens, are 422."""
    from types import SimpleNamespace

    from transformers import CLIPTextModel, T5EncoderModel

    from hotlora.testing import random_embeddings, save_pivotal_lora, text_encoder_linears

    server, root = served
    encoders = SimpleNamespace(text_encoder=CLIPTextModel.from_pretrained(tiny_models["flux"] / "text_encoder"),
                               text_encoder_2=T5EncoderModel.from_pretrained(tiny_models["flux"] / "text_encoder_2"))
    clip_lora = random_lora(text_encoder_linears(encoders, "text_encoder"), 4, seed=9)
    folder = save_pivotal_lora(root / "pivotal", "flux", {}, {"text_encoder": clip_lora}, alpha=4,
                               embeddings=random_embeddings(encoders, "flux", 2, seed=9))

    def ask(prompt, spec):
        return httpx.post(f"{server.url}/v1/generate", timeout=300, json={
            "prompt": prompt, "adapters": {"identity": spec}, "num_images": 1, "seed": 4, "num_inference_steps": 2})

    default = ask("a photo of <s0><s1>", {"ref": str(folder), "scale": 0.9})
    renamed = ask("a photo of <me0><me1>", {"ref": str(folder), "scale": 0.9, "tokens": ["<me0>", "<me1>"]})
    assert np.array_equal(pixels(default), pixels(renamed))
    served_adapter = renamed.json()["adapters"]["identity"]
    assert served_adapter["embedding_tokens"] == ["<me0>", "<me1>"] and served_adapter["text_encoders"] == ["text_encoder"]
    assert renamed.json()["timings"]["text_encoders_ms"] > 0  # other token names: the rows were written
    plain = ask("a photo of <s0><s1>", {"ref": str(root / "user-1"), "tokens": ["<x>"]})
    assert plain.status_code == 422 and "no pivotal-tuning embeddings" in plain.json()["error"]
    reserved = ask("a photo of <hotlora-0-0>", {"ref": str(folder)})
    assert reserved.status_code == 422 and "reserved" in reserved.json()["error"]
    assert metric(server.url, "hotlora_recompiles_total") == 0


def test_a_request_is_checked_once_along_its_corridor(served, monkeypatch):
    """One HTTP request with two adapters: its parameters and slots are checked exactly once
    (``Engine.check``), not again by the fetch, the resolver's bind or the writer's swap; each
    adapter is validated once."""
    import hotlora.adapters.resolver as resolver_module
    from hotlora.engine.request import RequestRules

    server, root = served
    calls = []
    real = resolver_module.check_slots
    monkeypatch.setattr(resolver_module, "check_slots", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    params, check = [], RequestRules.check
    monkeypatch.setattr(RequestRules, "check", lambda self, *a, **k: (params.append(a), check(self, *a, **k))[1])
    engine = server.worker.engine
    validated = []
    problems = engine.resolver._problems
    monkeypatch.setattr(engine.resolver, "_problems", lambda adapter: (validated.append(adapter.name),
                                                                         problems(adapter))[1])
    response = generate(server.url, (str(root / "user-4"), 0.8), (str(root / "user-5"), 0.6), n=1, seed=3)
    assert response.status_code == 200, response.text
    assert len(calls) == 1 and set(calls[0][0]) == {"identity", "style"}
    assert len(params) == 1 and len(validated) == 2


def test_image_tasks_are_refused_as_such_by_a_text_to_image_server(served):
    """The Hugging Face image-to-image body and an OpenAI edit reach a server without image tasks:
    each a 422 naming the task and what is served, never an image made from base64 as a prompt."""
    server, _ = served
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(png, "PNG")
    for inputs in (base64.b64encode(png.getvalue()).decode(), "A" * 20_000):
        hf = httpx.post(f"{server.url}/", json={"inputs": inputs, "parameters": {"prompt": "a cat"}}, timeout=30)
        assert hf.status_code == 422 and hf.json()["type"] == "UnservedTask", hf.text
        assert "'image-to-image' is not served" in hf.json()["error"] and "text-to-image" in hf.json()["error"]
    edit = httpx.post(f"{server.url}/v1/images/edits", data={"prompt": "a cat"},
                      files={"image": ("p.png", png.getvalue(), "image/png")}, timeout=30)
    assert edit.status_code == 422 and edit.json()["error"]["type"] == "UnservedTask", edit.text


def test_adapter_declared_steps_over_every_api(served, tiny_models):
    """A step-distilled adapter's declared steps and guidance: the JSON API's stream runs that many
    steps and every API reports where they came from; a request's own steps win."""
    from hotlora.testing import declare_defaults

    server, root = served
    distill = declare_defaults(root / "user-4", root / "distill.safetensors", num_inference_steps=2, guidance_scale=2.0)
    body = {"prompt": "a cat", "adapters": {"identity": str(distill)}}
    with httpx.stream("POST", f"{server.url}/v1/generate/stream", json=body, timeout=300) as response:
        events = sse_events(response)
    assert [data for name, data in events if name == "progress"] == [{"step": 1, "total": 2}, {"step": 2, "total": 2}]
    name, result = events[-1]
    declared = {"num_inference_steps": {"value": 2, "slots": ["identity"]},
                "guidance_scale": {"value": 2.0, "slots": ["identity"]}}
    assert name == "result" and result["adapter_defaults"] == declared and result["recompiles"] == 0

    own = httpx.post(f"{server.url}/v1/generate", json={**body, "num_inference_steps": 3}, timeout=300).json()
    assert own["adapter_defaults"] == {"guidance_scale": {"value": 2.0, "slots": ["identity"]}}

    raw = httpx.post(f"{server.url}/", content="a dog", headers={"lora": str(distill)}, timeout=300)
    assert raw.status_code == 200
    assert raw.headers["x-hotlora-adapter-defaults"] == "num_inference_steps=2 (identity); guidance_scale=2 (identity)"
    openai = httpx.post(f"{server.url}/v1/images/generations", timeout=300,
                        json={"prompt": "a cat", "size": "32x32", "adapters": {"identity": str(distill)}}).json()
    assert openai["adapter_defaults"] == declared

    other = declare_defaults(root / "user-5", root / "other.safetensors", num_inference_steps=6)
    refused = httpx.post(f"{server.url}/v1/generate", timeout=300,
                         json={"prompt": "a cat", "adapters": {"identity": str(distill), "style": str(other)}})
    assert refused.status_code == 422, refused.text
    assert "different num_inference_steps ([identity] 2, [style] 6)" in refused.json()["error"]
