"""The store under a hostile client: references that try to read outside what the server serves,
to reach internal hosts, to use the server's credentials, or to learn about what is behind it.
Each is refused with nothing read, against real local servers; good references keep working.

Servers here listen on 127.0.0.1, which the egress policy refuses unless listed: tests that need
them list ``127.0.0.1`` (or ``127.0.0.1:PORT``) in ``allowed_hosts``, as the policy documents."""

import hashlib
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from hotlora.families import family_named
from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.store.references import UnsafeReference, parse_reference
from hotlora.adapters.store import AdapterStore
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterFormatError, AdapterNotFound, SourceUnavailable

from ..helpers import reply, serving_app as serving, write_lora

FLUX = family_named("flux")
SLACK_S = 5.0  # what a deadline may be overrun by on a busy 2-core machine (the drips last 20 s and more)


def make_store(tmp_path, roots=(), **overrides):
    overrides.setdefault("backoff_s", 0.01)
    return AdapterStore(StoreConfig(cache_dir=tmp_path / "cache", local_roots=tuple(roots), **overrides), FLUX)


def downloads_left(tmp_path) -> list:
    return list((tmp_path / "cache" / "downloads").iterdir())


# ----------------------------------------------------------------------------- what the test servers send


def drip(handler, total, every_s, stop):
    """A body that arrives one byte per ``every_s``: each read succeeds, only a total deadline ends it."""
    handler.send_response(200)
    handler.send_header("Content-Length", str(total))
    handler.end_headers()
    for _ in range(total):
        if stop.is_set():
            return
        try:
            handler.wfile.write(b"\0")
            handler.wfile.flush()
        except OSError:
            return
        time.sleep(every_s)


@pytest.fixture
def lora(tmp_path):
    return write_lora(tmp_path / "files" / "lora.safetensors", seed=3)


@pytest.fixture
def files(lora):
    """Serves the LoRA at /lora.safetensors; records every request."""

    def app(handler, method):
        if handler.path.split("?")[0] == "/lora.safetensors":
            data = lora.read_bytes()
            reply(handler, 200, data, {"ETag": '"' + hashlib.md5(data).hexdigest() + '"'}, head=method == "HEAD")
        else:
            reply(handler, 404, b"nothing here", head=method == "HEAD")

    with serving(app) as (server, url):
        yield server, url


# ----------------------------------------------------------------------------- local references


def test_local_references_never_default_to_the_working_directory(tmp_path, monkeypatch, lora):
    monkeypatch.chdir(lora.parent)  # a client naming files of the server's working directory
    store = make_store(tmp_path)  # StoreConfig's default local_roots
    for ref in ["lora.safetensors", str(lora), f"file://{lora}", ".venv/x.safetensors"]:
        with pytest.raises(UnsafeReference):
            store.get(ref)
    assert store.remote.fetches == 0 and store.disk.keys() == []


def test_the_catalogs_folder_is_a_root_and_nothing_beside_it(tmp_path, lora):
    folder = tmp_path / "catalog"
    write_lora(folder / "listed.safetensors", seed=1)
    write_lora(folder / "unlisted.safetensors", seed=2)
    (folder / "catalog.toml").write_text('[adapters.listed]\nref = "listed.safetensors"\n')
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache"), FLUX, catalog=folder / "catalog.toml")
    assert store.precache_catalog() == {}
    assert store.get(str(folder / "unlisted.safetensors")).modules  # inside the catalog's folder
    with pytest.raises(UnsafeReference):
        store.get(str(lora))  # anywhere else


