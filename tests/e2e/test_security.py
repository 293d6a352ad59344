"""Issue 15 against a real ``hotlora serve`` (tiny Flux, not compiled): a server its clients cannot turn
against its host or each other. Two servers for the whole module: ``open_server`` as ``make serve``
runs it (loopback, no keys) and ``keyed_server`` with API keys (two tenants, a metrics scraper, an
admin). Adapters come from a local plain-http source whose URLs carry presigned-looking signatures,
so every response and log line can be searched for them."""

import hashlib
import http.server
import io
import logging
import threading
import time

import httpx
import pytest
from PIL import Image

from ..helpers import GENERATE_STEPS

EVIL = "http://evil.example"
SECRETS = ("SIGALICE", "SIGBOB", "SIGFAIL", "SIGCAT")
KEYS = {"alice": "hlk_alice-0123456789abcdef", "bob": "hlk_bob-0123456789abcdef",
        "scraper": "hlk_scraper-0123456789abcdef", "root": "hlk_root-0123456789abcdef"}


def key_line(name, scopes, sources=()):
    """A keys-file line as documented: the key's sha256, never the key."""
    line = f"sha256:{hashlib.sha256(KEYS[name].encode()).hexdigest()} name={name} scopes={','.join(scopes)}"
    return line + (f" sources={','.join(sources)}" if sources else "")


def bearer(name):
    return {"authorization": f"Bearer {KEYS[name]}"}


