"""A real server against hostile clients: every hostile input is a clear 4xx, fast, with 0
rebuilds and 0 recompiles; adapters saved the way diffusers' training scripts save them are
served; then a bounded overload soak where nothing hangs, nothing is lost, memory stays bounded
and the good requests' images equal what they give alone. Figures are printed (see
docs/robustness.md), never asserted as timings."""

import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import generate, metric, pixels

FAST_S = 3.0  # a refusal before the engine runs (milliseconds in practice)
STEPS = 2
DEADLINE_S = 2.0  # the store's whole-download deadline in this server
PREFETCH_BOUND = 8  # adapter fetches a prefetch may have running


@pytest.fixture(scope="module")
def hostile(tiny_models, tmp_path_factory, start_server, drip_url):
    from diffusers import FluxTransformer2DModel

    tmp = tmp_path_factory.mktemp("hostile")
    root = tmp / "loras"
    transformer = FluxTransformer2DModel.from_pretrained(tiny_models["flux"] / "transformer")
    linears = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    for i in range(4):
        save_diffusers_lora(root / f"trained-{i}", "flux", random_lora(linears, 4, seed=200 + i), rank=4, alpha=4 + 4 * i)
    good = load_file(str(root / "trained-0" / "pytorch_lora_weights.safetensors"))
    save_file({k: v * 1e12 for k, v in good.items()}, str(root / "huge.safetensors"))
    save_file({k: v * 3e7 for k, v in good.items()}, str(root / "overflowing.safetensors"))
    redos = {"transformer.r": "4", "transformer.lora_alpha": "4", "transformer.rank_pattern": json.dumps({"(a+)+$": 2})}
    (root / "redos.safetensors").write_bytes(save(good, metadata={"lora_adapter_metadata": json.dumps(redos)}))
    os.mkfifo(root / "pipe.safetensors")  # never ends: read, it would hold a fetch worker for ever
    server = start_server(tiny_models["flux"], tmp, roots=(root,), max_queue=4, max_prefetch_inflight=PREFETCH_BOUND,
                          max_work=32 * 32 * 8 * 10,  # the tiny model's images are 32x32
                          # One writer state (no rank buckets): what is tested here is the edge, and
                          # the default's three states would triple this server's warm-up (CI time).
                          rank_buckets=(),
                          store_overrides={"allow_http": True, "download_deadline_s": DEADLINE_S, "retries": 1})
    return server, root, linears, good, drip_url


def post(url, body, timeout=120, path="/v1/generate", **kwargs):
    return httpx.post(f"{url}{path}", json=body, timeout=timeout, **kwargs)


def body(adapters=None, **extra):
    return {"prompt": "a portrait", "adapters": adapters or {}, "num_inference_steps": STEPS, **extra}


def hostile_requests(root, drip_url):
    """(name, request kwargs for httpx.post, expected status, must be fast)."""
    trained = str(root / "trained-1")
    return [
        ("scale 1e30", {"json": body({"style": {"ref": trained, "scale": 1e30}})}, 422, True),
        ("scale -9", {"json": body({"style": {"ref": trained, "scale": -9}})}, 422, True),
        ("huge finite weights", {"json": body({"identity": str(root / "huge.safetensors")})}, 422, True),
        ("overflowing weights", {"json": body({"identity": str(root / "overflowing.safetensors")})}, 422, False),
        ("unserved size", {"json": body(width=64, height=32)}, 422, True),
        ("too much work", {"json": body(num_images=64, num_inference_steps=200)}, 413, True),
        ("body over 1 MiB", {"content": b'{"prompt": "' + b"x" * (1 << 20) + b'"}',
                             "headers": {"content-type": "application/json"}}, 413, True),
        ("long negative prompt", {"json": body(negative_prompt="x" * 20_000)}, 422, True),
        ("long bare reference", {"json": body({"identity": "a" * 5000})}, 422, True),
        ("many slots", {"json": body({f"slot{i}": "x" for i in range(20)})}, 422, True),
        ("long lora header", {"content": b"a dog", "headers": {"lora": "a" * 5000}, "path": "/"}, 413, True),
        ("regex bomb in metadata", {"json": body({"identity": str(root / "redos.safetensors")})}, 422, True),
        # Issue 24: these were 500s (ValueError from the port, httpx's InvalidURL for the tab / CR-LF).
        ("URL port out of range", {"json": body({"identity": f"{drip_url}0000/x.safetensors"})}, 422, True),
        ("tab in a URL", {"json": body({"identity": f"{drip_url}/a\tb.safetensors"})}, 422, True),
        ("CR/LF in a URL", {"json": body({"identity": f"{drip_url}/x\r\nX-Injected: 1"})}, 422, True),
        ("URL port out of range in the lora header", {"content": b"a dog", "path": "/",
                                                      "headers": {"lora": f"{drip_url}0000/x.safetensors"}}, 422, True),
        ("prefetch of a malformed URL", {"json": {"refs": [f"{drip_url}0000/x.safetensors"]},
                                         "path": "/v1/adapters/prefetch"}, 422, True),
        ("a named pipe in the root", {"json": body({"identity": str(root / "pipe.safetensors")})}, 422, True),
        ("prefetch up to the bound", {"json": {"refs": [f"{drip_url}/flood-{i}.safetensors"
                                                        for i in range(PREFETCH_BOUND)]},
                                      "path": "/v1/adapters/prefetch"}, 202, True),
        ("prefetch over the bound", {"json": {"refs": [f"{drip_url}/more-{i}.safetensors" for i in range(2)]},
                                     "path": "/v1/adapters/prefetch"}, 429, True),
    ]


