"""Where the engine runs: the default device and dtype, and waiting for a device's queued work."""

from __future__ import annotations

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
