"""Compile artifacts are pickles: they are loaded and saved only where no other user can write."""

import logging
import os

import pytest
import torch

from hotlora import durable
from hotlora.engine import pipeline


@pytest.fixture
def unpickler(monkeypatch):
    """Records what would be handed to torch's unpickling loader, instead of loading it."""
    handed = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", handed.append)
    return handed


def artifacts(folder):
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    path = folder / "compile-artifacts-x.bin"
    durable.write_verified(path, b"pickle")
    path.chmod(0o600)
    return path


def test_a_private_folder_is_trusted(tmp_path, unpickler):
    path = artifacts(tmp_path / "private")
    assert pipeline.CompileArtifacts(path).load() is True
    assert unpickler == [b"pickle"]


@pytest.mark.parametrize("place", ["folder", "file"])
def test_artifacts_others_could_write_are_never_unpickled(tmp_path, unpickler, caplog, place):
    path = artifacts(tmp_path / "shared")
    (path.parent if place == "folder" else path).chmod(0o777 if place == "folder" else 0o666)
    with caplog.at_level(logging.WARNING):
        assert pipeline.CompileArtifacts(path).load() is False
    assert unpickler == []
    assert "writable by other users" in caplog.text


def test_artifacts_of_another_user_are_never_unpickled(tmp_path, unpickler, monkeypatch):
    path = artifacts(tmp_path / "theirs")
    if os.getuid() == 0:
        os.chown(path, 4242, 4242)  # root can hand the file to another user
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4242)  # or this process pretends to be another user
    assert pipeline.CompileArtifacts(path).load() is False
    assert unpickler == []


def test_saving_creates_a_private_folder_and_refuses_a_shared_one(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"pickle", None))
    path = tmp_path / "new" / "compile-artifacts-x.bin"
    assert pipeline.CompileArtifacts(path).save() is True
    assert path.read_bytes() == b"pickle"
    assert path.parent.stat().st_mode & 0o077 == 0 and path.stat().st_mode & 0o077 == 0
    assert durable.sidecar_of(path).stat().st_mode & 0o077 == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    assert pipeline.CompileArtifacts(shared / "compile-artifacts-x.bin").save() is False
    assert not (shared / "compile-artifacts-x.bin").exists()


@pytest.mark.parametrize("damage", ["cut short", "no checksum", "another file"])
def test_artifacts_that_are_not_whole_are_never_unpickled_and_are_removed(tmp_path, unpickler, caplog, damage):
    path = artifacts(tmp_path / "private")
    if damage == "cut short":  # what a kill mid-write would leave, were the file written in place
        path.write_bytes(b"pick")
    elif damage == "no checksum":  # killed between the data's rename and its sidecar's
        durable.sidecar_of(path).unlink()
    else:
        path.write_bytes(b"elcikp")
    with caplog.at_level(logging.WARNING):
        assert pipeline.CompileArtifacts(path).load() is False
    assert unpickler == []
    assert "discarded" in caplog.text
    assert not path.exists() and not durable.sidecar_of(path).exists()


def test_a_save_that_fails_costs_the_next_start_a_compile_not_this_one_its_warm_up(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"pickle", None))

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable, "write_atomic", full)
    assert pipeline.CompileArtifacts(tmp_path / "compile-artifacts-x.bin").save() is False


def stream(*batches):
    """torch's artifact stream with one appended entry per batch, as repeated saves in one process write it."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    for batch in batches:
        out.append(("inductor", [CacheArtifactFactory.create("inductor", key, key.encode()) for key in batch]))
    return out.to_bytes()


def held(path):
    return {kind: sorted(artifacts) for kind, artifacts in pipeline._read_stream(path.read_bytes()).items()}


def test_saves_after_each_state_write_the_union_and_never_less_than_the_file_held(tmp_path, monkeypatch):
    path = artifacts(tmp_path / "private")
    durable.write_verified(path, stream(["a", "b"]))  # what an earlier process saved: two states' graphs
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: None)
    file = pipeline.CompileArtifacts(path)
    assert file.load() is True and file.incremental
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (stream(["a"]), None))
    assert file.save(final=False) is False and held(path) == {"inductor": ["a", "b"]}  # a restart, state 1
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (stream(["a"], ["c"]), None))
    assert file.save(final=False) is True and held(path) == {"inductor": ["a", "b", "c"]}  # something new
    assert file.save() is False  # and not written again for the same set


def test_torch_keeps_only_the_last_entry_of_a_kind_which_is_why_the_stream_is_merged_here():
    """If torch's loader ever reads every entry, the merge in CompileArtifacts can go."""
    from torch.compiler._cache import CacheArtifactManager

    twice = stream(["a"], ["b"])
    assert [a.key for a in CacheArtifactManager.deserialize(twice)["inductor"]] == ["b"]
    merged = pipeline._write_stream(pipeline._read_stream(twice))
    assert sorted(a.key for a in CacheArtifactManager.deserialize(merged)["inductor"]) == ["a", "b"]