def test_hostile_inputs_are_clear_fast_4xx_with_no_rebuild_or_recompile(hostile):
    server, root, _, _, drip_url = hostile
    trained = (str(root / "trained-2"), 0.9)
    expected = pixels(generate(server.url, trained, n=2, seed=4, num_inference_steps=STEPS))
    for name, kwargs, status, fast in hostile_requests(root, drip_url):
        path = kwargs.pop("path", "/v1/generate")
        began = time.perf_counter()
        response = httpx.post(f"{server.url}{path}", timeout=120, **kwargs)
        elapsed = time.perf_counter() - began
        assert response.status_code == status, (name, response.status_code, response.text[:500])
        if status >= 400:
            assert "error" in response.json(), name
        assert not fast or elapsed < FAST_S, f"{name}: {elapsed:.2f}s"
    # The engine never noticed: same images, nothing rebuilt, nothing compiled.
    assert np.array_equal(pixels(generate(server.url, trained, n=2, seed=4, num_inference_steps=STEPS)), expected)
    assert metric(server.url, "hotlora_engine_rebuilds_total") == 0
    assert metric(server.url, "hotlora_recompiles_total") == 0


def test_adapters_saved_by_diffusers_training_scripts_are_served(hostile):
    server, root, _, _, _ = hostile
    response = generate(server.url, (str(root / "trained-3"), 1.0), (str(root / "trained-0"), 0.5), n=1,
                        num_inference_steps=STEPS)
    assert response.status_code == 200, response.text
    assert response.json()["adapters"]["identity"]["rank"] == 4


def test_a_slow_drip_source_is_cut_at_the_deadline_and_cached_requests_never_wait(hostile):
    server, root, _, _, drip_url = hostile
    cached = (str(root / "trained-1"), 0.7)
    assert generate(server.url, cached, n=1, num_inference_steps=STEPS).status_code == 200
    with ThreadPoolExecutor(max_workers=8) as pool:
        dripping = [pool.submit(post, server.url, body({"style": f"{drip_url}/slow-{i}.safetensors"}))
                    for i in range(6)]
        time.sleep(0.3)  # the downloads hold every fetch worker now
        began = time.perf_counter()
        quick = generate(server.url, cached, n=1, num_inference_steps=STEPS)
        quick_s = time.perf_counter() - began
        answers = [f.result(timeout=60) for f in dripping]
    assert quick.status_code == 200
    # It did not wait for any download (figures: docs/robustness.md): its fetch stage, as the server
    # timed it, is a fraction of the deadline, whatever the machine's load made its generation take.
    assert quick.json()["timings"]["fetch_ms"] < DEADLINE_S * 1000 / 4, (quick_s, quick.json()["timings"])
    # One client (one peer, no keys) holds half the fetch workers: its downloads that ran were cut at
    # the deadline (502); the rest spent that deadline queued behind them and were told to retry (429).
    for answer in answers:
        cut = answer.status_code == 502 and "did not finish within" in answer.json()["error"]
        assert cut or (answer.status_code == 429 and "fetch worker" in answer.json()["error"]), answer.text
    assert any(answer.status_code == 502 for answer in answers)


fuzzed_headers = st.one_of(
    st.dictionaries(st.text(max_size=12), st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8), max_size=4),
    st.fixed_dictionaries({"__metadata__": st.dictionaries(st.text(max_size=30), st.text(max_size=60), max_size=4)}),
)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(header=fuzzed_headers, declared_extra=st.integers(min_value=-16, max_value=1 << 40),
       tail=st.binary(max_size=64))
def test_fuzzed_safetensors_headers_are_4xx_never_5xx(hostile, header, declared_extra, tail):
    server, root, _, _, _ = hostile
    raw = json.dumps(header).encode()
    # Small offsets: a length near the truth; big ones: a header claiming up to a terabyte.
    declared = max(0, len(raw) + declared_extra if abs(declared_extra) < 64 else declared_extra)
    path = root / f"fuzz-{abs(hash((raw, declared, tail)))}.safetensors"
    path.write_bytes(declared.to_bytes(8, "little") + raw + tail)
    response = post(server.url, body({"identity": str(path)}), timeout=60)
    assert response.status_code in (404, 413, 422), (response.status_code, response.text[:300])
    assert "error" in response.json()


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(metadata=st.dictionaries(
    st.sampled_from(["transformer.r", "transformer.lora_alpha", "transformer.rank_pattern", "transformer.alpha_pattern",
                     "transformer.target_modules", "transformer.use_dora", "transformer.base_model_name_or_path",
                     "transformer.use_rslora", "transformer.init_lora_weights", "junk"]),
    st.one_of(st.none(), st.integers(-5, 10**12), st.floats(allow_nan=True), st.text(max_size=30),
              st.dictionaries(st.text(max_size=20), st.integers(-3, 64), max_size=3)), max_size=5))