def test_links_inside_an_adapter_directory_are_refused(tmp_path, lora):
    root = tmp_path / "root"
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 2, "base_model_name_or_path": "x"}')
    (secret / "README.md").write_text("---\nbase_model: secret/model\n---\n")
    write_lora(secret / "weights.safetensors", seed=9)

    linked_config = root / "linked-config"
    write_lora(linked_config / "adapter_model.safetensors", seed=1)
    (linked_config / "adapter_config.json").symlink_to(secret / "adapter_config.json")
    linked_card = root / "linked-card"
    write_lora(linked_card / "pytorch_lora_weights.safetensors", seed=1)
    (linked_card / "README.md").symlink_to(secret / "README.md")
    linked_weights = root / "linked-weights"
    linked_weights.mkdir(parents=True)
    (linked_weights / "pytorch_lora_weights.safetensors").symlink_to(secret / "weights.safetensors")
    inner = root / "inner-link"  # a link that stays inside the roots is fine
    inner.mkdir()
    (inner / "pytorch_lora_weights.safetensors").symlink_to(linked_config / "adapter_model.safetensors")

    store = make_store(tmp_path, [root])
    for ref in ["linked-config", "linked-config/adapter_model.safetensors", "linked-card", "linked-weights",
                str(linked_weights / "pytorch_lora_weights.safetensors")]:
        with pytest.raises(UnsafeReference) as info:
            store.get(ref)
        shown = str(info.value).replace(ref, "<ref>")  # the reference as the client wrote it may be shown
        assert str(secret) not in shown and str(root) not in shown, shown
    assert store.disk.keys() == []
    assert store.get("inner-link").modules


def test_local_errors_name_the_reference_as_written_never_where_it_resolved(tmp_path, lora):
    root = tmp_path / "root"
    write_lora(root / "good.safetensors")
    (root / "broken").mkdir()
    write_lora(root / "broken" / "adapter_model.safetensors")
    (root / "broken" / "adapter_config.json").write_text("{not json")
    store = make_store(tmp_path, [root])
    for ref, error in [("missing.safetensors", AdapterNotFound), ("broken", AdapterFormatError),
                       ("../secret.safetensors", UnsafeReference), (str(tmp_path / "x.safetensors"), UnsafeReference)]:
        with pytest.raises(error) as info:
            store.get(ref)
        message = str(info.value).replace(ref, "<ref>")
        assert str(tmp_path) not in message, message
    # Outside the roots, an existing file and a missing one read the same.
    outside = [str(lora), str(lora.parent / "nope.safetensors")]
    messages = []
    for ref in outside:
        with pytest.raises(UnsafeReference) as info:
            store.get(ref)
        messages.append(str(info.value).replace(ref, "<ref>"))
    assert messages[0] == messages[1]


# ----------------------------------------------------------------------------- hf:// confined to its snapshot


