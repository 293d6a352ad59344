"""API keys, scopes, source prefixes, tenancy and the browser guards, without an engine: the pure
parts directly, the app through Starlette's TestClient over a stand-in worker. The e2e module
``tests/e2e/test_security.py`` drives the same against a real server."""

import hashlib
import logging
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from hotlora.adapters.store.references import UnsafeReference
from hotlora.cli import build_parser, main, serve_settings
from hotlora.settings import ServerConfig
from hotlora.server.access import Access, public_model
from hotlora.server.app import create_app
from hotlora.server.auth import (ANONYMOUS, AuthConfigError, Forbidden, Keyring, canonical_reference, is_loopback,
                                 keyring_for, new_key)
from hotlora.server.errors import status_of
from hotlora.server.logs import RedactURLs
from hotlora.server.run import Serving

KEY = "hlk_unit-test-key"


def line(key=KEY, extra=""):
    return f"sha256:{hashlib.sha256(key.encode()).hexdigest()} {extra}".strip()


class Idle:
    """What the app reads of a worker whose engine never comes up (or a stand-in engine)."""

    def __init__(self, engine=None):
        self.engine, self.failed = engine, None
        self.ready = engine is not None
        self.depth = self.rebuilds = self.batches = self.retired_recompiles = 0
        self.max_queue = 16
        self.on_event = None
        self.restarts, self.last_exit = {}, None

    crash_loop_delay_s = 0.0

    def why_not_ready(self):
        return "the engine is not ready (starting, rebuilding or shutting down)"

    def not_ready(self):
        from hotlora.errors import NotAccepting

        return NotAccepting(self.why_not_ready())


def client(worker=None, base_url="http://127.0.0.1:8000", **settings):
    app = create_app(Serving(worker=worker or Idle()), ServerConfig(**settings), start_worker=False)
    return TestClient(app, raise_server_exceptions=False, base_url=base_url)


def keyed(**settings):
    keys = "\n".join([line(KEY, "name=alice scopes=generate sources=s3://tenant-a/,catalog:"),
                      line("hlk_admin", "name=root scopes=admin"), line("hlk_metrics", "name=prom scopes=metrics")])
    return client(auth="on", api_keys=keys, **settings)


def bearer(key=KEY):
    return {"authorization": f"Bearer {key}"}


# --- keys -----------------------------------------------------------------------------------------


def test_a_new_key_round_trips_through_its_line_and_only_its_hash_is_kept():
    key, entry = new_key("tenant-a", ["generate"], ["s3://tenant-a/"])
    assert key.startswith("hlk_") and key not in entry and len(key) > 40
    assert entry.startswith(f"sha256:{hashlib.sha256(key.encode()).hexdigest()} ")
    keyring = Keyring.parse(entry, "test")
    principal = keyring.authenticate(key)
    assert principal.name == "tenant-a" and principal.scopes == {"generate"}
    assert principal.sources == ("s3://tenant-a/",)
    assert keyring.authenticate(key + "x") is None and keyring.authenticate("") is None
    assert KEY not in repr(Keyring.parse(line(), "test").entries)
    assert new_key()[0] != new_key()[0]


def test_keys_lines_are_checked_and_never_echoed():
    with pytest.raises(AuthConfigError, match="entry 1: expected 'sha256") as raised:
        Keyring.parse("hlk_pasted-a-key-not-its-hash scopes=generate", "keys.txt")
    assert "pasted" not in str(raised.value)
    for bad, message in ((line(extra="scopes=root"), "scopes must be"), (line(extra="colour=red"), "unknown"),
                         (f"{line(extra='name=a')}\n{line('hlk_b', 'name=a')}", "unique")):
        with pytest.raises(AuthConfigError, match=message):
            Keyring.parse(bad, "keys.txt")
    several = Keyring.parse(f"# comment\n{line()} # alice\n\n{line('hlk_2')};{line('hlk_3')}", "env")
    assert len(several) == 3 and several.authenticate("hlk_3").scopes == {"generate", "prefetch"}