def test_fuzzed_lora_metadata_is_served_or_refused_never_a_fault(hostile, metadata):
    server, root, _, good, _ = hostile
    data = save(good, metadata={"lora_adapter_metadata": json.dumps(metadata)})
    path = root / f"meta-{abs(hash(data))}.safetensors"
    path.write_bytes(data)
    response = post(server.url, body({"identity": str(path)}), timeout=60)
    assert response.status_code in (200, 422), (metadata, response.status_code, response.text[:300])


SOAK_S = 20.0  # offered load time; every request also has a client timeout
CLIENTS = 16  # against 1 running + 4 queued: ~4x what the server holds


def test_overload_soak(hostile, tiny_models):
    """Good, bad, cold and slow-drip requests from 16 clients for SOAK_S: every request ends in
    images or a clear 4xx/429/502/503, none hangs, none is a 5xx fault; memory stays bounded; 0
    rebuilds, 0 recompiles; each good 200 equals that request alone afterwards."""
    server, root, linears, good, drip_url = hostile
    goods = [((str(root / f"trained-{i}"), 0.6 + 0.2 * i), None, i) for i in range(4)]
    cold_dir = root / "cold"
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.2):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    counter = iter(range(10**6))
    lock = threading.Lock()
    records = []

    def one(kind, index):
        if kind == "good":
            identity, style, seed = goods[index % len(goods)]
            return generate(server.url, identity, style, n=2, seed=seed, num_inference_steps=STEPS)
        if kind == "cold":  # a new user's adapter, written as diffusers' training scripts write it
            path = save_diffusers_lora(cold_dir / f"user-{index}", "flux", random_lora(linears, 4, seed=index),
                                       rank=4, alpha=8)
            return post(server.url, body({"identity": str(path)}))
        if kind == "drip":
            return post(server.url, body({"style": f"{drip_url}/soak-{index}.safetensors"}))
        bad = [body({"style": {"ref": str(root / "trained-1"), "scale": 1e30}}),
               body({"identity": str(root / "huge.safetensors")}), body({"identity": str(root / "overflowing.safetensors")}),
               body(width=64, height=32), body({"face": "x"}), body({"identity": str(root / "missing.safetensors")})]
        return post(server.url, bad[index % len(bad)])

    kinds = ["good"] * 8 + ["cold"] * 3 + ["bad"] * 6 + ["drip"] * 2

    def client(seed):
        rng = random.Random(seed)
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            kind = rng.choice(kinds)
            with lock:
                index = next(counter)
            began = time.perf_counter()
            try:
                response = one(kind, index)
                outcome = response.status_code
            except httpx.TimeoutException:
                outcome = "hang"
                response = None
            records.append({"kind": kind, "index": index, "status": outcome, "s": time.perf_counter() - began,
                            "response": response if kind == "good" and outcome == 200 else None})

    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    stop.set()
    sampler.join(timeout=5)

    statuses = {}
    for record in records:
        statuses.setdefault(record["kind"], {}).setdefault(str(record["status"]), 0)
        statuses[record["kind"]][str(record["status"])] += 1
    latencies = sorted(r["s"] for r in records if r["status"] == 200)
    figures = {
        "requests": len(records), "clients": CLIENTS, "offered_s": SOAK_S, "outcomes": statuses,
        "ok_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "ok_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
        "all_p99_s": round(sorted(r["s"] for r in records)[int(0.99 * (len(records) - 1))], 3),
        "rss_baseline_mib": baseline >> 20, "rss_peak_mib": peak[0] >> 20,
    }
    print("soak figures:", json.dumps(figures))
    if os.environ.get("HOTLORA_SOAK_REPORT"):
        with open(os.environ["HOTLORA_SOAK_REPORT"], "w") as out:
            json.dump(figures, out, indent=2)

    assert all(r["status"] != "hang" for r in records), "a request hung"
    allowed = {"good": {200, 429}, "cold": {200, 429}, "bad": {403, 404, 422, 429}, "drip": {429, 502}}
    for record in records:
        assert record["status"] in allowed[record["kind"]], record
    assert statuses["good"].get("200", 0) > 0
    assert peak[0] - baseline < 2 * 1024**3, figures  # bounded: the RAM tier and the queue are capped
    assert metric(server.url, "hotlora_engine_rebuilds_total") == 0
    assert metric(server.url, "hotlora_recompiles_total") == 0
    alone = {}
    for record in records:  # every good image equals that request alone
        if record["response"] is not None:
            which = record["index"] % len(goods)
            if which not in alone:
                identity, style, seed = goods[which]
                alone[which] = pixels(generate(server.url, identity, style, n=2, seed=seed, num_inference_steps=STEPS))
            assert np.abs(pixels(record["response"]).astype(int) - alone[which].astype(int)).max() <= 1, record["index"]