def hub_cache(root: Path, repo: str, files: dict, commit: str = "b" * 40) -> Path:
    """huggingface_hub's real cache layout: snapshot files are links into ../../blobs/."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, lora):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "someone/style", {"pytorch_lora_weights.safetensors": lora.read_bytes()})
    return cache, snapshot


def test_hf_file_parts_cannot_leave_the_snapshot(tmp_path, offline_hub, lora):
    cache, _ = offline_hub
    secret = write_lora(tmp_path / "secret" / "x.safetensors", seed=7)
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache", local_roots=()), FLUX, hf_cache_dir=str(cache))
    depth = "../" * 12
    for ref in [f"hf://someone/style/{secret}", f"hf://someone/style/{depth}{str(secret).lstrip('/')}",
                f"hf://someone/style@main/{depth}{str(secret).lstrip('/')}",
                "hf://someone/style/%2e%2e/%2e%2e/%2e%2e/x.safetensors", f"hf://someone/style//{secret}"]:
        with pytest.raises(UnsafeReference):
            store.get(ref)
    assert store.remote.fetches == 0
    same = store.get("hf://someone/style/pytorch_lora_weights.safetensors")  # the real blob links work
    assert same.sha256 == hashlib.sha256(lora.read_bytes()).hexdigest()


def test_a_snapshot_file_linking_outside_its_repository_is_refused(tmp_path, offline_hub):
    cache, snapshot = offline_hub
    secret = write_lora(tmp_path / "secret" / "x.safetensors", seed=7)
    (snapshot / "evil.safetensors").symlink_to(secret)
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache"), FLUX, hf_cache_dir=str(cache))
    for ref in ["hf://someone/style/evil.safetensors", "hf://someone/style"]:
        with pytest.raises(UnsafeReference) as info:
            store.get(ref)
        assert str(tmp_path) not in str(info.value)
    assert store.disk.keys() == []


# ----------------------------------------------------------------------------- egress: https://


def test_internal_destinations_are_refused_by_default(tmp_path, files):
    server, url = files
    port = server.server_port
    store = make_store(tmp_path, allow_http=True)  # no allowed_hosts: public addresses only
    for ref in [f"{url}/lora.safetensors", f"http://localhost:{port}/lora.safetensors",
                f"http://[::ffff:127.0.0.1]:{port}/lora.safetensors", f"http://[::1]:{port}/lora.safetensors",
                f"http://0.0.0.0:{port}/lora.safetensors", f"http://2130706433:{port}/lora.safetensors",
                "http://169.254.169.254/latest/meta-data/iam", "http://10.0.0.1/lora.safetensors",
                "https://[fe80::1]/lora.safetensors", "https://224.0.0.1/lora.safetensors"]:
        began = time.monotonic()
        with pytest.raises(UnsafeReference, match="not allowed") as info:
            store.get(ref)
        assert time.monotonic() - began < 1.0, ref  # refused before any connection attempt
        assert "127.0.0.1" not in str(info.value).replace(ref, "")  # nothing about what the name resolved to
    assert server.seen == []


def test_every_redirect_hop_is_checked(tmp_path, lora):
    with serving(lambda h, m: reply(h, 200, lora.read_bytes(), head=m == "HEAD")) as (inner, inner_url):
        targets = {"/to-loopback-name": f"http://localhost:{inner.server_port}/lora.safetensors",
                   "/to-unlisted-port": f"{inner_url}/lora.safetensors",
                   "/to-metadata": "http://169.254.169.254/latest/meta-data/",
                   "/to-ftp": "ftp://127.0.0.1/x"}

        def redirector(handler, method):
            reply(handler, 302, b"", {"Location": targets[handler.path]}, head=method == "HEAD")

        with serving(redirector) as (outer, outer_url):
            store = make_store(tmp_path, allow_http=True, allowed_hosts=(f"127.0.0.1:{outer.server_port}",))
            for path in targets:
                with pytest.raises((UnsafeReference, AdapterNotFound)):
                    store.get(outer_url + path)
            assert inner.seen == [] and len(outer.seen) >= len(targets)


def test_connections_go_to_the_address_that_was_vetted(tmp_path, files, monkeypatch, lora):
    """No rebinding window: the name is resolved once per connection, by the policy, and the socket
    connects to that address (a connect by name would resolve it again)."""
    server, _ = files
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.create_connection
    resolved, connected = [], []

    def getaddrinfo(host, *args, **kwargs):
        if host == "adapters.rebind.test":
            resolved.append(host)
            return real_getaddrinfo("127.0.0.1", *args, **kwargs)
        return real_getaddrinfo(host, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        connected.append(address[0])
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    store = make_store(tmp_path, allow_http=True, allowed_hosts=("adapters.rebind.test",))
    adapter = store.get(f"http://adapters.rebind.test:{server.server_port}/lora.safetensors")
    assert adapter.sha256 == hashlib.sha256(lora.read_bytes()).hexdigest()
    assert connected and set(connected) == {"127.0.0.1"}
    assert len(resolved) == len(connected)
    # The name the client wrote still travels as the Host header (and would be the TLS name).
    assert all(headers.get("Host", "").startswith("adapters.rebind.test") for _, _, headers in server.seen)


def test_errors_say_nothing_about_what_answered(tmp_path):
    garbage = b"HTTP/1.1 internal-secret-page " + b"x" * 200

    def app(handler, method):
        path = handler.path.split("?")[0]
        if path == "/fails":
            reply(handler, 500, b"internal stack trace: secret", head=method == "HEAD")
        elif path == "/forbidden":
            reply(handler, 403, b"secret realm", head=method == "HEAD")
        elif path == "/redirect":
            reply(handler, 302, b"", {"Location": "/garbage"}, head=method == "HEAD")
        else:
            reply(handler, 200, garbage, head=method == "HEAD")

    with serving(app) as (server, url):
        with socket.socket() as s:  # a closed port: refused connections
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        store = make_store(tmp_path, allow_http=True, allowed_hosts=("127.0.0.1",), retries=2)
        header_as_number = str(int.from_bytes(garbage[:8], "little"))
        for ref, error in [(f"{url}/fails?sig=secret", SourceUnavailable), (f"{url}/forbidden", AdapterNotFound),
                           (f"{url}/redirect", AdapterFormatError),
                           (f"http://127.0.0.1:{closed}/x.safetensors", SourceUnavailable)]:
            with pytest.raises(error) as info:
                store.get(ref)
            shown = str(info.value).replace(parse_reference(ref).display, "<ref>")
            for leak in ["500", "403", "secret", "Error", "Timeout", "HTTP", "answered", header_as_number, "bytes"]:
                assert leak not in shown, (ref, shown)


# ----------------------------------------------------------------------------- egress: s3://


def put_object(endpoint, bucket, key, data):
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    client.put_object(Bucket=bucket, Key=key, Body=data)


def test_s3_needs_its_bucket_or_prefix_listed(s3_endpoint, tmp_path, lora):  # noqa: F811
    for key in ["users/42/a.safetensors", "users/43/a.safetensors", "users/420/a.safetensors"]:
        put_object(s3_endpoint, "loras", key, lora.read_bytes())
    endpoint = {"s3_endpoint_url": s3_endpoint, "allowed_hosts": ("127.0.0.1",), "allow_http": True}
    with pytest.raises(UnsafeReference, match="not allowed"):
        make_store(tmp_path / "a", **endpoint).get("s3://loras/users/42/a.safetensors")  # empty: no s3://
    store = make_store(tmp_path / "b", allowed_s3=("loras/users/42",), **endpoint)
    assert store.get("s3://loras/users/42/a.safetensors").modules
    for ref in ["s3://loras/users/43/a.safetensors", "s3://loras/users/420/a.safetensors",
                "s3://other/users/42/a.safetensors", "s3://loras/users/42/../43/a.safetensors"]:
        with pytest.raises(UnsafeReference):
            store.get(ref)
    with pytest.raises(UnsafeReference, match="not allowed"):  # an internal endpoint needs an allow entry
        make_store(tmp_path / "c", s3_endpoint_url=s3_endpoint, allow_http=True,
                   allowed_s3=("loras",)).get("s3://loras/users/42/a.safetensors")


@pytest.mark.parametrize("stage", ["head", "body"])
def test_a_dripping_s3_endpoint_is_cut_at_the_deadline(tmp_path, monkeypatch, stage):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)

    def app(handler, method):
        if method == "HEAD":
            if stage == "head":  # the headers themselves drip: no read ever times out
                handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for _ in range(200):
                    if handler.server.stop.is_set():
                        return
                    try:
                        handler.wfile.write(b"x-drip: 1\r\n")
                        handler.wfile.flush()
                    except OSError:
                        return
                    time.sleep(0.1)
                return
            reply(handler, 200, b"\0" * 4096, {"ETag": '"abc"'}, head=True)
        else:
            drip(handler, 4096, 0.1, handler.server.stop)

    with serving(app) as (server, url):
        store = make_store(tmp_path, s3_endpoint_url=url, allowed_s3=("bucket",), allowed_hosts=("127.0.0.1",),
                           allow_http=True, download_deadline_s=1.5, retries=5)
        began = time.monotonic()
        with pytest.raises(SourceUnavailable, match="did not finish within"):
            store.get("s3://bucket/users/1/a.safetensors")
        assert time.monotonic() - began < 1.5 + SLACK_S
    assert downloads_left(tmp_path) == []


# ----------------------------------------------------------------------------- egress: hf:// online


SHA = "c" * 40


class FakeHub:
    """Enough of the Hub's HTTP API for hotlora: model metadata with file sizes, and resolve URLs."""

    def __init__(self, files: dict, extra_siblings=(), drip_s: float = 0.0, drip_metadata: bool = False):
        self.files, self.extra, self.drip_s, self.drip_metadata = files, list(extra_siblings), drip_s, drip_metadata

    def __call__(self, handler, method):
        path = handler.path.split("?")[0]
        if path == "/api/models/someone/style/revision/main":
            siblings = [{"rfilename": n, "size": len(d)} for n, d in self.files.items()] + self.extra
            body = json.dumps({"id": "someone/style", "sha": SHA, "siblings": siblings}).encode()
            if self.drip_metadata:
                return drip(handler, len(body), 0.1, handler.server.stop)
            return reply(handler, 200, body, {"Content-Type": "application/json"}, head=method == "HEAD")
        prefix = f"/someone/style/resolve/{SHA}/"
        if path.startswith(prefix) and path[len(prefix):] in self.files:
            if self.drip_s:
                return drip(handler, 4096, self.drip_s, handler.server.stop)
            return reply(handler, 200, self.files[path[len(prefix):]], head=method == "HEAD")
        reply(handler, 401, b'{"error": "Repository not found"}', head=method == "HEAD")


