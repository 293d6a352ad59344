"""deploy/image and deploy/k8s agree with the code: every HOTLORA_* variable they set is a setting
the server reads (a renamed setting would otherwise be ignored in silence), and the image's volumes
are where the manifests mount the caches."""

from __future__ import annotations

import re
from pathlib import Path

from hotlora.settings import ServerConfig, StoreConfig

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = (ROOT / "deploy" / "image" / "Containerfile").read_text()
ENTRYPOINT = (ROOT / "deploy" / "image" / "entrypoint.sh").read_text()
# Read by the image's entrypoint, not by the server: where the config file and the keys file are mounted.
ENTRYPOINT_ONLY = {"HOTLORA_CONFIG_FILE", "HOTLORA_API_KEYS_SECRET"}


def settings() -> set[str]:
    return {f"HOTLORA_{name.upper()}" for cls in (ServerConfig, StoreConfig) for name in cls.model_fields}


def image_env() -> dict[str, str]:
    return dict(re.findall(r"\b(HOTLORA_[A-Z0-9_]+)=(\S+)", CONTAINERFILE))


def manifest_env_names() -> set[str]:
    text = "".join(p.read_text() for p in (ROOT / "deploy" / "k8s").rglob("*.yaml") if "crds" not in p.parts)
    return set(re.findall(r"name: (HOTLORA_[A-Z0-9_]+)", text))


def test_every_hotlora_variable_of_the_image_and_manifests_is_a_setting():
    names = set(image_env()) | manifest_env_names()
    assert {"HOTLORA_HOST", "HOTLORA_CACHE_DIR", "HOTLORA_COMPILE_CACHE_DIR", "HOTLORA_DEVICE"} <= names
    assert names - ENTRYPOINT_ONLY - settings() == set()


def test_the_entrypoint_reads_what_the_image_sets():
    used = set(re.findall(r"\$\{?(HOTLORA_[A-Z0-9_]+)", ENTRYPOINT))
    assert ENTRYPOINT_ONLY <= used
    assert ENTRYPOINT_ONLY <= set(image_env())
    assert "HOTLORA_API_KEYS_FILE" in used and "HOTLORA_API_KEYS_FILE" in settings()


def test_caches_are_image_volumes_and_mounted_by_the_manifests():
    (volumes,) = re.findall(r"^VOLUME \[(.*)\]$", CONTAINERFILE, flags=re.M)
    paths = {p.strip().strip('"') for p in volumes.split(",")}
    env = image_env()
    assert env["HOTLORA_CACHE_DIR"] in paths
    assert any(env["HOTLORA_COMPILE_CACHE_DIR"].startswith(p + "/") for p in paths)
    inductor = re.search(r"TORCHINDUCTOR_CACHE_DIR=(\S+)", CONTAINERFILE).group(1)
    assert any(inductor.startswith(p + "/") for p in paths)  # the inductor cache survives restarts too
    deployment = (ROOT / "deploy" / "k8s" / "base" / "deployment.yaml").read_text()
    for path in paths:
        assert f"mountPath: {path}\n" in deployment
    assert re.search(r"^USER (?!0\b|root\b)", CONTAINERFILE, flags=re.M)