def test_when_keys_are_required(tmp_path, caplog):
    assert keyring_for(ServerConfig()) is None  # make serve: loopback, no keys
    assert keyring_for(ServerConfig(host="::1")) is None
    for settings in ({"host": "0.0.0.0"}, {"host": "10.1.2.3"}, {"auth": "on"}, {"host": "myhost.example"}):
        with pytest.raises(AuthConfigError, match="hotlora keys new"):
            keyring_for(ServerConfig(**settings))
    keys = tmp_path / "keys"
    keys.write_text(line() + "\n")
    assert len(keyring_for(ServerConfig(api_keys_file=str(keys)))) == 1  # keys configured: required on loopback too
    assert len(keyring_for(ServerConfig(host="0.0.0.0", api_keys_file=str(keys)))) == 1
    with pytest.raises(AuthConfigError, match="cannot read"):
        keyring_for(ServerConfig(api_keys_file=str(tmp_path / "missing")))
    with caplog.at_level(logging.WARNING):
        assert keyring_for(ServerConfig(host="0.0.0.0", auth="off")) is None
    assert "AUTHENTICATION IS OFF" in caplog.text
    with pytest.raises(AuthConfigError):
        create_app(Serving(worker=Idle()), ServerConfig(host="0.0.0.0"), start_worker=False)
    assert [is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "localhost", "[::1]", "0.0.0.0", "::", "")] == \
        [True, True, True, True, False, False, False]


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("HOTLORA_AUTH", "on")
    monkeypatch.setenv("HOTLORA_API_KEYS", f"{line()};{line('hlk_2')}")
    monkeypatch.setenv("HOTLORA_CORS_ORIGINS", "https://app.example,https://b.example")
    monkeypatch.setenv("HOTLORA_ALLOWED_HOST_HEADERS", "hotlora.example")
    config, _ = ServerConfig.load()
    assert config.auth == "on" and len(keyring_for(config)) == 2
    assert config.cors_origins == ("https://app.example", "https://b.example")
    assert config.allowed_host_headers == ("hotlora.example",)
    with pytest.raises(ValueError, match="auth must be"):
        ServerConfig(auth="maybe")


