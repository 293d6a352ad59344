"""Killed for real: a process writing what a server writes is SIGKILLed at random points (seeded),
again and again; after each kill the next start must find every file whole or absent, never cut
short, and no leftovers once it has swept.

The writer (``crash_writer.py``) downloads adapters from a loopback HTTP server into the store
(download folders, disk-cache entries and their evictions), saves compile artifacts and a chunk
record through the engine's writers, or builds the built-in tiny model. The checks here run in
this process, as the restarted server would: open the store, sweep, read every entry back and
compare it with the source it came from.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.store import AdapterStore
from hotlora.durable import SIDECAR, TMP
from hotlora.engine.pipeline import read_private, sweep_compile_cache
from hotlora.engine.warmup import load_measurement
from hotlora.families import family_named
from hotlora.settings import StoreConfig

from ..helpers import Files, serving, write_lora
from .crash_writer import RECORD_KEY, artifacts_payload, chunk_record

FLUX = family_named("flux")
WRITER = Path(__file__).with_name("crash_writer.py")
SRC = Path(__file__).resolve().parents[2] / "src"
ADAPTERS = 6
ROUNDS = 10
ARTIFACTS_BYTES = 8 * 1024 * 1024  # a write that takes long enough for kills to land inside some
ARTIFACTS, RECORD = "compile-artifacts-crash.bin", "chunks-crash.json"


class Paced(Files):
    """Its own files and counters (``Files`` keeps them on the class); bodies trickle in 64 KiB pieces."""

    files: dict = {}
    gets: dict = {}
    heads: dict = {}
    fail_next: dict = {}
    pace_s = 0.01


class Writer:
    """``crash_writer.py`` in a process of its own: ``kill_a_round`` forks a writer there, lets it
    run ``after_s`` and SIGKILLs it."""

    def __init__(self, mode: str, config: dict, log: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        self.log = log
        self._stderr = open(log, "w")
        self.process = subprocess.Popen([sys.executable, str(WRITER), mode, json.dumps(config)], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line.strip()) for line in self.process.stdout],
                         daemon=True).start()
        self._expect("ready")

    def _line(self) -> str:
        try:
            return self.lines.get(timeout=120)
        except queue.Empty:
            pytest.fail(f"the writer stopped answering; its log:\n{self.log.read_text()[-3000:]}")

    def _expect(self, word: str) -> str:
        line = self._line()
        assert line.startswith(word), f"{line!r}; the writer's log:\n{self.log.read_text()[-3000:]}"
        return line

    def kill_a_round(self, after_s: float, **settings) -> None:
        self.process.stdin.write(json.dumps(settings) + "\n")
        self.process.stdin.flush()
        pid = int(self._line())
        time.sleep(after_s)
        os.kill(pid, signal.SIGKILL)
        # -9: it was still writing when killed; anything else is a failure of the writer itself.
        assert self._expect("reaped") == "reaped -9", f"the writer's log:\n{self.log.read_text()[-3000:]}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.stdin.close()  # its loop ends: it exits once its last writer is reaped
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a writer that was never killed (a failure above): end it all
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self._stderr.close()


ENTRY = re.compile(r"^[0-9a-f]{64}\.(safetensors|sha256)$")


def leftovers(cache: Path, compile_dir: Path) -> list[str]:
    """Whatever is not an entry, the artifacts, the record or their sidecars, whatever its name:
    what a kill leaves and a start must sweep."""
    wanted = {name + suffix for name in (ARTIFACTS, RECORD) for suffix in ("", SIDECAR)}

    def names(folder: Path) -> list[str]:  # a writer killed before its store made the folder: nothing there
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    return ([f"downloads/{n}" for n in names(cache / "downloads")]
            + [f"adapters/{n}" for n in names(cache / "adapters") if not ENTRY.match(n)]
            + [f"compile/{n}" for n in names(compile_dir) if n not in wanted])


def same_adapter(served, source) -> None:
    assert served.name == source.name and served.sha256 == source.sha256 and served.layout == source.layout
    assert set(served.modules) == set(source.modules), served.name
    for module, weights in source.modules.items():
        got = served.modules[module]
        assert torch.equal(got.down.float(), weights.down.float()) and torch.equal(got.up.float(), weights.up.float())
        assert got.scaling == weights.scaling, module


@dataclass
class Seen:
    """What the restarts found, over all rounds."""

    left_by_kills: list = field(default_factory=list)
    entries_served: int = 0
    artifacts_read: set = field(default_factory=set)
    records_read: int = 0


def restart_and_check(store_settings: dict, compile_dir: Path, expected: dict, seen: Seen) -> AdapterStore:
    """What a start after the kill does (the store sweeps its folders, the engine its compile cache),
    then every file read back: whole and equal to what was written, or absent."""
    cache = Path(store_settings["cache_dir"])
    seen.left_by_kills += leftovers(cache, compile_dir)
    store = AdapterStore(StoreConfig(**store_settings), FLUX)
    sweep_compile_cache(compile_dir)
    assert leftovers(cache, compile_dir) == []
    for key in store.disk.keys():
        adapter = store.disk.get(key)
        if adapter is not None:  # None: discarded as not whole (data without its checksum)
            same_adapter(adapter, expected[adapter.name])
            seen.entries_served += 1
    data = read_private(compile_dir / ARTIFACTS, "compile artifacts")
    if data is not None:  # whole, and exactly what one round wrote
        i = int(data.split(b"\n", 1)[0].removeprefix(b"artifacts "))
        assert data == artifacts_payload(i, ARTIFACTS_BYTES)
        seen.artifacts_read.add(i)
    chunks = load_measurement(compile_dir / RECORD, RECORD_KEY, {"64x64"}, {1, 2, 3, 4})
    if chunks is not None:  # whole, and exactly what one round wrote (its number is in the timings)
        i = int(chunks["64x64"]["ms_per_image"][1]) // 10
        written = chunk_record(i)["64x64"]
        assert chunks == {"64x64": {"chosen": written["chosen"],
                                    "ms_per_image": {int(b): ms for b, ms in written["ms_per_image"].items()}}}
        seen.records_read += 1
    return store


def test_kills_during_downloads_cache_writes_and_artifact_saves_leave_nothing_half_written(tmp_path):
    rng = random.Random(36)
    sources = tmp_path / "sources"
    for i in range(ADAPTERS):  # ~0.5 MiB each: eight 2048-wide modules at rank 4
        write_lora(sources / f"a{i}.safetensors", seed=i, modules=8, rank=4, dim=2048)
    Paced.files = {f"/a{i}.safetensors": (sources / f"a{i}.safetensors").read_bytes() for i in range(ADAPTERS)}
    compile_dir = tmp_path / "compile"
    compile_dir.mkdir(mode=0o700)
    seen = Seen()
    with serving(Paced) as base:
        urls = [f"{base}/a{i}.safetensors" for i in range(ADAPTERS)]
        store_settings = dict(
            cache_dir=str(tmp_path / "cache"), allow_http=True, allowed_hosts=["127.0.0.1"], backoff_s=0.01,
            # Too small to keep them all: every round of the writer downloads, converts, writes and evicts.
            ram_max_entries=1, disk_budget_bytes=int(2.5 * len(Paced.files["/a0.safetensors"])))
        expected = {url: load_adapter(sources / f"a{i}.safetensors", FLUX, name=url) for i, url in enumerate(urls)}
        config = {"store": store_settings, "urls": urls, "artifacts": str(compile_dir / ARTIFACTS),
                  "record": str(compile_dir / RECORD), "artifacts_bytes": ARTIFACTS_BYTES, "max_s": 60,
                  "warm": str(sources / "a0.safetensors")}
        with Writer("store", config, tmp_path / "writer.log") as writer:
            for round_ in range(ROUNDS):
                writer.kill_a_round(rng.uniform(0.05, 1.5), first_round=round_ * 1000)
                store = restart_and_check(store_settings, compile_dir, expected, seen)
        for url in urls:  # and every adapter the restarted store serves equals its source
            same_adapter(store.get(url), expected[url])
    # The kills did land inside writes (else this test proved nothing), and whole files were read back.
    assert seen.left_by_kills, f"no kill interrupted a download or a write: {seen}"
    assert seen.entries_served and seen.artifacts_read and seen.records_read, seen


def test_a_start_killed_while_building_the_tiny_model_never_leaves_one_that_looks_built(tmp_path):
    from diffusers import DiffusionPipeline

    from hotlora.tiny import BUILT, ensure_tiny_model

    rng = random.Random(4)
    cache = tmp_path / "cache"
    tiny = cache / "tiny-flux"
    left_by_kills = []
    with Writer("tiny", {"directory": str(tiny), "max_s": 60}, tmp_path / "writer.log") as writer:
        for _ in range(3):
            writer.kill_a_round(rng.uniform(0.3, 6.0))  # the build takes ~7 s here
            left_by_kills += [p.name for p in cache.iterdir() if p.name.startswith(TMP)]
            # What a restart trusts: no folder at all, or a whole one that says so.
            assert not tiny.exists() or (tiny / BUILT).is_file()
    if not tiny.exists():  # an older version's build, cut short: files, but no mark
        (tiny / "transformer").mkdir(parents=True)
        (tiny / "model_index.json").write_text("{}")

    ensure_tiny_model(tiny, "flux")
    assert [p.name for p in cache.iterdir()] == ["tiny-flux"]  # leftovers swept
    pipeline = DiffusionPipeline.from_pretrained(str(tiny), local_files_only=True)
    assert pipeline.transformer is not None
    for line in (tiny / "adapters" / "catalog.toml").read_text().splitlines():
        if line.startswith("ref = "):
            assert (tiny / "adapters" / line.removeprefix("ref = ").strip('"')).exists()
    assert left_by_kills, "no kill landed inside a build"
