"""The adapter store through every source and both cache tiers, against real local servers."""

import asyncio
import hashlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hotlora.adapters.store.diskcache import DiskCache
from hotlora.families import family_named
from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.store.references import UnsafeReference
from hotlora.adapters.store import AdapterStore
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterFormatError, AdapterNotFound, SourceUnavailable

from ..helpers import Files, fake_hub_cache, serving

FLUX = family_named("flux")


@pytest.fixture
def adapters(tiny_models, tmp_path):
    """Copies of the tiny Flux sample adapters inside a local root of their own."""
    root = tmp_path / "adapters"
    shutil.copytree(tiny_models["flux"] / "adapters", root)
    return root


def make_store(tmp_path, roots, **overrides):
    overrides.setdefault("allowed_hosts", ("127.0.0.1",))  # the local test servers: internal, so listed
    config = StoreConfig(cache_dir=tmp_path / "cache", local_roots=tuple(roots), allow_http=True, backoff_s=0.01,
                         **overrides)
    return AdapterStore(config, FLUX)


def same_weights(a, b):
    assert set(a.modules) == set(b.modules)
    for m in a.modules:
        assert torch.equal(a.modules[m].down, b.modules[m].down) and torch.equal(a.modules[m].up, b.modules[m].up)
        assert a.modules[m].scaling == b.modules[m].scaling


# ----------------------------------------------------------------------------- local + tiers


def test_local_adapters_go_through_ram_and_disk_tiers(adapters, tmp_path):
    ref = str(adapters / "style-kohya.safetensors")
    store = make_store(tmp_path, [adapters])
    first = store.get(ref)
    same_weights(first, load_adapter(ref, FLUX))
    assert store.get(ref) is first and store.ram.stats.hits == 1
    assert store.remote.fetches == 1 and store.disk.stats.bytes > 0

    restarted = make_store(tmp_path, [adapters])  # same cache dir: a restart
    again = restarted.get(ref)
    same_weights(again, first)
    assert restarted.disk.stats.hits == 1 and restarted.remote.fetches == 0
    assert again.layout == "kohya" and again.sha256 == first.sha256
    assert set(restarted.stats()) == {"ram", "disk", "remote"}


def test_directories_and_relative_paths(adapters, tmp_path):
    store = make_store(tmp_path, [adapters])
    peft = store.get("identity-peft")  # relative to the first root
    assert peft.layout == "peft" and peft.base_model == "hotlora/tiny-flux"
    assert store.get("identity-diffusers").layout == "diffusers"


