"""The chunk-size measurement (``batch_size="auto"``, engine/warmup.py), saved beside the compile
artifacts so a restart measures nothing.

Why: at full size on a CPU the measurement took ~640 s of a 1,002 s start (sizes 1, 3, 5 and 6
timed twice, with and without CFG), repeated on every start. Its result depends only on what the
graphs run and where: the compile fingerprint (model, family, slots, ranks, rank buckets, batch
limit, sizes, dtype, attention, compile mode, quantization, step cache), the torch version, the
hardware (device type and name, CPU threads), and how it was measured (steps, repeats,
candidates, budget). All of it is the record's key; a record under any other key is not used.

A record is JSON (never unpickled), but it still decides how every pack runs, so it is read under
the compile artifacts' trust rules (``pipeline.untrusted_because``: only this user or root could
have written it) and checked against what this engine can run: every key present, every choice a
compiled candidate. Anything else is ignored with a log line and the measurement runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from hotlora.engine.pipeline import untrusted_because, write_private
from hotlora.engine.warmup import TIMED_REPEATS, TIMED_STEPS, candidates, chunk_key, guidance_scales, measure_chunks

log = logging.getLogger(__name__)

SCHEMA = 1


def measured_chunks(engine, fingerprint: str | None) -> dict[str, dict]:
    """The engine's chunk sizes: saved by an earlier start under the same key, else measured now
    (within ``chunk_budget_s``) and saved in ``compile_cache_dir``. No cache folder: measured only."""
    budget = engine.config.chunk_budget_s or None  # 0: no bound
    if fingerprint is None:
        return measure_chunks(engine, budget)
    key = record_key(fingerprint, engine.device, compile_mode=engine.compile_mode, budget_s=budget,
                     steps=TIMED_STEPS, repeats=TIMED_REPEATS)
    path = record_path(engine.config.compile_cache_dir, key)
    expected = {chunk_key(h, w, engine.uses_cfg(scale)) for h, w in engine.served_sizes
                for scale in guidance_scales(engine)}
    chunks = load(path, key, expected, set(candidates(engine.batch_size)))
    if chunks is None:
        chunks = measure_chunks(engine, budget)
        save(path, key, chunks)
    return chunks


def hardware(device: torch.device) -> dict:
    """What a timing depends on besides the graphs: the accelerator's name, or the CPU's model and
    the threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"device": "cuda", "name": torch.cuda.get_device_name(index),
                "capability": list(torch.cuda.get_device_capability(index))}
    return {"device": device.type, "cpu": _cpu_model(), "machine": platform.machine(),
            "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def record_key(fingerprint: str, device: torch.device, **how) -> str:
    """The full key: the compile fingerprint, torch, the hardware and how it was measured (``how``)."""
    return json.dumps({"schema": SCHEMA, "torch": torch.__version__, "fingerprint": fingerprint,
                       "hardware": hardware(device), **how}, sort_keys=True, default=repr)


def record_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"chunks-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load(path: Path, key: str, expected: set[str], compiled: set[int]) -> dict[str, dict] | None:
    """The measurement saved under ``key``, or None (absent, untrusted, unreadable, another key,
    or not a measurement this engine can run: ``expected`` chunk keys, choices among ``compiled``)."""
    if not path.is_file():
        return None
    reason = untrusted_because(path)
    if reason:
        log.warning("not using the saved chunk-size measurement: %s; measuring again", reason)
        return None
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            raise ValueError("saved under another key")
        chunks = {name: _checked(entry, compiled) for name, entry in saved["chunks"].items()}
        if set(chunks) != expected:
            raise ValueError(f"measured {sorted(chunks)}, this engine serves {sorted(expected)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # json's errors are ValueErrors
        log.warning("ignoring the saved chunk-size measurement %s (%s); measuring again", path, exc)
        return None
    log.info("chunk sizes from %s (measured by an earlier start): %s", path,
             ", ".join(f"{name}: {entry['chosen']}" for name, entry in chunks.items()))
    return chunks


def _checked(entry: dict, compiled: set[int]) -> dict:
    chosen = entry["chosen"]
    if type(chosen) is not int or chosen not in compiled:
        raise ValueError(f"chosen chunk size {chosen!r} is not one compiled for ({sorted(compiled)})")
    # JSON keys are text: back to the integers warmup.measure_chunks writes.
    per_image = {int(batch): float(ms) for batch, ms in entry["ms_per_image"].items()}
    checked = {"chosen": chosen, "ms_per_image": per_image}
    if entry.get("bounded"):
        checked["bounded"] = True
    return checked


def save(path: Path, key: str, chunks: dict[str, dict]) -> bool:
    """Write the measurement atomically, into a folder no other user can write (as the artifacts)."""
    return write_private(path, json.dumps({"key": key, "chunks": chunks}, indent=1).encode(),
                         "the chunk-size measurement")
