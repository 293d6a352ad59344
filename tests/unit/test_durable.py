"""hotlora.durable: files written whole or not at all, read only when whole, leftovers of the dead swept."""

import hashlib
import logging
import os
import time

import pytest

from hotlora import durable

from ..helpers import dead_pid


def tmp_names(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(durable.TMP))


def test_a_verified_write_reads_back_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "record.bin"
    durable.write_verified(path, b"payload" * 1000)
    assert durable.read_verified(path, "record") == b"payload" * 1000
    assert durable.sidecar_of(path).read_text() == hashlib.sha256(b"payload" * 1000).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.bin", "record.bin.sha256"]
    assert path.stat().st_mode & 0o077 == 0  # compile artifacts are pickles: nobody else reads or writes them


def test_a_rewrite_replaces_the_whole_file(tmp_path):
    path = tmp_path / "record.bin"
    durable.write_verified(path, b"a much longer first version")
    durable.write_verified(path, b"second")
    assert durable.read_verified(path, "record") == b"second"


def test_an_absent_file_is_none_without_a_word(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert durable.read_verified(tmp_path / "never.bin", "record") is None
    assert caplog.text == ""


@pytest.mark.parametrize("damage", ["cut short", "wrong hash", "no sidecar", "empty"])
def test_a_file_that_is_not_whole_reads_as_absent_and_is_removed(tmp_path, caplog, damage):
    path = tmp_path / "record.bin"
    durable.write_verified(path, b"0123456789" * 100)
    sidecar = durable.sidecar_of(path)
    if damage == "cut short":
        with open(path, "r+b") as file:
            file.truncate(500)
    elif damage == "wrong hash":
        sidecar.write_text("0" * 64)
    elif damage == "no sidecar":
        sidecar.unlink()
    else:
        path.write_bytes(b"")
    reasons = []
    with caplog.at_level(logging.WARNING, logger="hotlora.durable"):
        assert durable.read_verified(path, "record", on_corrupt=reasons.append) is None
    assert len(reasons) == 1 and "discarded" in caplog.text and str(path) in caplog.text
    assert not path.exists() and not sidecar.exists()
    assert durable.read_verified(path, "record") is None  # and stays absent


def test_a_named_sidecar_is_the_one_read_and_removed(tmp_path):
    path, sidecar = tmp_path / "key.safetensors", tmp_path / "key.sha256"
    durable.write_verified(path, b"entry", sidecar)
    assert durable.read_verified(path, "entry", sidecar) == b"entry"
    assert not durable.sidecar_of(path).exists()
    sidecar.write_text("f" * 64)
    assert durable.read_verified(path, "entry", sidecar) is None and not sidecar.exists()


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "record.bin"
    durable.write_verified(path, b"old")

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError):
        durable.write_atomic(path, b"new")
    monkeypatch.undo()
    assert tmp_names(tmp_path) == [] and durable.read_verified(path, "record") == b"old"


def test_a_sidecar_that_cannot_be_written_takes_its_data_with_it(tmp_path, monkeypatch):
    real = durable.write_atomic

    def sidecar_fails(path, data):
        if path.name.endswith(durable.SIDECAR):
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(durable, "write_atomic", sidecar_fails)
    with pytest.raises(OSError):
        durable.write_verified(tmp_path / "record.bin", b"data")
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_removes_only_what_dead_processes_left(tmp_path, caplog):
    host = durable.owner_tag().rsplit("+", 1)[0]
    dead = tmp_path / f"{durable.TMP}{host}+{dead_pid()}+abcdefgh"
    live = tmp_path / f"{durable.TMP}{host}+{os.getppid()}+abcdefgh"  # alive, and started before it wrote
    mine = tmp_path / f"{durable.TMP}{durable.owner_tag()}+abcdefgh"  # this process may be writing it
    elsewhere = tmp_path / f"{durable.TMP}elsewhere.example+{dead_pid()}+abcdefgh"  # cannot be asked: kept
    ancient = tmp_path / f"{durable.TMP}elsewhere.example+1+abcdefgh"
    dead_dir = tmp_path / f"{durable.TMP}{host}+{dead_pid()}+tiny-flux-xyz"  # a half-built folder
    entry = tmp_path / "record.bin"  # not a temporary name: never swept, however old
    for path in (dead, live, mine, elsewhere, ancient, entry):
        path.write_bytes(b"partial")
    dead_dir.mkdir()
    (dead_dir / "model_index.json").write_text("{}")
    day_ago = time.time() - durable.ORPHAN_AGE_S - 3600
    for path in (ancient, entry):
        os.utime(path, (day_ago, day_ago))
    with caplog.at_level(logging.WARNING, logger="hotlora.durable"):
        assert durable.sweep_orphans(tmp_path, durable.TMP) == 3
    assert tmp_names(tmp_path) == sorted(p.name for p in (elsewhere, live, mine))
    assert entry.exists()
    assert dead.name in caplog.text and dead_dir.name in caplog.text  # the log says what was removed


def test_a_published_folder_arrives_whole_and_a_second_build_gives_way(tmp_path):
    target = tmp_path / "model"
    first = durable.temp_dir(tmp_path, "model-")
    (first / "a.json").write_text("first")
    assert first.name.startswith(f"{durable.TMP}{durable.owner_tag()}+model-")
    second = durable.temp_dir(tmp_path, "model-")
    (second / "a.json").write_text("second")
    assert durable.publish_dir(first, target) is True
    assert durable.publish_dir(second, target) is False
    assert (target / "a.json").read_text() == "first" and not second.exists() and not first.exists()


# ----------------------------------------------------------------------------- the built-in tiny model


@pytest.fixture
def fake_builds(monkeypatch):
    """``save_tiny_model`` replaced by one that writes a model index and an adapter folder, or,
    for the first ``fail[0]`` calls, raises half-way."""
    from hotlora import tiny

    builds, fail = [], [0]

    def build(directory, family):
        (directory / "model_index.json").write_text("{}")
        if fail[0]:
            fail[0] -= 1
            raise RuntimeError("the build broke half-way")
        (directory / "adapters").mkdir()
        (directory / "adapters" / "catalog.toml").write_text("")
        builds.append(directory)

    monkeypatch.setattr(tiny, "save_tiny_model", build)
    return tiny, builds, fail


def test_the_tiny_model_is_built_once_and_then_trusted(tmp_path, fake_builds):
    tiny, builds, _ = fake_builds
    target = tmp_path / "cache" / "tiny-flux"
    assert tiny.ensure_tiny_model(target, "flux") == target
    assert (target / tiny.BUILT).is_file() and (target / "adapters" / "catalog.toml").is_file()
    tiny.ensure_tiny_model(target, "flux")
    assert len(builds) == 1 and [p.name for p in target.parent.iterdir()] == ["tiny-flux"]


def test_a_tiny_model_without_its_mark_is_rebuilt_and_a_failed_build_leaves_nothing(tmp_path, fake_builds, caplog):
    tiny, builds, fail = fake_builds
    target = tmp_path / "cache" / "tiny-flux"
    target.mkdir(parents=True)
    (target / "model_index.json").write_text("{}")  # what an older version's build, killed, left
    fail[0] = 1
    with caplog.at_level(logging.WARNING, logger="hotlora.tiny"), pytest.raises(RuntimeError):
        tiny.ensure_tiny_model(target, "flux")
    assert "build never finished" in caplog.text and str(target) in caplog.text
    assert list(target.parent.iterdir()) == []  # the half-built folder removed, the failed build too
    tiny.ensure_tiny_model(target, "flux")
    assert len(builds) == 1 and (target / tiny.BUILT).is_file()