def test_escapes_are_refused(adapters, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(adapters / "style-kohya.safetensors", outside)
    (adapters / "link.safetensors").symlink_to(outside)
    store = make_store(tmp_path, [adapters])
    for ref in ["../outside.safetensors", str(outside), "link.safetensors", f"file://{outside}"]:
        with pytest.raises(UnsafeReference):
            store.get(ref)
    assert store.disk.keys() == []


def test_corrupt_and_truncated_files_fail_fast_and_leave_nothing(adapters, tmp_path):
    data = (adapters / "style-kohya.safetensors").read_bytes()
    (adapters / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    (adapters / "garbage.safetensors").write_bytes(b"\xff" * 64)
    store = make_store(tmp_path, [adapters])
    for name in ("truncated.safetensors", "garbage.safetensors"):
        began = time.perf_counter()
        with pytest.raises(AdapterFormatError):
            store.get(name)
        assert time.perf_counter() - began < 5
    with pytest.raises(AdapterNotFound):
        store.get("missing.safetensors")
    assert store.disk.keys() == [] and store.ram.keys() == []
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []


def test_a_corrupted_cache_entry_is_detected_and_refetched(adapters, tmp_path):
    ref = "style-kohya.safetensors"
    good = make_store(tmp_path, [adapters]).get(ref)
    [entry] = (tmp_path / "cache" / "adapters").glob("*.safetensors")
    blob = bytearray(entry.read_bytes())
    blob[-1] ^= 0xFF  # one flipped bit in a tensor
    entry.write_bytes(bytes(blob))
    store = make_store(tmp_path, [adapters])
    same_weights(store.get(ref), good)
    assert store.disk.stats.corrupt == 1 and store.remote.fetches == 1


CRASH = """
import os, sys
sys.path.insert(0, {src!r})
from hotlora.adapters.store.diskcache import DiskCache
from hotlora.adapters.format.convert import load_adapter
from hotlora.families import family_named
adapter = load_adapter({ref!r}, family_named("flux"))
calls = []
real_fsync = os.fsync
def crash(fd):
    calls.append(fd)
    if len(calls) == {crash_at}:
        os._exit(17)  # the process dies here, mid-write, without cleanup
    real_fsync(fd)
os.fsync = crash
DiskCache({root!r}, 1 << 30).put("k" * 64, adapter)
"""


@pytest.mark.parametrize("crash_at", [1, 2], ids=["during-data", "before-checksum"])
def test_a_crash_mid_write_never_leaves_a_valid_looking_entry(adapters, tmp_path, crash_at):
    root = tmp_path / "cache" / "adapters"
    code = CRASH.format(src=str(Path(__file__).parents[2] / "src"), ref=str(adapters / "style-kohya.safetensors"),
                        root=str(root), crash_at=crash_at)
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 17
    assert list(root.iterdir()), "the crash should have left something behind"
    cache = DiskCache(root, 1 << 30)
    assert cache.get("k" * 64) is None
    assert not list(root.glob(".tmp-*")) and not list(root.glob("*.safetensors"))


def test_disk_tier_evicts_least_recently_used_under_its_budget(adapters, tmp_path):
    refs = ["identity-diffusers", "style-diffusers", "style-kohya.safetensors"]
    probe = make_store(tmp_path / "probe", [adapters])
    sizes = []
    for ref in refs:
        probe.get(ref)
        sizes.append(probe.disk.stats.bytes - sum(sizes))
    budget = sizes[0] + sizes[1] + sizes[2] - 1  # one entry too many
    store = make_store(tmp_path, [adapters], disk_budget_bytes=budget)
    store.get(refs[0])
    time.sleep(0.02)
    store.get(refs[1])
    time.sleep(0.02)
    store.disk.get(store._key(store.sources["file"].probe(store._resolve_catalog(refs[0])[0])))  # touch the first
    time.sleep(0.02)
    store.get(refs[2])
    assert store.disk.stats.bytes <= budget and store.disk.stats.evictions == 1
    assert len(store.disk.keys()) == 2
    fresh = make_store(tmp_path, [adapters], disk_budget_bytes=budget)
    fresh.get(refs[0])
    assert fresh.disk.stats.hits == 1  # the touched entry survived; the second one went


def test_ram_tier_budget_and_pinned_catalog_entries(adapters, tmp_path):
    catalog = {"watercolor": {"ref": str(adapters / "style-kohya.safetensors"), "scale": 0.6, "pin": True}}
    path = tmp_path / "catalog.toml"
    path.write_text("".join(f'[adapters.{k}]\nref = "{v["ref"]}"\nscale = {v["scale"]}\npin = true\n' for k, v in catalog.items()))
    config = StoreConfig(cache_dir=tmp_path / "cache", local_roots=(adapters,), ram_budget_bytes=1)
    store = AdapterStore(config, FLUX, catalog=path)
    assert store.precache_catalog() == {}
    store.get("identity-diffusers")
    store.get("style-diffusers")
    assert store.ram.stats.evictions >= 1
    assert store.default_scale("watercolor") == 0.6 and store.default_scale("catalog:watercolor") == 0.6
    hits = store.ram.stats.hits
    store.get("watercolor")
    assert store.ram.stats.hits == hits + 1  # pinned: still in RAM despite a 1-byte budget


def test_catalog_precache_reports_broken_entries_and_keeps_going(adapters, tmp_path):
    path = adapters / "catalog.toml"  # relative refs are relative to the catalog file
    path.write_text('[adapters.good]\nref = "style-kohya.safetensors"\n'
                    '[adapters.broken]\nref = "missing.safetensors"\n'
                    '[adapters.also_good]\nref = "identity-diffusers"\nscale = 0.5\n')
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache", local_roots=(adapters,)), FLUX, catalog=path)
    seen = []
    failures = store.precache_catalog(progress=lambda name, i, n: seen.append((name, i, n)))
    assert list(failures) == ["broken"] and "does not exist" in failures["broken"]
    assert seen == [("good", 1, 3), ("broken", 2, 3), ("also_good", 3, 3)]
    with pytest.raises(AdapterNotFound, match="no catalog entry"):
        store.get("catalog:nope")


def test_prefetch_runs_off_the_event_loop(adapters, tmp_path):
    store = make_store(tmp_path, [adapters])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        adapter = await store.prefetch("style-kohya.safetensors")
        task.cancel()
        return adapter, ticks

    adapter, ticks = asyncio.run(main())
    assert ticks > 0 and store.get("style-kohya.safetensors") is adapter


def test_pickle_is_opt_in(adapters, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(adapters / "style-kohya.safetensors"))
    torch.save(sd, adapters / "legacy.bin")
    with pytest.raises(AdapterFormatError, match="only .safetensors"):
        make_store(tmp_path, [adapters]).get("legacy.bin")
    allowed = make_store(tmp_path / "p", [adapters], allow_pickle=True).get("legacy.bin")
    same_weights(allowed, load_adapter(adapters / "style-kohya.safetensors", FLUX))


def test_size_cap(adapters, tmp_path):
    with pytest.raises(AdapterFormatError, match="size cap"):
        make_store(tmp_path, [adapters], max_adapter_bytes=100).get("style-kohya.safetensors")


# ----------------------------------------------------------------------------- HTTPS


@pytest.fixture
def http_files(adapters):
    Files.files = {"/style.safetensors": (adapters / "style-kohya.safetensors").read_bytes()}
    Files.gets, Files.heads, Files.fail_next, Files.delay = {}, {}, {}, 0.0
    with serving(Files) as url:
        yield url


def test_https_download_is_cached_by_etag(http_files, adapters, tmp_path):
    store = make_store(tmp_path, [adapters])
    url = f"{http_files}/style.safetensors?X-Amz-Signature=topsecret"
    same_weights(store.get(url), load_adapter(adapters / "style-kohya.safetensors", FLUX))
    store.get(url.replace("topsecret", "another-signature"))  # same object, new presigned query
    assert Files.gets["/style.safetensors"] == 1
    restarted = make_store(tmp_path, [adapters])
    restarted.get(url)
    assert Files.gets["/style.safetensors"] == 1 and restarted.disk.stats.hits == 1


def test_remote_identity_is_rechecked_every_request_unless_told_otherwise(http_files, adapters, tmp_path):
    url = f"{http_files}/style.safetensors"
    always = make_store(tmp_path / "a", [adapters], revalidate_after_s=0)
    for _ in range(3):
        always.get(url)
    assert Files.heads["/style.safetensors"] == 3 and Files.gets["/style.safetensors"] == 1

    Files.heads.clear()
    trusting = make_store(tmp_path / "b", [adapters], revalidate_after_s=0.5)
    first = trusting.get(url)
    Files.files["/style.safetensors"] = (adapters / "style-xlabs.safetensors").read_bytes()  # replaced in place
    assert trusting.get(url).sha256 == first.sha256  # within the window: remembered, no round trip
    assert Files.heads["/style.safetensors"] == 1
    time.sleep(0.6)
    assert trusting.get(url).sha256 != first.sha256  # after it: asked again, the new object served
    assert Files.heads["/style.safetensors"] == 2


def test_concurrent_requests_for_one_adapter_cause_one_fetch(http_files, adapters, tmp_path):
    Files.delay = 0.5
    store = make_store(tmp_path, [adapters])
    url = f"{http_files}/style.safetensors"
    results, errors = [], []

    def worker():
        try:
            results.append(store.get(url))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 8
    assert Files.gets["/style.safetensors"] == 1
    assert all(r is results[0] for r in results)


def test_https_retries_then_fails_clearly_without_leaking_secrets(http_files, adapters, tmp_path):
    store = make_store(tmp_path, [adapters], retries=3)
    Files.fail_next = {"/style.safetensors": 2}
    assert store.get(f"{http_files}/style.safetensors").layout == "kohya"  # two 503s, then fine
    Files.fail_next = {"/style.safetensors": 99}
    fresh = make_store(tmp_path / "b", [adapters], retries=2)
    with pytest.raises(SourceUnavailable) as info:
        fresh.get(f"{http_files}/style.safetensors?token=topsecret")
    assert "topsecret" not in str(info.value)
    with pytest.raises(AdapterNotFound) as info:
        fresh.get(f"{http_files}/nope.safetensors?token=topsecret")
    assert "topsecret" not in str(info.value)


def test_https_host_rules_and_size_cap(http_files, adapters, tmp_path):
    url = f"{http_files}/style.safetensors"
    with pytest.raises(UnsafeReference, match="not allowed"):
        make_store(tmp_path, [adapters], allowed_hosts=("adapters.example.com",)).get(url)
    with pytest.raises(UnsafeReference, match=r"not allowed \(https only\)"):
        AdapterStore(StoreConfig(cache_dir=tmp_path / "c", local_roots=(adapters,)), FLUX).get(url)
    with pytest.raises(AdapterFormatError, match="size cap"):
        make_store(tmp_path / "d", [adapters], max_adapter_bytes=1000).get(url)
    assert make_store(tmp_path / "e", [adapters], allowed_hosts=("127.0.0.1",)).get(url).layout == "kohya"


# ----------------------------------------------------------------------------- S3


def test_s3_multipart_object_through_a_real_endpoint(s3_endpoint, adapters, tmp_path):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="loras")
    data = (adapters / "style-kohya.safetensors").read_bytes()
    half = len(data) // 2
    upload = client.create_multipart_upload(Bucket="loras", Key="users/42/identity.safetensors")
    parts = []
    for number, chunk in enumerate([data[:half], data[half:]], 1):
        etag = client.upload_part(Bucket="loras", Key="users/42/identity.safetensors", PartNumber=number,
                                  UploadId=upload["UploadId"], Body=chunk)["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    client.complete_multipart_upload(Bucket="loras", Key="users/42/identity.safetensors", UploadId=upload["UploadId"],
                                     MultipartUpload={"Parts": parts})
    assert client.head_object(Bucket="loras", Key="users/42/identity.safetensors")["ETag"].endswith('-2"')

    store = make_store(tmp_path, [adapters], s3_endpoint_url=s3_endpoint, allowed_s3=("loras/users",))
    adapter = store.get("s3://loras/users/42/identity.safetensors")
    same_weights(adapter, load_adapter(adapters / "style-kohya.safetensors", FLUX))
    assert adapter.sha256 == hashlib.sha256(data).hexdigest()
    store.get("s3://loras/users/42/identity.safetensors")
    assert store.remote.fetches == 1
    with pytest.raises(AdapterNotFound):
        store.get("s3://loras/users/43/identity.safetensors")
    with pytest.raises(UnsafeReference):
        make_store(tmp_path / "x", [adapters], s3_endpoint_url=s3_endpoint, allowed_hosts=("r2.example",),
                   allowed_s3=("loras",)).get("s3://loras/users/42/identity.safetensors")


# ----------------------------------------------------------------------------- Hugging Face Hub (offline cache)


def test_hf_references_read_the_local_hub_cache_offline(adapters, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    data = (adapters / "style-diffusers" / "pytorch_lora_weights.safetensors").read_bytes()
    card = b"---\nbase_model: hotlora/tiny-flux\ntags: [lora]\n---\n# style\n"
    cache = fake_hub_cache(tmp_path / "hub", "someone/style-lora",
                           {"pytorch_lora_weights.safetensors": data, "README.md": card})
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache", local_roots=()), FLUX, hf_cache_dir=str(cache))
    picked = store.get("hf://someone/style-lora")
    named = store.get("hf://someone/style-lora@main/pytorch_lora_weights.safetensors")
    same_weights(picked, load_adapter(adapters / "style-diffusers", FLUX))
    same_weights(named, picked)
    assert picked.base_model == "hotlora/tiny-flux"
    with pytest.raises(AdapterNotFound):
        store.get("hf://someone/not-cached")


def test_a_hub_repos_card_names_its_base_model_offline(tmp_path, monkeypatch):
    """What the Ray ingress routes ``/models/{repository}`` by: the model card's ``base_model`` (the
    first of a list), read from the card alone; none for a card without one, a repository not there,
    a name that is no repository, a card linking out of its repository. Answers are remembered."""
    import huggingface_hub.constants

    from hotlora.adapters.store.hub import HubBaseModels, HubSource

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub = tmp_path / "hub"
    fake_hub_cache(hub, "someone/a", {"README.md": b"---\nbase_model: hotlora/tiny-flux\n---\n# a\n"})
    fake_hub_cache(hub, "someone/list", {"README.md": b"---\nbase_model:\n- org/x\n- org/y\n---\n"})
    fake_hub_cache(hub, "someone/none", {"README.md": b"# no header\n"})
    linked = fake_hub_cache(hub, "someone/linked", {}) / "models--someone--linked" / "snapshots" / ("a" * 40)
    (tmp_path / "outside.md").write_bytes(b"---\nbase_model: org/secret\n---\n")
    (linked / "README.md").symlink_to(tmp_path / "outside.md")
    source = HubSource(StoreConfig(cache_dir=tmp_path / "cache", local_roots=()), str(hub))
    assert source.base_model_of("someone/a") == "hotlora/tiny-flux"
    assert source.base_model_of("someone/list") == "org/x"
    for repo in ("someone/none", "someone/missing", "someone/linked", "../etc", "someone/a/README.md"):
        assert source.base_model_of(repo) is None, repo
    remembered = HubBaseModels(source)
    assert remembered("someone/a") == "hotlora/tiny-flux"
    (hub / "models--someone--a" / "snapshots" / ("a" * 40) / "README.md").unlink()
    assert remembered("someone/a") == "hotlora/tiny-flux"  # within its TTL, not read again
    assert source.base_model_of("someone/a") is None


def test_a_hub_repo_brings_its_pivotal_embeddings_through_both_tiers(adapters, tmp_path, monkeypatch):
    """The Hugging Face inference API's convention: ``embeddings.safetensors`` beside the LoRA in
    the repo, rows ``<s0>``, ``<s1>``. They come with the adapter, and again from the disk tier."""
    import huggingface_hub.constants
    import torch
    from safetensors.torch import save

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    data = (adapters / "style-diffusers" / "pytorch_lora_weights.safetensors").read_bytes()
    vectors = {"clip_l": torch.randn(2, 32), "t5": torch.randn(2, 32)}
    cache = fake_hub_cache(tmp_path / "hub", "someone/pivotal",
                           {"pytorch_lora_weights.safetensors": data, "embeddings.safetensors": save(vectors)})

    def fresh_store():
        return AdapterStore(StoreConfig(cache_dir=tmp_path / "cache", local_roots=()), FLUX, hf_cache_dir=str(cache))

    first = fresh_store().get("hf://someone/pivotal")
    again = fresh_store().get("hf://someone/pivotal")  # a new process: from the disk tier
    for adapter in (first, again):
        assert adapter.embeddings.tokens == ("<s0>", "<s1>")
        assert torch.equal(adapter.embeddings.vectors["text_encoder"], vectors["clip_l"])
        assert torch.equal(adapter.embeddings.vectors["text_encoder_2"], vectors["t5"])
    assert again.key == first.key
