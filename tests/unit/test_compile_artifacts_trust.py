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
    assert pipeline.load_compile_artifacts(path) is True
    assert unpickler == [b"pickle"]


@pytest.mark.parametrize("place", ["folder", "file"])
def test_artifacts_others_could_write_are_never_unpickled(tmp_path, unpickler, caplog, place):
    path = artifacts(tmp_path / "shared")
    (path.parent if place == "folder" else path).chmod(0o777 if place == "folder" else 0o666)
    with caplog.at_level(logging.WARNING):
        assert pipeline.load_compile_artifacts(path) is False
    assert unpickler == []
    assert "writable by other users" in caplog.text


def test_artifacts_of_another_user_are_never_unpickled(tmp_path, unpickler, monkeypatch):
    path = artifacts(tmp_path / "theirs")
    if os.getuid() == 0:
        os.chown(path, 4242, 4242)  # root can hand the file to another user
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4242)  # or this process pretends to be another user
    assert pipeline.load_compile_artifacts(path) is False
    assert unpickler == []


def test_saving_creates_a_private_folder_and_refuses_a_shared_one(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"pickle", None))
    path = tmp_path / "new" / "compile-artifacts-x.bin"
    assert pipeline.save_compile_artifacts(path) is True
    assert path.read_bytes() == b"pickle"
    assert path.parent.stat().st_mode & 0o077 == 0 and path.stat().st_mode & 0o077 == 0
    assert durable.sidecar_of(path).stat().st_mode & 0o077 == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    assert pipeline.save_compile_artifacts(shared / "compile-artifacts-x.bin") is False
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
        assert pipeline.load_compile_artifacts(path) is False
    assert unpickler == []
    assert "discarded" in caplog.text
    assert not path.exists() and not durable.sidecar_of(path).exists()


def test_a_save_that_fails_costs_the_next_start_a_compile_not_this_one_its_warm_up(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"pickle", None))

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable, "write_atomic", full)
    assert pipeline.save_compile_artifacts(tmp_path / "compile-artifacts-x.bin") is False
