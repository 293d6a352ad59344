"""What the engine process's boundary costs per request, with the records and code that cross it.

Usage: .venv/bin/python bench/ipc.py [--repeats 5]

A child spawned as the engine process is (``multiprocessing`` spawn, the same pipe and torch's
reductions) stands in for the engine: it unpacks what it is sent exactly as ``engine_main`` does
and answers with a pack of uint8 images allocated there, as a run's result is. Timed round trips:

- a request whose adapters the engine already holds (``Held``: only their keys cross);
- a request carrying adapters it has not seen (``Packed.of`` in the server, ``unpack`` in the
  engine): the full SDXL U-Net's attention layers (``fullsize/sdxl.py``, read on the meta device)
  at ranks 32 and 128, in bfloat16, two slots;
- the images of a pack coming back (6 images at 1024x1024 and at 1024x1536) and made PIL.

Writes bench/results/ipc.{json,md}; docs/benchmarks.md compares them with a full-size request.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, write_results  # noqa: E402


def child(conn) -> None:
    import torch
    import torch.multiprocessing  # noqa: F401

    from hotlora.engine.wire import Held

    held = {}
    while True:
        message = conn.recv()
        if message is None:
            return
        request, images = message
        for slot, binding in request.adapters.items():
            adapter = binding.adapter
            held[adapter.key] = held[adapter.key] if isinstance(adapter, Held) else adapter.unpack()
        pixels = torch.empty(images, dtype=torch.uint8) if images else None
        conn.send(("done", pixels))


def sdxl_adapter(rank: int, seed: int):
    import torch

    from hotlora.adapters.format.convert import Adapter, LoraWeights
    from hotlora.fullsize.sdxl import adapter_layers

    generator = torch.Generator().manual_seed(seed)
    layers = adapter_layers()["diffusers_unet"]
    modules = {name: LoraWeights(down=torch.randn(rank, i, generator=generator).to(torch.bfloat16),
                                 up=torch.randn(o, rank, generator=generator).to(torch.bfloat16), scaling=1.0)
               for name, (i, o) in layers.items()}
    return Adapter(name=f"r{rank}-{seed}", family="sdxl", layout="diffusers", modules=modules, sha256=f"{rank}{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"))
    args = parser.parse_args()

    import torch.multiprocessing  # noqa: F401

    from hotlora.adapters.binding import Binding
    from hotlora.engine.wire import Held, Packed
    from hotlora.engine.request import CallParams, PreparedRequest
    from hotlora.engine.results import pil_images

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=child, args=(theirs,), daemon=True)
    process.start()
    params = CallParams(num_inference_steps=30, guidance_scale=5.0, height=1024, width=1024)

    def request(adapters):
        return PreparedRequest(prompt="a portrait " * 20, params=params, adapters=adapters, num_images=6)

    def round_trip(adapters, images=None, to_pil=False) -> float:
        began = time.perf_counter()
        ours.send((request(adapters), images))
        _, pixels = ours.recv()
        if to_pil:
            pil_images(pixels)
        return (time.perf_counter() - began) * 1000

    rows, data = [], {}

    def timed(name, make, what):
        runs = [make() for _ in range(args.repeats)]
        data[name] = {"ms": runs, "median_ms": statistics.median(runs), "what": what}
        rows.append([name, what, round(statistics.median(runs), 2), [round(r, 1) for r in runs]])

    for rank in (32, 128):
        pair = [sdxl_adapter(rank, seed) for seed in (1, 2)]
        nbytes = sum(a.nbytes for a in pair)
        counter = iter(range(10**6))

        def first_time():  # a new pair each time: never held (same tensors, new keys)
            n = next(counter)
            fresh = [Packed.of(dataclasses.replace(a, sha256=f"{a.sha256}-{n}")) for a in pair]
            began = time.perf_counter()
            round_trip({"identity": Binding(fresh[0], 1.0), "style": Binding(fresh[1], 0.7)})
            return (time.perf_counter() - began) * 1000

        def pack_and_send():
            n = next(counter)
            began = time.perf_counter()
            fresh = [Packed.of(dataclasses.replace(a, sha256=f"{a.sha256}-{n}")) for a in pair]
            round_trip({"identity": Binding(fresh[0], 1.0), "style": Binding(fresh[1], 0.7)})
            return (time.perf_counter() - began) * 1000

        timed(f"new adapters r{rank}: packed, sent, unpacked", pack_and_send,
              f"2 adapters, {len(pair[0].modules)} modules each, {nbytes / 2**20:.0f} MiB")
        timed(f"new adapters r{rank}: sent, unpacked (pack excluded)", first_time, "the same")
        keys = {"identity": Binding(Held(pair[0].key), 1.0), "style": Binding(Held(pair[1].key), 0.7)}
        ours.send((request({"identity": Binding(Packed.of(pair[0]), 1.0),
                            "style": Binding(Packed.of(pair[1]), 0.7)}), None))
        ours.recv()
        timed(f"held adapters r{rank}: the request record", lambda: round_trip(keys), "keys only")
    held = {"identity": Binding(Held(sdxl_adapter(32, 1).key), 1.0)}
    for height, width in ((1024, 1024), (1536, 1024)):
        shape = (6, height, width, 3)
        timed(f"6 images {width}x{height} back", lambda: round_trip(held, shape),
              f"{6 * height * width * 3 / 2**20:.0f} MiB uint8, shared memory")
        timed(f"6 images {width}x{height} back, made PIL", lambda: round_trip(held, shape, to_pil=True), "as served")
    ours.send(None)
    process.join(timeout=30)
    table = markdown_table(["round trip", "what crosses", "ms (median)", "runs (ms)"], rows)
    write_results(args.out, "ipc", data, table,
                  "The engine process's boundary: spawn child, one pipe, torch's reductions, the records and "
                  "Packed/Held code of engine/wire.py; the child unpacks as engine_main does.")


if __name__ == "__main__":
    main()
