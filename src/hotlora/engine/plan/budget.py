"""How much memory a plan is measured against: a named accelerator, a size, or this machine's."""

from __future__ import annotations

import re

GB, GiB = 10**9, 2**30
# Nominal capacities (decimal GB, as sold). The memory torch reports on these cards is a little
# larger (an H100 80GB reports ~79.6 GiB = 85.5e9 bytes), so the nominal figure errs on the safe side.
ACCELERATORS = {
    "h100-80gb": 80 * GB,
    "h200-141gb": 141 * GB,
    "a100-80gb": 80 * GB,
    "l40s-48gb": 48 * GB,
}
# Outside torch's allocator on a GPU: the CUDA context, kernels' modules and library workspaces.
# Assumed (typically 0.5-1 GiB on recent cards with torch); no GPU was lent to measure it here.
CUDA_RUNTIME_BYTES = 1 * GiB
# The activation model's coefficients are CPU measurements; on CUDA the allocator's peak above the
# static tensors for one decoded pack (full-size Flux, bf16, compiled, 6 images at 1536x1024) was
# 19.91 GiB against 12.17 GiB planned (an H200, bench/gpu_rows.py plan_check): the plan scales its
# activation lines on CUDA by that ratio. One measurement, one size: a margin, not a model.
CUDA_ACTIVATION_FACTOR = 19.914 / 12.166
# On a CPU the process itself: Python, torch, diffusers, transformers and, compiled, inductor's
# kernels. Measured: peak RSS of the tiny-Flux engine, whose own tensors are a few MB
# (bench/results/memory.md: 436 MiB eager, 604 MiB compiled).
CPU_RUNTIME_BYTES = {False: 436 * 2**20, True: 604 * 2**20}
# ``hotlora serve``'s spare engine process (``engine_spare_process``): its imports done, no model, no
# device memory. Measured (psutil): 416 MiB resident (324 MiB of it its own) in the dev install, 313
# MB in the image; the larger is planned.
SPARE_PROCESS_BYTES = 416 * 2**20
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": GB, "gb": GB, "t": 10**12,
         "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1.5TB`` or a number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"a memory size is a number with a unit (24GiB, 80GB, 512MiB), got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def format_bytes(nbytes: int | float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def this_machine(device_type: str, device: str | None = None) -> tuple[int, str]:
    """The budget the server checks at start-up: the CUDA device's total memory, or the RAM
    available now on a CPU (psutil)."""
    if device_type == "cuda":
        import torch

        index = torch.device(device or "cuda").index or 0
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index} total memory"
    import psutil

    return psutil.virtual_memory().available, "available RAM"


__all__ = ["ACCELERATORS", "CPU_RUNTIME_BYTES", "CUDA_ACTIVATION_FACTOR", "CUDA_RUNTIME_BYTES", "SPARE_PROCESS_BYTES", "format_bytes", "parse_bytes", "this_machine"]