@pytest.fixture
def online_hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_server_secret_token")

    @contextmanager
    def start(hub: FakeHub):
        with serving(hub) as (server, url):
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
            yield server

    return start


def hub_store(tmp_path, **overrides):
    overrides.setdefault("allowed_hosts", ("127.0.0.1",))
    return make_store(tmp_path, allow_http=True, hf_cache_dir=str(tmp_path / "hub-cache"), **overrides)


def test_hub_files_download_into_the_store_with_no_token_unless_listed(tmp_path, online_hub, lora):
    data = lora.read_bytes()
    hub = FakeHub({"pytorch_lora_weights.safetensors": data, "README.md": b"---\nbase_model: x/y\n---\n"},
                  extra_siblings=[{"rfilename": "../../evil.safetensors", "size": 10},
                                  {"rfilename": "/etc/passwd.safetensors", "size": 10}])
    with online_hub(hub) as server:
        store = hub_store(tmp_path)
        adapter = store.get("hf://someone/style")
        assert adapter.sha256 == hashlib.sha256(data).hexdigest() and adapter.base_model == "x/y"
        gets = [p for m, p, _ in server.seen if "/resolve/" in p]
        assert sorted(gets) == [f"/someone/style/resolve/{SHA}/README.md",
                                f"/someone/style/resolve/{SHA}/pytorch_lora_weights.safetensors"]
        assert all("authorization" not in {k.lower() for k in h} for _, _, h in server.seen)
        store.get("hf://someone/style")  # the commit is the identity: a RAM hit, no second download
        assert len([p for m, p, _ in server.seen if "/resolve/" in p]) == 2
        assert not (tmp_path / "hub-cache").exists() and downloads_left(tmp_path) == []

        server.seen.clear()
        trusted = hub_store(tmp_path / "t", allowed_hub_repos=("someone/*",))
        trusted.get("hf://someone/style/pytorch_lora_weights.safetensors")
        assert {h.get("Authorization") or h.get("authorization") for _, _, h in server.seen} == {
            "Bearer hf_server_secret_token"}


