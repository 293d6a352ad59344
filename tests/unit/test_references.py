import os

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
