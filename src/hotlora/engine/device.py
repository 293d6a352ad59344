"""Where the engine runs: the default device and dtype, and waiting for a device's queued work."""

from __future__ import annotations

import threading

import torch


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    # bf16 is what production Flux/SDXL run in on GPUs; CPUs are for tests, where exactness matters.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def synchronize(device) -> None:
    """Wait for the work queued on ``device``. diffusers returns latents without a host sync and
    CUDA copies are asynchronous: a timer read before this misses the last kernels. Called at
    measurement boundaries only, never inside the denoising loop. A no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":  # mps, xpu, ...: each backend module has its own synchronize
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


_isa_probe: threading.Thread | None = None


def probe_cpu_isa_ahead() -> threading.Thread | None:
    """Start inductor's CPU vector-ISA probe in a thread, once per process, where no CUDA device is
    visible (the process compiles CPU kernels). Why: inductor picks the ISA of its CPU kernels by
    building a probe library and loading it in a new Python subprocess, once per ISA the CPU claims,
    inside the first compile: 1.3 s on this machine's CPU (three ISAs), measured, in every start,
    a restart from the compile artifacts included. In a thread, those subprocesses run on another
    core while the engine imports and loads. The result lands in inductor's own process-wide
    cache (``valid_vec_isa_list``), which the first compile then reads."""
    global _isa_probe
    if _isa_probe is not None or torch.cuda.is_available():
        return _isa_probe

    def probe():
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            pick_vec_isa()
        except Exception:  # the first compile probes again and reports what fails
            pass

    _isa_probe = threading.Thread(target=probe, name="hotlora-isa-probe", daemon=True)
    _isa_probe.start()
    return _isa_probe