def test_key_lines_have_no_flag_only_the_environment_and_config_files(monkeypatch, tmp_path, capsys):
    # A flag's value is readable by every local user (ps, /proc/<pid>/cmdline): docs/security.md.
    flags = set(re.findall(r"--[a-z][a-z-]*", _serve_help(capsys)))
    assert "--api-keys-file" in flags and "--api-keys" not in flags
    for argv in (["serve", "--api-keys", line()], ["serve", f"--api-keys={line()}"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        error = capsys.readouterr().err
        assert "no such flag" in error and "HOTLORA_API_KEYS" in error and KEY not in error
    monkeypatch.setenv("HOTLORA_API_KEYS", line())
    config, _ = serve_settings(build_parser().parse_args(["serve"]))
    assert len(keyring_for(config)) == 1
    monkeypatch.delenv("HOTLORA_API_KEYS")
    (tmp_path / "serve.toml").write_text(f'[server]\napi_keys = "{line()};{line("hlk_2")}"\n')
    config, _ = serve_settings(build_parser().parse_args(["serve", "--config", str(tmp_path / "serve.toml")]))
    assert len(keyring_for(config)) == 2


def _serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return capsys.readouterr().out


# --- source prefixes ------------------------------------------------------------------------------


def test_source_prefixes_match_the_canonical_reference():
    alice = Keyring.parse(line(extra="sources=https://CDN.example/tenant-a/,s3://tenant-a/,hf://owner/repo/,catalog:"),
                          "t").authenticate(KEY)
    allowed = ["https://cdn.example/tenant-a/x.safetensors?X-Amz-Signature=s", "HTTPS://cdn.EXAMPLE/tenant-a/y",
               "s3://tenant-a/deep/x.safetensors", "hf://owner/repo", "hf://owner/repo@main/w.safetensors",
               "catalog:anything", "named-entry"]
    alice.check_references(allowed, catalog_names={"named-entry"})
    refused = ["https://cdn.example/tenant-b/x", "https://cdn.example/tenant-a/../tenant-b/x",
               "https://cdn.example/tenant-a/%2E%2E/tenant-b/x", "https://cdn.example/tenant-a/%252e%252e/b",
               "https://cdn.example.evil/tenant-a/x", "https://cdn.example@evil.example/tenant-a/x",
               "s3://tenant-ab/x", "s3://tenant-a/../tenant-b/x", "hf://owner/repo-evil", "hf://other/repo",
               "/srv/tenant-a/x.safetensors", "named-entry"]
    for ref in refused:
        with pytest.raises((Forbidden, UnsafeReference)) as raised:  # both 403; the parser refuses some itself
            alice.check_references([ref])
        assert "X-Amz" not in str(raised.value) and status_of(raised.value) == 403
    assert canonical_reference("https://h.example/k/./x") is None
    ANONYMOUS.check_references(refused)  # no sources: anything the store allows


def test_a_refusal_names_the_reference_not_the_keys_sources(caplog):
    caplog.set_level(logging.WARNING, logger="hotlora.server.auth")
    alice = Keyring.parse(line(extra="name=alice sources=s3://tenant-a/,https://cdn.example/tenant-a/"),
                          "t").authenticate(KEY)
    with pytest.raises(Forbidden) as raised:
        alice.check_references(["s3://tenant-b/x.safetensors"])
    message = str(raised.value)
    assert "s3://tenant-b/x.safetensors" in message
    assert "tenant-a" not in message and "cdn.example" not in message  # other paths of the key's: the log's
    assert any("tenant-a" in r.getMessage() and "alice" in r.getMessage() for r in caplog.records)


def test_a_source_prefix_that_is_not_a_url_is_a_start_up_error():
    for prefix in ("https://cdn.example:99999/a/", "https://[::1/a/"):
        with pytest.raises(AuthConfigError, match="sources= prefix"):
            Keyring.parse(line(extra=f"sources={prefix}"), "t")


MALFORMED = ["http://127.0.0.1:99999/x.safetensors", "https://h.example/a\tb", "https://h.example/x\r\nInjected: 1",
             "https://[::1/x", "s3://tenant-a:99999/x"]


def test_malformed_references_are_a_422_on_every_route_before_anything_else():
    # A key with sources: its references are parsed before the (not ready) worker's 503.
    c = client(auth="on", api_keys=line(KEY, "name=alice scopes=generate,prefetch sources=s3://tenant-a/"))
    for ref in MALFORMED:
        for path, kwargs in (("/v1/generate", {"json": {"prompt": "x", "adapters": {"identity": ref}}}),
                             ("/v1/images/generations", {"json": {"prompt": "x", "adapters": {"identity": ref}}}),
                             ("/v1/adapters/prefetch", {"json": {"refs": [ref]}})):
            response = c.post(path, headers=bearer(), **kwargs)
            assert response.status_code == 422, (path, ref, response.text)
            error = response.json()["error"] if path.startswith("/v1/images") else response.json()
            assert error["type"] == "InvalidReference", (path, ref, response.text)
        if "\r" not in ref and "\t" not in ref:  # a header cannot carry those at all
            header = c.post("/", json={"inputs": "x"}, headers={**bearer(), "lora": ref})
            assert header.status_code == 422 and header.json()["type"] == "InvalidReference", (ref, header.text)


# --- the app: 401, 403, Host, Origin, CORS, content types -------------------------------------------


def test_missing_and_unknown_keys_are_401_in_each_apis_shape():
    c = keyed()
    for headers in ({}, bearer("hlk_nope"), {"authorization": KEY}):
        response = c.post("/v1/generate", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["type"] == "Unauthorized"
        openai = c.post("/v1/images/generations", json={"prompt": "x"}, headers=headers)
        assert openai.status_code == 401 and openai.json()["error"]["type"] == "Unauthorized"
    assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 503  # open, not ready
    assert c.get("/", headers={"accept": "text/html"}).status_code == 200


def test_scopes_and_sources_are_checked_before_anything_else():
    c = keyed()
    assert c.get("/metrics", headers=bearer()).status_code == 403
    assert c.get("/metrics", headers=bearer("hlk_metrics")).status_code == 200
    assert c.get("/metrics", headers=bearer("hlk_admin")).status_code == 200
    assert c.post("/v1/generate", json={"prompt": "x"}, headers=bearer("hlk_metrics")).status_code == 403
    assert c.post("/v1/adapters/prefetch", json={"refs": ["s3://tenant-a/x"]}, headers=bearer()).status_code == 403
    # The worker is not ready (503): a reference outside the key's sources is refused before that.
    outside = c.post("/v1/generate", json={"prompt": "x", "adapters": {"identity": "s3://tenant-b/x"}},
                     headers=bearer())
    assert outside.status_code == 403 and outside.json()["type"] == "Forbidden"
    header = c.post("/", json={"inputs": "x"}, headers={**bearer(), "lora": "https://evil.example/x"})
    assert header.status_code == 403
    inside = c.post("/v1/generate", json={"prompt": "x", "adapters": {"identity": "s3://tenant-a/x"}}, headers=bearer())
    assert inside.status_code == 503
    listing = c.get("/v1/adapters", headers=bearer())
    assert listing.status_code == 200 and listing.json()["stats"] is None
    assert c.get("/v1/adapters", headers=bearer("hlk_metrics")).status_code == 403


def test_host_headers_origins_and_cors():
    c = client()  # loopback, no keys: loopback names only (DNS rebinding)
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert c.get("/healthz", headers={"host": host}).status_code == 200, host
    assert c.get("/healthz", headers={"host": "evil.example:8000"}).status_code == 400
    assert keyed().get("/healthz", headers={"host": "anything.example"}).status_code == 200  # keys required: any
    named = client(allowed_host_headers="hotlora.internal,*.example.org")
    assert named.get("/healthz", headers={"host": "hotlora.internal"}).status_code == 200
    assert named.get("/healthz", headers={"host": "a.example.org"}).status_code == 200
    assert named.get("/healthz", headers={"host": "localhost"}).status_code == 400

    cross = c.post("/v1/generate", json={"prompt": "x"}, headers={"origin": "http://evil.example"})
    assert cross.status_code == 403 and cross.json()["type"] == "CrossOriginRefused"
    assert "access-control-allow-origin" not in cross.headers
    assert c.post("/v1/generate", json={"prompt": "x"}, headers={"origin": "null"}).status_code == 403
    same = c.post("/v1/generate", json={"prompt": "x"}, headers={"origin": "http://127.0.0.1:8000"})
    assert same.status_code == 503  # through to the (not ready) worker
    assert c.options("/v1/generate", headers={"origin": "http://evil.example",
                                              "access-control-request-method": "POST"}).status_code == 405

    cors = client(cors_origins="https://app.example")
    preflight = cors.options("/v1/generate", headers={"origin": "https://app.example",
                                                     "access-control-request-method": "POST",
                                                     "access-control-request-headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
    allowed = cors.post("/v1/generate", json={"prompt": "x"}, headers={"origin": "https://app.example"})
    assert allowed.status_code == 503 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = cors.post("/v1/generate", json={"prompt": "x"}, headers={"origin": "https://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_post_root_reads_json_only_when_labelled_and_raw_prompts_only_when_unforgeable():
    c = client()
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "multipart/form-data; boundary=x"}, {}):
        assert c.post("/", content=b"a cat", headers=headers).status_code == 415, headers
    labelled = c.post("/", content=b'{"inputs": "a cat"}', headers={"content-type": "text/plain", "lora": "x"})
    assert labelled.status_code == 415 and "application/json" in labelled.json()["error"]
    for headers in ({"content-type": "application/json"}, {"content-type": "application/vnd.api+json"}):
        assert c.post("/", content=b'{"inputs": "a cat"}', headers=headers).status_code == 503
    for headers in ({"content-type": "text/plain", "lora": "x"}, {"content-type": "text/x-prompt"},
                    {"authorization": "Bearer whatever"}):
        assert c.post("/", content=b"a cat", headers=headers).status_code == 503, headers


# --- what is shown: the model's id, each caller's own adapters, no signatures in logs ------------------


def test_readyz_names_the_model_by_its_id(tmp_path):
    def engine(model, defaults):
        return SimpleNamespace(describe=lambda: {"model": model, "family": "flux"}, defaults=defaults, recompiles=0,
                               active_adapters=0)

    assert public_model(engine(str(tmp_path), {"model_id": "hotlora/tiny-flux"}))["model"] == "hotlora/tiny-flux"
    assert public_model(engine(str(tmp_path), {}))["model"] == tmp_path.name
    assert public_model(engine("org/hub-model", {}))["model"] == "org/hub-model"
    ready = client(Idle(engine(str(tmp_path), {"model_id": "hotlora/tiny-flux"}))).get("/readyz")
    assert ready.json()["engine"]["model"] == "hotlora/tiny-flux" and str(tmp_path) not in ready.text


def test_each_caller_sees_only_its_own_adapters_under_its_own_names(tmp_path):
    from hotlora.families import family_named
    from hotlora.adapters.format.convert import load_adapter

    from ..helpers import write_lora

    access = Access(ServerConfig())
    first = load_adapter(write_lora(tmp_path / "a.safetensors"), family_named("flux"),
                         name="s3://tenant-a/secret-name.safetensors")
    store = SimpleNamespace(ram=SimpleNamespace(values=lambda: [first]), catalog={}, cached=lambda ref: None)
    alice = Keyring.parse(line(extra="name=alice"), "t").authenticate(KEY)
    bob = Keyring.parse(line("hlk_b", "name=bob"), "t").authenticate("hlk_b")
    assert access.named(alice, first, "s3://tenant-a/secret-name.safetensors") is first
    mine = access.named(bob, first, "https://b.example/mine.safetensors?X-Amz-Signature=SECRET")
    assert mine.name == "https://b.example/mine.safetensors?<redacted>" and first.name.startswith("s3://tenant-a")
    assert mine.__dict__["key"] == first.key and mine.modules is first.modules  # shared, not recomputed per request
    assert [a["name"] for a in access.cached(bob, store)] == ["https://b.example/mine.safetensors?<redacted>"]
    assert [a["name"] for a in access.cached(alice, store)] == ["s3://tenant-a/secret-name.safetensors"]
    carol = Keyring.parse(line("hlk_c", "name=carol"), "t").authenticate("hlk_c")
    assert access.cached(carol, store) == []
    assert [a["name"] for a in access.cached(ANONYMOUS, store)] == ["s3://tenant-a/secret-name.safetensors"]


def test_library_log_records_lose_url_credentials():
    record = logging.LogRecord("httpx", logging.INFO, __file__, 1, 'HTTP Request: %s %s "%s %d %s"',
                               ("GET", "https://h.example/a.safetensors?X-Amz-Signature=SECRET", "HTTP/1.1", 200, "OK"),
                               None)
    assert RedactURLs().filter(record) and "SECRET" not in record.getMessage()
    assert "https://h.example/a.safetensors?<redacted>" in record.getMessage()


# --- the CLI ----------------------------------------------------------------------------------------


def test_keys_new_prints_the_key_once_and_its_line(capsys):
    assert main(["keys", "new", "--name", "scraper", "--scopes", "metrics"]) == 0
    key, entry = capsys.readouterr().out.strip().splitlines()
    principal = Keyring.parse(entry, "out").authenticate(key)
    assert principal.name == "scraper" and principal.scopes == {"metrics"}
    assert main(["keys", "new", "--scopes", "everything"]) == 2


def test_serve_on_a_public_address_without_keys_refuses_to_start(capsys, monkeypatch):
    monkeypatch.delenv("HOTLORA_API_KEYS", raising=False)
    monkeypatch.delenv("HOTLORA_AUTH", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "needs API keys" in capsys.readouterr().err
