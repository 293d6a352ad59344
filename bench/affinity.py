"""Adapter affinity on Ray Serve against round-robin: RAM-cache hit rate, bytes fetched, latency.

K users send requests with Zipf-distributed popularity to N replicas. Each replica simulates one
hotlora worker: a RAM LRU of C identity adapters (C = Serve's max_num_models_per_replica), a fetch
whose latency grows with the adapter's size on a miss (fetches overlap, as the store's do), and one
"GPU" that generates one request at a time. No model is loaded: only routing and caching differ.

Three routings of the same request sequence, in one run, on one local Ray cluster:
  affinity     one deployment of N replicas, handle.options(multiplexed_model_id=user): Serve's
               model multiplexing (what hotlora.scaleout uses)
  serve-p2c    the same deployment without a multiplexed id: Serve's default power-of-two-choices
  round-robin  N single-replica deployments, request i sent to replica i mod N

Usage: .venv/bin/python bench/affinity.py [--users 200] [--replicas 4] [--requests 1500] [--out bench/results]
Writes affinity.json and affinity.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import time
from collections import OrderedDict
from pathlib import Path

MiB = 1024**2


def zipf_requests(users: int, requests: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (k ** s) for k in range(1, users + 1)]
    order = list(range(users))
    rng.shuffle(order)  # popularity is not the user's number (multiplexing must not depend on it)
    return [order[k] for k in rng.choices(range(users), weights=weights, k=requests)]


def adapter_sizes(users: int, seed: int, low_mib: int, high_mib: int) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(low_mib, high_mib) * MiB for _ in range(users)]


def make_replica_class(serve):
    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class SimulatedReplica:
        """A stand-in for ModelReplica: the RAM cache, the fetch and the one-at-a-time GPU, in sleeps."""

        def __init__(self, capacity: int, fetch_base_s: float, bandwidth: float, generate_s: float):
            self.capacity, self.fetch_base_s, self.bandwidth, self.generate_s = capacity, fetch_base_s, bandwidth, generate_s
            self.ram: OrderedDict[str, int] = OrderedDict()
            self.gpu = asyncio.Lock()
            self.id = serve.get_replica_context().replica_id.unique_id

            @serve.multiplexed(max_num_models_per_replica=capacity)
            async def hold(user: str):
                return user  # the fetch itself is below, shared by every routing

            self.hold = hold

        async def __call__(self, user: str, nbytes: int) -> dict:
            if serve.get_multiplexed_model_id():
                await self.hold(user)
            hit = user in self.ram
            if hit:
                self.ram.move_to_end(user)
            else:
                await asyncio.sleep(self.fetch_base_s + nbytes / self.bandwidth)
                self.ram[user] = nbytes
                while len(self.ram) > self.capacity:
                    self.ram.popitem(last=False)
            async with self.gpu:
                await asyncio.sleep(self.generate_s)
            return {"hit": hit, "fetched": 0 if hit else nbytes, "replica": self.id}

    return SimulatedReplica


async def drive(send, sequence: list[int], sizes: list[int], concurrency: int) -> dict:
    """Send every request (at most ``concurrency`` in flight); latency is seen from the client."""
    gate = asyncio.Semaphore(concurrency)
    latencies, hits, fetched, replicas = [], 0, 0, set()

    async def one(i: int, user: int):
        nonlocal hits, fetched
        async with gate:
            began = time.perf_counter()
            out = await send(i, f"user-{user}", sizes[user])
            latencies.append(time.perf_counter() - began)
            hits += out["hit"]
            fetched += out["fetched"]
            replicas.add(out["replica"])

    began = time.perf_counter()
    await asyncio.gather(*(one(i, u) for i, u in enumerate(sequence)))
    wall = time.perf_counter() - began
    latencies.sort()
    return {"requests": len(sequence), "hit_rate": round(hits / len(sequence), 4), "bytes_fetched": fetched,
            "gib_fetched": round(fetched / 1024**3, 2),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p95_ms": round(latencies[int(0.95 * (len(latencies) - 1))] * 1000, 1),
            "throughput_rps": round(len(sequence) / wall, 1), "replicas_used": len(replicas)}


def run(args) -> dict:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING)
    try:
        Replica = make_replica_class(serve)
        settings = (args.capacity, args.fetch_base_ms / 1000, args.bandwidth_mib_s * MiB, args.generate_ms / 1000)
        pooled = serve.run(Replica.options(num_replicas=args.replicas).bind(*settings), name="pooled", route_prefix=None)
        singles = [serve.run(Replica.bind(*settings), name=f"rr-{i}", route_prefix=None) for i in range(args.replicas)]
        sequence = zipf_requests(args.users, args.requests, args.zipf_s, args.seed)
        sizes = adapter_sizes(args.users, args.seed, args.low_mib, args.high_mib)

        routings = {
            "affinity": lambda i, user, n: pooled.options(multiplexed_model_id=user).remote(user, n),
            "serve-p2c": lambda i, user, n: pooled.remote(user, n),
            "round-robin": lambda i, user, n: singles[i % len(singles)].remote(user, n),
        }

        async def measure_all():
            results = {}
            for name, route in routings.items():
                # A fresh cache per routing: every routing starts cold from the same state.
                for handle in (pooled, *singles):
                    await asyncio.gather(*(handle.remote(f"flush-{name}-{k}", 0) for k in range(4 * args.capacity)))

                async def send(i, user, n, route=route):
                    return await route(i, user, n)

                results[name] = await drive(send, sequence, sizes, args.concurrency)
                print(name, results[name], flush=True)
            return results

        return asyncio.run(measure_all())
    finally:
        serve.shutdown()
        ray.shutdown()


def markdown(report: dict) -> str:
    p = report["parameters"]
    base = report["results"]["round-robin"]
    lines = [
        f"Machine: {report['machine']}. Ray {report['ray']}. {p['users']} users, Zipf s={p['zipf_s']}, "
        f"{p['requests']} requests, {p['concurrency']} in flight, {p['replicas']} replicas of "
        f"{p['capacity']} adapters each, adapters {p['low_mib']}-{p['high_mib']} MiB, simulated fetch "
        f"{p['fetch_base_ms']} ms + size / {p['bandwidth_mib_s']} MiB/s, generation {p['generate_ms']} ms.",
        "",
        "| routing | RAM hit rate | GiB fetched | vs round-robin | p50 (ms) | p95 (ms) | throughput (req/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        ratio = r["bytes_fetched"] / base["bytes_fetched"] if base["bytes_fetched"] else float("nan")
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['gib_fetched']} | {ratio:.2f}x | {r['p50_ms']} | "
                     f"{r['p95_ms']} | {r['throughput_rps']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=8, help="adapters per replica RAM cache")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--low-mib", type=int, default=20)
    parser.add_argument("--high-mib", type=int, default=300)
    parser.add_argument("--fetch-base-ms", type=float, default=20)
    parser.add_argument("--bandwidth-mib-s", type=float, default=2000)
    parser.add_argument("--generate-ms", type=float, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    import ray

    results = run(args)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "ray": ray.__version__,
              "parameters": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "affinity.json").write_text(json.dumps(report, indent=2))
    (out / "affinity.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
