"""``hotlora serve`` started cold and restarted on its caches: process start to ``/readyz`` 200, and
where the time goes before the warm-up, read off the server's own log lines.

Usage: .venv/bin/python bench/serve_restart.py [--restarts 3] [--baseline-src DIR] [--engine-kills K]
Each start is a real ``hotlora serve`` of the built-in tiny model (compiled, the engine in its
own process, as ``make serve`` runs it) with its own ``--compile-cache-dir`` and inductor cache:
cold with both empty, then restarts on the same two folders (a restarted container on its cache
volume). ``--baseline-src``: the ``src`` folder of another checkout (a worktree of an earlier
commit), put first on ``PYTHONPATH``; its cold start and restarts run interleaved with this
checkout's, each on caches of its own, so the two are compared in one run on one machine.
``--engine-kills``: then servers of this checkout on its caches, each ready, settled, its engine
process killed (SIGKILL) and timed until ``/readyz`` is 200 again: with the spare engine process
and without (``--no-engine-spare-process``), interleaved.
Writes bench/results/serve_restart.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

READY_BOUND_S = 1800  # a cold compile of the tiny model takes 1-2 minutes on 2 cores
SETTLE_S = 10.0  # after ready, before an engine is killed: a spare's imports take ~4 s on 2 cores
# The log lines that mark the phases (first match of each, seconds from the process's start).
MARKS = {
    "first log line": r"hotlora\.server\.run: serving",
    "memory plan": r"hotlora\.server\.run: memory plan",
    "engine imports done": r"engine\[\d+\] hotlora\.engine\.process: imports done",  # a spawned-ahead child's
    "engine given its model": r"hotlora\.engine\.process: engine process \d+ (started|\(spawned ahead)",
    "engine loading": r"engine\[\d+\] hotlora\.engine\.pipeline: loading",
    "warm-up began": r"engine\[\d+\] hotlora\.engine\.warmup: warm-up:",
    "warm": r"engine\[\d+\] hotlora\.engine\.warmup: warm:",
}


def readyz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as answer:
        return answer.code, json.loads(answer.read() or b"{}")


def kill_engine(port: int) -> float:
    """SIGKILL the server's engine process once the server has settled (a spare's imports done), and
    the seconds until ``/readyz`` is 200 again with another engine process."""
    time.sleep(SETTLE_S)
    pid = readyz(port)[1]["engine"]["engine_pid"]
    began = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while time.perf_counter() - began < READY_BOUND_S:
        try:
            status, body = readyz(port)
            if status == 200 and body["engine"]["engine_pid"] != pid:
                return round(time.perf_counter() - began, 2)
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("the engine process never came back")


def start(folder: Path, port: int, pythonpath: str | None, flags: tuple[str, ...] = (), kill: bool = False) -> dict:
    """One ``hotlora serve`` from process start to ready (``kill``: then its engine process killed,
    and the time until it is ready again), then stopped (SIGTERM)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    began = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "hotlora.cli", "serve", "--port", str(port),
                               "--compile-cache-dir", str(folder / "compile"), *flags],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read():
        for line in server.stdout:
            lines.append((time.perf_counter() - began, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = engine_back = None
    try:
        while ready is None and time.perf_counter() - began < READY_BOUND_S and server.poll() is None:
            try:
                if readyz(port)[0] == 200:
                    ready = time.perf_counter() - began
                    break
            except OSError:
                pass
            time.sleep(0.1)
        if ready is not None and kill:
            engine_back = kill_engine(port)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=10)
    if ready is None:
        raise SystemExit("the server was not ready:\n" + "".join(line for _, line in lines[-40:]))
    marks = {}
    for name, pattern in MARKS.items():
        marks[name] = next((round(at, 2) for at, line in lines if re.search(pattern, line)), None)
    return {"ready_s": round(ready, 2), "marks": marks, "load_average": round(os.getloadavg()[0], 2),
            **({"engine_back_s": engine_back} if kill else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--baseline-src", default=None, help="another checkout's src folder, compared side by side")
    parser.add_argument("--engine-kills", type=int, default=0,
                        help="then this checkout's engine process killed in as many servers with its spare and as "
                             "many without (--no-engine-spare-process), interleaved, on the same caches")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    from bench.harness import free_port, markdown_table, write_results

    variants = {"this checkout": None}
    if args.baseline_src:
        variants = {"baseline": str(Path(args.baseline_src).resolve()), **variants}
    runs: dict[str, dict] = {name: {"cold": None, "restarts": []} for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        order = list(variants)
        for round_ in range(args.restarts + 1):
            for name in (order if round_ % 2 == 0 else order[::-1]):  # interleaved, alternating who goes first
                folder = Path(tmp) / name.replace(" ", "-")
                result = start(folder, free_port(), variants[name])
                if round_ == 0:
                    runs[name]["cold"] = result
                else:
                    runs[name]["restarts"].append(result)
                print(name, "cold" if round_ == 0 else f"restart {round_}", result, flush=True)

        kills: dict[str, list[float]] = {"spare": [], "no spare": []}
        for round_ in range(args.engine_kills):
            for name in (list(kills) if round_ % 2 == 0 else list(kills)[::-1]):
                flags = () if name == "spare" else ("--no-engine-spare-process",)
                result = start(Path(tmp) / "this-checkout", free_port(), None, flags, kill=True)
                kills[name].append(result["engine_back_s"])
                print("engine killed,", name, result, flush=True)

    rows = []
    for name, run in runs.items():
        cold, restarts = run["cold"], run["restarts"]
        median = statistics.median(r["ready_s"] for r in restarts)
        rows.append([name, "cold", cold["ready_s"], "", *("" if cold["marks"][mark] is None else cold["marks"][mark]
                                                            for mark in MARKS)])
        rows.append([name, f"restart (median of {len(restarts)})", round(median, 2),
                     f"{median / cold['ready_s']:.1%}",
                     *(round(statistics.median(r["marks"][mark] for r in restarts if r["marks"][mark] is not None), 2)
                       if any(r["marks"][mark] is not None for r in restarts) else "" for mark in MARKS)])
        rows.append([name, "restarts, each", ", ".join(str(r["ready_s"]) for r in restarts), "", *[""] * len(MARKS)])
    table = markdown_table(["code", "start", "to /readyz 200 (s)", "restart / cold",
                            *(f"{mark} (s)" for mark in MARKS)], rows)
    if args.engine_kills:
        cold = runs["this checkout"]["cold"]["ready_s"]
        table += "\n\n" + markdown_table(
            ["this checkout's engine process killed (SIGKILL)", "to /readyz 200 again (s), each", "median",
             "median / this checkout's cold start"],
            [[name, ", ".join(map(str, times)), round(statistics.median(times), 2), f"{statistics.median(times) / cold:.1%}"]
             for name, times in kills.items()])
    loads = [r["load_average"] for run in runs.values() for r in [run["cold"], *run["restarts"]]]
    write_results(args.out, "serve_restart", {"args": vars(args), "runs": runs, "engine_kills": kills}, table,
                  f"`hotlora serve` of the built-in tiny model, compiled, engine process; load average (1 min) at "
                  f"the starts' ends {min(loads)}-{max(loads)}. The phase columns: seconds from the process's start "
                  f"to the first log line of each (a restart's: the median).")


if __name__ == "__main__":
    main()