def test_hub_sizes_are_checked_before_any_download(tmp_path, online_hub, lora):
    with online_hub(FakeHub({"pytorch_lora_weights.safetensors": lora.read_bytes()})) as server:
        with pytest.raises(AdapterFormatError, match="size cap"):
            hub_store(tmp_path, max_adapter_bytes=100).get("hf://someone/style")
        assert [p for _, p, _ in server.seen if "/resolve/" in p] == []
        with pytest.raises(AdapterNotFound, match="not found or not allowed"):
            hub_store(tmp_path / "b").get("hf://someone/private-or-missing")


def test_an_internal_hub_endpoint_needs_an_allow_entry(tmp_path, online_hub, lora):
    with online_hub(FakeHub({"pytorch_lora_weights.safetensors": lora.read_bytes()})) as server:
        with pytest.raises(UnsafeReference, match="not allowed"):
            hub_store(tmp_path, allowed_hosts=()).get("hf://someone/style")
        assert server.seen == []


@pytest.mark.parametrize("where", ["metadata", "file"])
def test_a_dripping_hub_is_cut_at_the_deadline(tmp_path, online_hub, lora, where):
    hub = FakeHub({"pytorch_lora_weights.safetensors": lora.read_bytes()},
                  drip_s=0.1 if where == "file" else 0.0, drip_metadata=where == "metadata")
    with online_hub(hub):
        store = hub_store(tmp_path, download_deadline_s=1.5, retries=5)
        began = time.monotonic()
        with pytest.raises(SourceUnavailable, match="did not finish within"):
            store.get("hf://someone/style")
        assert time.monotonic() - began < 1.5 + SLACK_S
    assert downloads_left(tmp_path) == []


def test_good_references_still_load_equal(tmp_path, files, lora):
    server, url = files
    store = make_store(tmp_path, [lora.parent], allow_http=True, allowed_hosts=(f"127.0.0.1:{server.server_port}",))
    expected = load_adapter(lora, FLUX)
    for ref in [str(lora), "lora.safetensors", f"{url}/lora.safetensors?X-Amz-Signature=secret"]:
        got = store.get(ref)
        assert got.sha256 == expected.sha256 and set(got.modules) == set(expected.modules)