class Files(http.server.BaseHTTPRequestHandler):
    """GET of the files in ``server.files`` (no ETag, so identical bytes are one content-addressed
    cache entry whatever the URL); every requested path is recorded."""

    def do_HEAD(self):
        self.send_response(405)
        self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0]
        self.server.requested.append(path)
        body = self.server.files.get(path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def source(tiny_models):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    server.daemon_threads = True
    same = (tiny_models["flux"] / "adapters" / "style-kohya.safetensors").read_bytes()
    server.files = {"/tenant-a/portrait.safetensors": same, "/tenant-b/mine.safetensors": same}
    server.requested = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()  # a fetch still retrying is refused at once, not left to time out


@pytest.fixture
def hf_client(monkeypatch):
    """huggingface_hub's InferenceClient; the suite runs with HF_HUB_OFFLINE=1, which it would also apply
    to a server on 127.0.0.1."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    return InferenceClient


def start(tiny_models, tmp_path_factory, start_server, **overrides):
    adapters = tiny_models["flux"] / "adapters"
    return start_server(tiny_models["flux"], tmp_path_factory.mktemp("security"), roots=(adapters,),
                        catalog=str(adapters / "catalog.toml"), compile=False,
                        store_overrides={"allow_http": True, "allowed_hosts": ("127.0.0.1",)}, **overrides)


@pytest.fixture(scope="module")
def open_server(tiny_models, tmp_path_factory, start_server):
    return start(tiny_models, tmp_path_factory, start_server)


@pytest.fixture(scope="module")
def keyed_server(tiny_models, tmp_path_factory, start_server, source):
    lines = [key_line("alice", ["generate", "prefetch"], [f"{source.url}/tenant-a/", "catalog:"]),
             key_line("bob", ["generate"], [f"{source.url}/tenant-b/"]),
             key_line("scraper", ["metrics"]),
             key_line("root", ["admin"])]
    return start(tiny_models, tmp_path_factory, start_server, auth="on", api_keys="\n".join(lines))


def body(adapters=None, **extra):
    return {"prompt": "a portrait", "adapters": adapters or {}, "num_images": 1, "seed": 0,
            "num_inference_steps": GENERATE_STEPS, **extra}


def assert_no_secrets(*texts):
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret} leaked: {text[:300]}"


# --- browsers: a page the user opens must not be able to drive a loopback server -------------------


def test_a_cross_site_text_plain_post_cannot_generate(open_server):
    url = open_server.url
    forged = '{"inputs": "a cat", "parameters": {"num_inference_steps": 2}}'
    # Measured in issue 15: this returned an image.
    attack = httpx.post(f"{url}/", content=forged, headers={"content-type": "text/plain", "origin": EVIL}, timeout=60)
    assert attack.status_code == 403 and attack.json()["type"] == "CrossOriginRefused"
    assert "access-control-allow-origin" not in attack.headers
    # Without an Origin header (a client that hides it), a form-able body is still not a request.
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        refused = httpx.post(f"{url}/", content=forged, headers=headers, timeout=60)
        assert refused.status_code == 415 and refused.json()["type"] == "UnsupportedMediaType", headers
    raw = httpx.post(f"{url}/", content="a cat", headers={"content-type": "text/plain"}, timeout=60)
    assert raw.status_code == 415 and "application/json" in raw.json()["error"]
    # The JSON API: a body without a content type is JSON to FastAPI, and a page can send one.
    blob = httpx.post(f"{url}/v1/generate", content=httpx.Request("POST", url, json=body()).content,
                      headers={"origin": EVIL}, timeout=60)
    assert blob.status_code == 403
    # DNS rebinding: the page's own name, resolved to 127.0.0.1, arrives as the Host header.
    port = url.rsplit(":", 1)[1]
    for path in ("/v1/adapters", "/readyz"):
        assert httpx.get(f"{url}{path}", headers={"host": f"evil.example:{port}"}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(f"{url}/healthz", headers={"host": host}).status_code == 200


def test_real_clients_and_the_playground_still_work_without_keys(open_server, hf_client):
    url = open_server.url
    image = hf_client(model=url, timeout=120).text_to_image("a dog", num_inference_steps=2)
    assert image.size[0] > 0
    as_json = httpx.post(f"{url}/", json={"inputs": "a dog", "parameters": {"num_inference_steps": 2}}, timeout=120)
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "image/png"
    # curl -d 'a dog' -H 'lora: ...': the custom header is one no page can send without asking first.
    curl = httpx.post(f"{url}/", content="a dog", timeout=120,
                      headers={"lora": "style-xlabs", "content-type": "application/x-www-form-urlencoded"})
    assert curl.status_code == 200
    Image.open(io.BytesIO(curl.content)).verify()
    # The playground posts from its own origin.
    same_origin = httpx.post(f"{url}/v1/generate", json=body({"style": "style-kohya"}), headers={"origin": url},
                             timeout=120)
    assert same_origin.status_code == 200, same_origin.text
    assert "access-control-allow-origin" not in same_origin.headers


def test_readyz_and_the_listing_show_the_model_id_not_its_path(open_server, keyed_server, tiny_models):
    model_dir = str(tiny_models["flux"])
    for server in (open_server, keyed_server):
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 200 and ready.json()["engine"]["model"] == "hotlora/tiny-flux"
        assert model_dir not in ready.text
    listing = httpx.get(f"{open_server.url}/v1/adapters").json()
    assert {e["name"] for e in listing["catalog"]} >= {"style-kohya", "identity-peft"}
    assert model_dir not in str(listing["catalog"])


def test_prefetch_answers_and_logs_never_echo_presigned_urls(open_server, source, caplog):
    caplog.set_level(logging.INFO)
    url = open_server.url
    refs = [f"{source.url}/tenant-a/gone.safetensors?X-Amz-Signature=SIGFAIL&X-Amz-Credential=SIGFAIL"]
    accepted = httpx.post(f"{url}/v1/adapters/prefetch", json={"refs": refs})
    assert accepted.status_code == 202
    assert accepted.json()["accepted"] == [f"{source.url}/tenant-a/gone.safetensors?<redacted>"]
    for _ in range(200):
        if any("gone.safetensors" in r.getMessage() for r in caplog.records):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the failed prefetch was never logged")
    assert_no_secrets(accepted.text, *(r.getMessage() for r in caplog.records))


def test_malformed_references_are_a_422_on_every_route_and_the_connection_lives_on(open_server):
    """Issue 24: a port out of range was a 500 (ValueError), a tab or CR/LF one too (httpx's
    InvalidURL), and the 500 closed the keep-alive connection unannounced. Each is now a 422 in the
    route's error shape, and one keep-alive client goes on using its connection."""
    malformed = ["http://127.0.0.1:99999/x.safetensors?X-Amz-Signature=SIGFAIL", "http://127.0.0.1:0/x.safetensors",
                 "https://adapters.example/a\tb.safetensors?sig=SIGFAIL", "https://adapters.example/x\r\nInjected: 1",
                 "https://[::1/x.safetensors", "https://xn--/x.safetensors", "s3://bucket:99999/x.safetensors"]
    with httpx.Client(base_url=open_server.url, timeout=60) as client:
        for ref in malformed:
            calls = [("/v1/generate", {"json": body({"identity": ref})}),
                     ("/v1/images/generations", {"json": {"prompt": "a cat", "adapters": {"identity": ref}}}),
                     ("/v1/adapters/prefetch", {"json": {"refs": [ref]}})]
            if not any(c in ref for c in "\t\r\n"):  # no client sends those in a header
                calls.append(("/", {"json": {"inputs": "a cat", "parameters": {"num_inference_steps": 2}},
                                    "headers": {"lora": ref}}))
            for path, kwargs in calls:
                response = client.post(path, **kwargs)
                assert response.status_code == 422, (path, ref, response.text)
                assert "connection" not in response.headers or response.headers["connection"] != "close"
                error = response.json()["error"] if path.startswith("/v1/images") else response.json()
                assert error["type"] == "InvalidReference", (path, ref, response.text)
                assert_no_secrets(response.text)
                assert client.get("/healthz").status_code == 200  # the same keep-alive client, next request
        listing = client.get("/v1/adapters").json()
        assert not any("SIGFAIL" in str(entry) for entry in listing["cached"])


# --- keys, scopes, source prefixes --------------------------------------------------------------


def test_every_api_needs_a_key_and_health_stays_open(keyed_server):
    url = keyed_server.url
    calls = [("post", "/v1/generate", {"json": body()}), ("post", "/v1/generate/stream", {"json": body()}),
             ("post", "/", {"json": {"inputs": "a cat"}}),
             ("post", "/models/hotlora/tiny-flux", {"json": {"inputs": "x"}}),
             ("post", "/v1/images/generations", {"json": {"prompt": "a cat"}}), ("get", "/v1/adapters", {}),
             ("post", "/v1/adapters/prefetch", {"json": {"refs": ["style-kohya"]}}), ("get", "/metrics", {})]
    for method, path, kwargs in calls:
        for headers in ({}, {"authorization": "Bearer hlk_wrong"}, {"authorization": KEYS["alice"]},
                        {"authorization": f"Basic {KEYS['alice']}"}):
            response = httpx.request(method, f"{url}{path}", headers=headers, timeout=60, **kwargs)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.headers["www-authenticate"].startswith("Bearer")
            error = response.json()["error"]
            kind = error["type"] if path.startswith("/v1/images") else response.json()["type"]
            assert kind == "Unauthorized", response.text
            assert KEYS["alice"] not in response.text
    for path in ("/healthz", "/readyz"):
        assert httpx.get(f"{url}{path}").status_code == 200
    assert httpx.get(url, headers={"accept": "text/html"}).status_code == 200  # the page itself; it asks for a key


def test_scopes(keyed_server):
    url = keyed_server.url
    assert httpx.get(f"{url}/metrics", headers=bearer("alice")).status_code == 403
    scraped = httpx.get(f"{url}/metrics", headers=bearer("scraper"))
    assert scraped.status_code == 200 and "hotlora_requests_total" in scraped.text
    assert httpx.get(f"{url}/metrics", headers=bearer("root")).status_code == 200
    refused = httpx.post(f"{url}/v1/generate", json=body(), headers=bearer("scraper"))
    assert refused.status_code == 403 and refused.json()["type"] == "Forbidden"
    assert "generate" in refused.json()["error"]
    openai = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x"}, headers=bearer("scraper"))
    assert openai.status_code == 403 and openai.json()["error"]["type"] == "Forbidden"
    assert httpx.post(f"{url}/v1/adapters/prefetch", json={"refs": ["x"]}, headers=bearer("bob")).status_code == 403
    ok = httpx.post(f"{url}/v1/generate", json=body({"style": "style-kohya"}), headers=bearer("alice"), timeout=120)
    assert ok.status_code == 200, ok.text


def test_a_keys_sources_are_enforced_before_any_fetch(keyed_server, source):
    url, base = keyed_server.url, source.url
    before = len(source.requested)
    for ref in (f"{base}/tenant-a/portrait.safetensors", f"{base}/tenant-b/../tenant-a/portrait.safetensors",
                f"{base}/tenant-b/%2e%2e/tenant-a/portrait.safetensors", f"{base}/tenant-bb/x.safetensors",
                f"{base.replace('127.0.0.1', 'localhost')}/tenant-b/mine.safetensors",
                "style-kohya", "catalog:style-kohya", "/etc/hostname", "hf://someone/else"):
        refused = httpx.post(f"{url}/v1/generate", json=body({"identity": ref}), headers=bearer("bob"))
        assert refused.status_code == 403 and refused.json()["type"] == "Forbidden", (ref, refused.text)
        if "tenant-b" not in ref:  # the key's own prefixes are the operator's to read, in the log
            assert "tenant-b" not in refused.text, refused.text
        header = httpx.post(f"{url}/", json={"inputs": "x"}, headers={**bearer("bob"), "lora": ref})
        assert header.status_code == 403, ref
    prefetch = httpx.post(f"{url}/v1/adapters/prefetch", json={"refs": [f"{base}/tenant-b/mine.safetensors"]},
                          headers=bearer("alice"))
    assert prefetch.status_code == 403
    assert len(source.requested) == before, source.requested[before:]  # nothing was fetched


def test_tenants_see_only_their_own_references(keyed_server, source, caplog, hf_client):
    caplog.set_level(logging.INFO)
    url, base = keyed_server.url, source.url
    alice_ref = f"{base}/tenant-a/portrait.safetensors?X-Amz-Signature=SIGALICE"
    bob_ref = f"{base}/tenant-b/mine.safetensors?X-Amz-Signature=SIGBOB"
    first = httpx.post(f"{url}/v1/generate", json=body({"identity": alice_ref}), headers=bearer("alice"), timeout=120)
    assert first.status_code == 200, first.text
    # The same bytes under bob's own URL: a content-addressed hit on alice's cache entry.
    second = httpx.post(f"{url}/v1/generate", json=body({"identity": bob_ref}), headers=bearer("bob"), timeout=120)
    assert second.status_code == 200, second.text
    assert second.json()["adapters"]["identity"]["sha256"] == first.json()["adapters"]["identity"]["sha256"]
    assert "tenant-b/mine" in second.json()["adapters"]["identity"]["name"] and "tenant-a" not in second.text
    assert "tenant-a/portrait" in first.json()["adapters"]["identity"]["name"]

    alice = httpx.get(f"{url}/v1/adapters", headers=bearer("alice")).json()
    bob = httpx.get(f"{url}/v1/adapters", headers=bearer("bob")).json()
    assert [a["name"] for a in alice["cached"]] == [f"{base}/tenant-a/portrait.safetensors?<redacted>"]
    assert [a["name"] for a in bob["cached"]] == [f"{base}/tenant-b/mine.safetensors?<redacted>"]
    assert "tenant-b" not in str(alice) and "tenant-a" not in str(bob)
    assert {e["name"] for e in bob["catalog"]} >= {"style-kohya"}  # the catalog is everyone's
    everything = httpx.get(f"{url}/v1/adapters", headers=bearer("root")).json()
    assert len(everything["cached"]) > len(alice["cached"]) and everything["stats"] is not None
    # The Hugging Face client sends its token as a Bearer key.
    image = hf_client(model=url, token=KEYS["alice"], timeout=120).text_to_image("a dog", num_inference_steps=2)
    assert image.size[0] > 0
    assert_no_secrets(first.text, second.text, str(alice), str(bob), str(everything),
                      *(r.getMessage() for r in caplog.records))


# --- planted secrets: nothing a run touched may reach a log line or a response -------------------

PLANTED = {"AWS_ACCESS_KEY_ID": "AKIAPLANTED00000001", "AWS_SECRET_ACCESS_KEY": "planted/Secret+Key0002",
           "HF_TOKEN": "hf_PlantedToken00000003"}


@pytest.fixture
def moto_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    from ..helpers import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {**PLANTED, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_a_run_with_presigned_urls_an_hf_token_and_aws_keys_leaks_none_of_them(
        tiny_models, tmp_path_factory, start_server, source, moto_endpoint, caplog):
    import boto3

    caplog.set_level(logging.INFO)  # what `hotlora serve -v` shows
    adapters = tiny_models["flux"] / "adapters"
    adapter = (adapters / "style-kohya.safetensors").read_bytes()
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="loras")
    boto3.client("s3", endpoint_url=moto_endpoint).put_object(Bucket="loras", Key="u1/style.safetensors",
                                                              Body=adapter)
    api_key = KEYS["root"]
    server = start_server(tiny_models["flux"], tmp_path_factory.mktemp("secrets"), roots=(adapters,), compile=False,
                          auth="on", api_keys=key_line("root", ["admin"]),
                          store_overrides={"allow_http": True, "allowed_hosts": ("127.0.0.1",),
                                           "allowed_s3": ("loras",), "s3_endpoint_url": moto_endpoint,
                                           "allowed_hub_repos": ("someone/*",)})
    presigned = f"{source.url}/tenant-a/portrait.safetensors?X-Amz-Signature=SIGALICE&X-Amz-Credential=SIGBOB"
    refs = [presigned, "s3://loras/u1/style.safetensors", "s3://loras/u1/gone.safetensors",
            "s3://private/x.safetensors", "hf://someone/lora/pytorch_lora_weights.safetensors",
            f"{source.url}/nowhere.safetensors?token=SIGFAIL"]
    texts = []
    with httpx.Client(base_url=server.url, headers=bearer("root"), timeout=120) as client:
        for ref in refs:
            answer = client.post("/v1/generate", json=body({"style": ref}))
            texts.append(answer.text)
            assert answer.status_code in (200, 403, 404, 422, 502, 503), (ref, answer.text)
        texts.append(client.post("/v1/adapters/prefetch", json={"refs": refs}).text)
        texts.append(client.get("/v1/adapters").text)
        texts.append(client.get("/metrics").text)
        texts.append(client.get("/readyz").text)
    assert all('"images"' in t for t in texts[:2]), texts[:2]  # the presigned and the S3 adapters were used
    time.sleep(1.0)  # the prefetches' failures are logged from the fetch pool
    secrets = [*PLANTED.values(), api_key, "SIGALICE", "SIGBOB", "SIGFAIL"]
    # werkzeug is the stand-in S3 provider's own access log (the far end, which is given the signature).
    logged = [r.getMessage() for r in caplog.records if r.name != "werkzeug"]
    assert any("s3://loras/u1/gone.safetensors" in line for line in logged)  # the failures were logged
    for text in [*texts, *logged]:
        for secret in secrets:
            assert secret not in text, f"{secret!r} leaked in: {text[:300]}"
