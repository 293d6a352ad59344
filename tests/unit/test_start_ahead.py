"""What a start does ahead of its need, so a restart from the compile artifacts waits less: the
engine process spawned before the server's own start-up, and inductor's CPU ISA probe in a thread."""

import subprocess
import sys

import torch

from hotlora.engine import device
from hotlora.engine.process import SpawnedAhead

PROBE = """
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
from hotlora.engine.device import probe_cpu_isa_ahead
before = valid_vec_isa_list.cache_info().currsize
thread = probe_cpu_isa_ahead()
thread.join(timeout=120)
print(before, valid_vec_isa_list.cache_info().currsize, probe_cpu_isa_ahead() is thread)
"""


def test_the_isa_probe_fills_inductors_own_cache_once_per_process():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "True"]  # empty before, filled by the thread, started once


def test_no_isa_probe_where_cuda_compiles(monkeypatch):
    monkeypatch.setattr(device, "_isa_probe", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.probe_cpu_isa_ahead() is None


def test_an_engine_process_spawned_ahead_is_taken_once_and_discarded_if_not():
    ahead = SpawnedAhead()
    process = ahead.take()[0]
    assert ahead.take() is None  # once
    process.kill()
    process.join(timeout=30)

    untaken = SpawnedAhead()
    child = untaken._spawned[0]
    untaken.discard()  # the server refused to start
    assert not child.is_alive() and untaken.take() is None


def test_a_child_that_died_before_it_was_taken_is_not_used():
    ahead = SpawnedAhead()
    child = ahead._spawned[0]
    child.kill()
    child.join(timeout=30)
    assert ahead.take() is None  # EngineProcess.start spawns a new one
