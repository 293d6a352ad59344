import os
from pathlib import Path

import pytest

from hotlora.adapters.references import UnsafeReference, confine_local_path, parse_reference, redact_url
from hotlora.errors import InvalidRequest


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
    from hotlora.adapters.catalog import CatalogError, load_catalog

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
    from hotlora.config import StoreConfig

    assert StoreConfig().local_roots == ()
    assert StoreConfig().allowed_s3 == () and StoreConfig().allowed_hub_repos == ()
    assert StoreConfig(local_roots=os.pathsep.join(["/a", "/b"])).local_roots == (Path("/a"), Path("/b"))
    assert StoreConfig(allowed_s3="b1/users/, b2").allowed_s3 == ("b1/users", "b2")


def test_store_settings_come_from_the_environment(monkeypatch):
    from hotlora.config import StoreConfig

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
    ("8.8.8.8", True), ("1.1.1.1", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
])
def test_egress_judges_addresses_after_resolution(address, public):
    from hotlora.adapters.egress import is_public

    assert is_public(address) is public


def test_egress_policy_lists_hosts_and_ports():
    from hotlora.adapters.egress import EgressPolicy, EgressRefused

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
