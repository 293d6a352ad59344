"""The processes tests/integration/test_crash_consistency.py kills: each writes what a server writes, in
a loop, until it is SIGKILLed. Run as ``python crash_writer.py store|tiny CONFIG_JSON``.

It imports what the writing needs once (torch and diffusers take seconds on 2 cores), says
``ready``, then for each line on stdin (that round's settings, JSON) forks a writer, prints its
pid, reaps it and prints ``reaped <exit code>`` (-9: killed, as the test means it to be). Every
writer is a process of its own: a kill stops it wherever it is, no ``finally`` runs.

``store``: downloads adapters from the loopback server through an ``AdapterStore`` whose RAM and
disk budgets are too small to keep them (so every round downloads, converts, writes and evicts
again), and after each adapter saves compile artifacts and a chunk-size record through the
engine's own writers. ``tiny``: builds the built-in tiny model as ``hotlora serve`` does, then
waits. A writer ends by itself after ``max_s``, should nobody kill it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

RECORD_KEY = "crash-test"


def artifacts_payload(i: int, size: int) -> bytes:
    """Round ``i``'s artifacts: a header naming ``i``, then bytes that differ per round, so the test
    can tell which round wrote what it reads and whether all of it arrived."""
    head = f"artifacts {i}\n".encode()
    pattern = bytes((i * 31 + k) % 251 for k in range(4096))
    return head + (pattern * (size // len(pattern) + 1))[: size - len(head)]


def chunk_record(i: int) -> dict[str, dict]:
    return {"64x64": {"chosen": 1 + i % 4, "ms_per_image": {str(b): float(i * 10 + b) for b in (1, 2, 3, 4)}}}


def prepare_store(config: dict) -> None:
    from hotlora.adapters.format.convert import load_adapter
    from hotlora.adapters.store import AdapterStore  # noqa: F401  (imported before the forks)
    from hotlora.families import family_named

    load_adapter(Path(config["warm"]), family_named("flux"))  # diffusers' converters import on first use


def store_loop(config: dict) -> None:
    from hotlora.adapters.store import AdapterStore
    from hotlora.engine.pipeline import write_private
    from hotlora.engine.warmup import save_measurement
    from hotlora.families import family_named
    from hotlora.settings import StoreConfig

    store = AdapterStore(StoreConfig(**config["store"]), family_named("flux"))  # sweeps, as a start does
    artifacts, record = Path(config["artifacts"]), Path(config["record"])
    began, i = time.monotonic(), config["first_round"]
    while time.monotonic() - began < config["max_s"]:
        for url in config["urls"]:
            store.get(url)
            write_private(artifacts, artifacts_payload(i, config["artifacts_bytes"]), "compile artifacts")
            save_measurement(record, RECORD_KEY, chunk_record(i))
            i += 1


def prepare_tiny(config: dict) -> None:
    import hotlora.tiny  # noqa: F401


def tiny_loop(config: dict) -> None:
    from hotlora.tiny import ensure_tiny_model

    ensure_tiny_model(Path(config["directory"]), "flux")
    time.sleep(config["max_s"])  # built: wait to be killed, as a serving process would


MODES = {"store": (prepare_store, store_loop), "tiny": (prepare_tiny, tiny_loop)}


def main() -> None:
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    prepare, loop = MODES[mode]
    prepare(config)
    print("ready", flush=True)
    for line in sys.stdin:
        settings = {**config, **json.loads(line)}
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                loop(settings)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
