import os
from pathlib import Path

import pytest

from hotlora.adapters.store.references import (InvalidReference, UnsafeReference, confine_local_path, parse_reference,
                                         redact_reference, redact_url)
from hotlora.errors import AdapterFormatError, InvalidRequest
from hotlora.server.errors import status_of


def test_every_reference_kind_parses():
    assert parse_reference("s3://bucket/users/42/identity.safetensors").location == "bucket/users/42/identity.safetensors"
    hf = parse_reference("hf://owner/repo@v1.0/sub/lora.safetensors")
    assert (hf.kind, hf.location, hf.revision, hf.filename) == ("hf", "owner/repo", "v1.0", "sub/lora.safetensors")
    assert parse_reference("hf://owner/repo").filename is None
    assert parse_reference("https://host/x.safetensors").kind == "https"
    assert parse_reference("file:///data/x.safetensors").location == "/data/x.safetensors"
    assert parse_reference("catalog:watercolor").kind == "catalog"
    assert parse_reference("watercolor", catalog_names={"watercolor"}).kind == "catalog"
    assert parse_reference("watercolor").kind == "file"


@pytest.mark.parametrize("bad", ["", "  ", "ftp://host/x", "s3://bucket-only", "hf://not-a-repo"])
def test_malformed_references_are_request_errors(bad):
    with pytest.raises(InvalidRequest):
        parse_reference(bad)


def test_secrets_never_survive_redaction():
    url = "https://user:hunter2@bucket.example/x.safetensors?X-Amz-Signature=topsecret&token=abc"
    shown = redact_url(url)
    assert "hunter2" not in shown and "topsecret" not in shown and "abc" not in shown
    assert shown.startswith("https://bucket.example/x.safetensors")
    assert "topsecret" not in parse_reference(url).display


def test_local_paths_stay_inside_the_roots(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.safetensors").write_bytes(b"x")
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    assert confine_local_path("sub/a.safetensors", [root]) == (root / "sub" / "a.safetensors").resolve()
    with pytest.raises(UnsafeReference, match=r"'\.\.'"):
        confine_local_path("sub/../../secret.safetensors", [root])
    with pytest.raises(UnsafeReference, match="outside"):
        confine_local_path(str(tmp_path / "secret.safetensors"), [root])
    os.symlink(tmp_path / "secret.safetensors", root / "link.safetensors")
    with pytest.raises(UnsafeReference, match="outside"):
        confine_local_path("link.safetensors", [root])
    os.symlink(tmp_path, root / "escape")
    with pytest.raises(UnsafeReference, match="outside"):
        confine_local_path("escape/secret.safetensors", [root])
    with pytest.raises(UnsafeReference, match="disabled"):
        confine_local_path("sub/a.safetensors", [])


def test_catalog_files_in_toml_and_yaml(tmp_path):
    from hotlora.adapters.store.catalog import CatalogError, load_catalog

    (tmp_path / "c.toml").write_text('[adapters.a]\nref = "s3://b/k.safetensors"\nscale = 0.7\npin = true\n')
    (tmp_path / "c.yaml").write_text("adapters:\n  a:\n    ref: s3://b/k.safetensors\n    scale: 0.7\n    pin: true\n")
    assert load_catalog(tmp_path / "c.toml") == load_catalog(tmp_path / "c.yaml")
    assert load_catalog(tmp_path / "c.toml")["a"].scale == 0.7
    (tmp_path / "bad.toml").write_text('[adapters.a]\nscale = 1\n')
    with pytest.raises(CatalogError, match="'a' needs a string 'ref'"):
        load_catalog(tmp_path / "bad.toml")
    (tmp_path / "typo.toml").write_text('[adapters.a]\nref = "x"\nscael = 1\n')
    with pytest.raises(CatalogError, match="unknown fields"):
        load_catalog(tmp_path / "typo.toml")


# ----------------------------------------------------------------------------- confined by construction


@pytest.mark.parametrize("bad", [
    "hf://o/r//etc/x.safetensors",  # absolute file part
    "hf://o/r/../../x.safetensors",
    "hf://o/r/sub/../../../x.safetensors",
    "hf://o/r/%2e%2e/%2e%2e/x.safetensors",  # percent-escapes are never decoded into a path here
    "hf://o/r/sub\\..\\..\\x.safetensors",
    "hf://o/r/./x.safetensors",
    "hf://o/r/a//b.safetensors",
    "hf://o/r@main/../x.safetensors",
    "hf://o/r@../../x/f.safetensors",  # the revision is a path component of the cache too
])
def test_hub_file_parts_that_could_leave_the_snapshot_are_refused_at_parse_time(bad):
    with pytest.raises(UnsafeReference):
        parse_reference(bad)


@pytest.mark.parametrize("bad", ["hf://../../x.safetensors", "hf://o--x/r", "hf://./r", "hf://o/r@%2e%2e/f.safetensors"])
def test_hub_repo_ids_and_revisions_follow_the_hubs_own_rule(bad):
    with pytest.raises(InvalidRequest):
        parse_reference(bad)


def test_hub_files_in_subfolders_and_revisions_with_slashes_still_parse():
    ref = parse_reference("hf://o/r@refs/pr/1/sub/lora.safetensors")
    assert (ref.location, ref.revision, ref.filename) == ("o/r", "refs", "pr/1/sub/lora.safetensors")
    assert parse_reference("hf://o/r/sub/dir/lora.safetensors").filename == "sub/dir/lora.safetensors"


@pytest.mark.parametrize("bad", ["s3://b/users/42/../43/x.safetensors", "s3://b/./x", "s3://b//x", "s3://b/a/%2e%2e/x"])
def test_s3_keys_with_dot_segments_are_refused(bad):
    # URL clients drop dot segments: "users/42/../43" would be fetched as "users/43", outside the prefix.
    with pytest.raises(UnsafeReference):
        parse_reference(bad)


def test_the_default_local_roots_are_empty_never_the_working_directory():
    from hotlora.settings import StoreConfig

    assert StoreConfig().local_roots == ()
    assert StoreConfig().allowed_s3 == () and StoreConfig().allowed_hub_repos == ()
    assert StoreConfig(local_roots=os.pathsep.join(["/a", "/b"])).local_roots == (Path("/a"), Path("/b"))
    assert StoreConfig(allowed_s3="b1/users/, b2").allowed_s3 == ("b1/users", "b2")


def test_store_settings_come_from_the_environment(monkeypatch):
    from hotlora.settings import StoreConfig

    monkeypatch.setenv("HOTLORA_ALLOWED_S3", "loras/users,public")
    monkeypatch.setenv("HOTLORA_ALLOWED_HUB_REPOS", "acme/*,someone/style")
    monkeypatch.setenv("HOTLORA_ALLOWED_HOSTS", "Adapters.Example.com,127.0.0.1:9000")
    config = StoreConfig.from_env()
    assert config.allowed_s3 == ("loras/users", "public")
    assert config.allowed_hub_repos == ("acme/*", "someone/style")
    assert config.allowed_hosts == ("adapters.example.com", "127.0.0.1:9000")


@pytest.mark.parametrize("address, public", [
    ("127.0.0.1", False), ("127.8.9.10", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.251", False),
    ("255.255.255.255", False), ("240.0.0.1", False), ("192.0.2.1", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False), ("::ffff:10.0.0.1", False),
    ("2002:7f00:1::", False),  # 6to4 around 127.0.0.1
    ("fe80::1%eth0", False),
    # ipaddress counts these as global: site-local (deprecated, still routed inside sites) and the
    # RFC 9637 documentation prefix; NAT64 and SIIT prefixes are in its reserved space.
    ("fec0::1", False), ("feff:ffff::1", False), ("3fff::1", False), ("64:ff9b::7f00:1", False),
    ("::ffff:0:7f00:1", False),
    ("8.8.8.8", True), ("1.1.1.1", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
])
def test_egress_judges_addresses_after_resolution(address, public):
    from hotlora.adapters.store.egress import is_public

    assert is_public(address) is public


def test_egress_policy_lists_hosts_and_ports():
    from hotlora.adapters.store.egress import EgressPolicy, EgressRefused

    policy = EgressPolicy(("127.0.0.1:9000", "files.internal", "[::1]:8443"), exclusive=True, allow_http=True)
    assert policy.listed("127.0.0.1", 9000) and not policy.listed("127.0.0.1", 9001)
    assert policy.listed("files.internal", 1) and policy.listed("::1", 8443)
    policy.check_url("http://127.0.0.1:9000/x")
    with pytest.raises(EgressRefused):
        policy.check_url("http://127.0.0.1:9001/x")
    with pytest.raises(EgressRefused):
        EgressPolicy().check_url("http://example.com/x")  # https only unless allow_http
    with pytest.raises(EgressRefused):
        EgressPolicy().resolve("127.0.0.1", 443)  # not listed: judged by address
    with pytest.raises(EgressRefused):
        EgressPolicy().resolve("localhost", 443)  # a name that resolves to loopback
    assert EgressPolicy(("localhost",)).resolve("localhost", 443)  # listed: allowed though internal


# ----------------------------------------------------------------------------- malformed references (#24)


@pytest.mark.parametrize("bad", [
    "http://127.0.0.1:99999/x.safetensors?sig=SECRET",  # port out of range: ValueError from urlsplit().port
    "https://h.example:0/x", "https://h.example:http/x?sig=SECRET", "https://h.example:-1/x",
    "https://h.example/a\tb?sig=SECRET", "https://h.example/x\r\nX-Injected: 1", "https://h.example/a b",
    "https://h.example/\u3000x", "https://[::1/x?sig=SECRET", "https://[not-v6]/x", "https:///x", "https://:443/x",
    "http://", "https://xn--/x", "https://h.example\\@evil.example/x",
    "s3://bucket:99999/k", "s3://[b/k", "s3://b ucket/k", "s3://b/k\tx", "hf://o/r/a\x85b", "/loras/a\nb",
    "catalog:a\rb",
])
def test_malformed_references_are_a_422_at_parse_time_and_never_quoted(bad):
    with pytest.raises(InvalidReference) as raised:
        parse_reference(bad)
    assert status_of(raised.value) == 422 and "SECRET" not in str(raised.value)
    shown = redact_reference(bad)
    assert shown.startswith("<unparseable reference") and "SECRET" not in shown


def test_well_formed_urls_still_parse():
    for good in ("https://h.example/x.safetensors?X-Amz-Signature=s", "https://u:p@h.example:8443/x",
                 "https://[::1]:8443/x", "http://127.0.0.1:9000/x", "https://h.example:/x", "https://exämple.com/x",
                 "https://h.example/x#frag", "https://h.example/%20x"):
        assert parse_reference(good).kind == "https", good
    assert parse_reference("s3://My_Legacy.bucket-1/k").location == "My_Legacy.bucket-1/k"
    assert parse_reference("/loras/my lora.safetensors").location == "/loras/my lora.safetensors"


@pytest.mark.parametrize("url", ["http://h:99999/x?sig=SECRET", "s3://[b/k", "https://[::1/x", "http://h:x/y"])
def test_redaction_never_raises(url):
    shown = redact_url(url)
    assert "SECRET" not in shown


def test_the_egress_policy_refuses_what_it_cannot_parse_instead_of_raising():
    from hotlora.adapters.store.egress import EgressPolicy, EgressRefused

    policy = EgressPolicy(allow_http=True)
    for url in ("http://127.0.0.1:99999/x", "http://h.example:0/x", "http://[::1/x", "http:///x"):
        with pytest.raises(EgressRefused) as raised:
            policy.check_url(url)
        assert "malformed" in raised.value.shown
    # An allowed_hosts entry with a port that is not one allows nothing (never every port).
    odd = EgressPolicy(("files.internal:http", "[::1]:99999", "ok.internal:8080"), exclusive=True)
    assert not odd.listed("files.internal", 80) and not odd.listed("files.internal", 443)
    assert not odd.listed("::1", 443) and odd.listed("ok.internal", 8080)


def test_the_remote_client_turns_an_invalid_url_into_a_422_and_odd_httpx_errors_into_502():
    """parse_reference refuses malformed URLs; should one still reach httpx (a URL built from parts,
    a redirect loop), the answer is a RequestError or SourceUnavailable, never a bare httpx error."""
    import http.server
    import threading

    from hotlora.adapters.store.egress import EgressPolicy
    from hotlora.adapters.store.references import Reference
    from hotlora.adapters.store.remote import Remote
    from hotlora.settings import StoreConfig
    from hotlora.errors import SourceUnavailable

    config = StoreConfig(retries=1, download_deadline_s=30)
    remote = Remote(config, EgressPolicy(("127.0.0.1",), allow_http=True))
    bad = "http://127.0.0.1/a\tb"  # httpx refuses it: InvalidURL
    with pytest.raises(InvalidReference):
        remote.head(Reference("https", bad), bad)
    bad = "http://127.0.0.1:99999/x"  # httpx takes it; the egress check refuses it
    with pytest.raises(UnsafeReference):
        remote.head(Reference("https", bad), bad)

    class Loop(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # a redirect to itself: httpx.TooManyRedirects after 20 hops
            self.send_response(302)
            self.send_header("location", "/again")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/x"
        with pytest.raises(SourceUnavailable):
            remote.head(Reference("https", url), url)
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- files that never end (#24)


def _within(seconds, call):
    """``call()``'s exception (or None), failing the test instead of hanging when it blocks."""
    import threading

    outcome = {}

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked on a file that never ends"
    return outcome.get("exc")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_or_device_inside_a_root_is_refused_not_read(tmp_path):
    from hotlora.adapters.format.files import ReadLimits, read_files
    from hotlora.adapters.store.sources import LocalSource
    from hotlora.settings import StoreConfig

    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    os.mkfifo(root / "pipe.safetensors")
    os.mkfifo(root / "dir" / "adapter_model.safetensors")  # a directory adapter whose weights are a pipe
    os.symlink(root / "pipe.safetensors", root / "link.safetensors")
    source = LocalSource(StoreConfig(local_roots=(root,)))
    for ref in ("pipe.safetensors", "dir", "link.safetensors"):
        for call in (source.probe, lambda r: source.fetch(r, tmp_path)):
            exc = _within(10, lambda: call(parse_reference(ref)))
            assert isinstance(exc, AdapterFormatError) and status_of(exc) == 422, (ref, exc)
            assert "not a regular file" in str(exc)
    # The reader checks the file it opened too (no window to swap a checked file for a pipe).
    limits = ReadLimits(roots=(root,))
    exc = _within(10, lambda: read_files(root / "pipe.safetensors", limits, "pipe.safetensors"))
    assert isinstance(exc, AdapterFormatError), exc
    if os.path.exists("/dev/zero"):
        os.symlink("/dev/zero", tmp_path / "zero.safetensors")
        exc = _within(10, lambda: read_files(tmp_path / "zero.safetensors", ReadLimits(), "zero.safetensors"))
        assert isinstance(exc, AdapterFormatError), exc
