"""``plan_memory``: a warm engine's memory, part by part, against a budget; the largest chunk that
fits at every served size; a verdict. What ``hotlora plan`` prints and the server checks at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotlora.settings import EngineConfig, format_size
from hotlora.engine.device import default_device
from hotlora.engine.pipeline import resolve_dtype
from hotlora.engine.plan import activations
from hotlora.engine.plan.budget import (CPU_RUNTIME_BYTES, CUDA_ACTIVATION_FACTOR, CUDA_RUNTIME_BYTES, SPARE_PROCESS_BYTES,
                                        format_bytes)
from hotlora.engine.plan.memory import Part, static_parts
from hotlora.engine.plan.models import find_model
from hotlora.families import family_named

MAX_CHUNK_SEARCHED = 64


def _coefficients() -> dict:
    try:
        from hotlora.engine.plan.coefficients import COEFFICIENTS
    except ImportError:  # not calibrated in this checkout: activations are reported as not modelled
        return {}
    return COEFFICIENTS


@dataclass
class SizePlan:
    size: str  # WIDTHxHEIGHT
    chunk: int  # the chunk the engine runs (its compiled batch limit)
    activation_bytes: int | None  # peak at that chunk: max(denoiser forward, VAE decode)
    denoiser_bytes: int | None
    vae_decode_bytes: int | None
    largest_chunk: int | None  # the largest chunk whose peak fits beside the static parts (searched up to 64)
    fits: bool | None  # beside the static parts less the estimates (see MemoryPlan.required_bytes)


@dataclass
class MemoryPlan:
    model: str
    family: str
    device: str
    dtype: str
    budget: int | None
    budget_name: str
    parts: list[Part]
    sizes: list[SizePlan]
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def static_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.where == "device")

    @property
    def host_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if p.where == "host")

    @property
    def estimated_bytes(self) -> int:
        """The device bytes of the parts that are estimates (adapters in use), not engine tensors."""
        return sum(p.bytes for p in self.parts if p.where == "device" and p.estimate)

    @property
    def peak_bytes(self) -> int:
        """The device bytes at the worst served size (static parts + its activation peak)."""
        return self.static_bytes + max((s.activation_bytes or 0 for s in self.sizes), default=0)

    @property
    def required_bytes(self) -> int:
        """The peak without the estimates: what must fit for the engine to start and serve."""
        return self.peak_bytes - self.estimated_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the engine fits (the estimates aside: a plan refused for them would refuse servers
        whose adapters are smaller than the target rank everywhere)."""
        if self.budget is None:
            return None
        if self.static_bytes - self.estimated_bytes > self.budget:
            return False
        return all(s.fits is not False for s in self.sizes)

    @property
    def verdict(self) -> str:
        if self.budget is None:
            return f"needs {format_bytes(self.peak_bytes)} (no budget given)"
        if self.static_bytes - self.estimated_bytes > self.budget:
            return (f"DOES NOT FIT: the weights and adapter buffers alone need "
                    f"{format_bytes(self.static_bytes - self.estimated_bytes)}, "
                    f"over the {format_bytes(self.budget)} of {self.budget_name}")
        unknown = [s.size for s in self.sizes if s.denoiser_bytes is None]
        failing = [s for s in self.sizes if s.fits is False]
        if failing:
            smallest = min((s.largest_chunk or 0) for s in failing)
            hint = (f"; every served size fits with --max-batch-size {smallest} (or --batch-size {smallest})"
                    if smallest else "; not even one image fits at " + ", ".join(s.size for s in failing if not s.largest_chunk))
            return (f"DOES NOT FIT: {', '.join(f'{s.size} at chunk {s.chunk} needs {format_bytes(self.static_bytes + s.activation_bytes)}' for s in failing)}"
                    f" of {format_bytes(self.budget)} ({self.budget_name}){hint}")
        free = self.budget - self.peak_bytes
        if free < 0:  # fits only without the estimates
            return (f"FITS, TIGHT: {format_bytes(self.required_bytes)} of {format_bytes(self.budget)} "
                    f"({self.budget_name}) without the estimates, {format_bytes(self.peak_bytes)} with them (adapters "
                    f"at the target rank in every slot): lower --target-rank or the store's ram_budget_bytes, or "
                    f"serve smaller adapters")
        text = f"FITS: peak {format_bytes(self.peak_bytes)} of {format_bytes(self.budget)} ({self.budget_name}), " \
               f"{format_bytes(free)} to spare"
        if unknown:
            decoded = any(s.vae_decode_bytes is not None for s in self.sizes if s.denoiser_bytes is None)
            text += (f" (denoiser activations not modelled at {', '.join(unknown)}: weights"
                     + (" and the VAE decode" if decoded else "") + " only there)")
        return text

    def as_dict(self) -> dict:
        return {
            "model": self.model, "family": self.family, "device": self.device, "dtype": self.dtype,
            "budget_bytes": self.budget, "budget": self.budget_name, "settings": self.settings,
            "parts": [{"name": p.name, "bytes": p.bytes, "where": p.where, "detail": p.detail, "estimate": p.estimate}
                      for p in self.parts],
            "static_bytes": self.static_bytes, "host_bytes": self.host_bytes,
            "sizes": [s.__dict__ for s in self.sizes], "peak_bytes": self.peak_bytes,
            "required_bytes": self.required_bytes,
            "fits": self.fits, "verdict": self.verdict, "notes": self.notes,
        }

    def text(self) -> str:
        lines = [f"memory plan: {self.model} ({self.family}) on {self.device}, {self.dtype}; "
                 + ", ".join(f"{k} {v}" for k, v in self.settings.items())]
        width = max(len(p.name) for p in self.parts) + 2
        for p in self.parts:
            where = "" if p.where == "device" else "  [host memory, not on the device]"
            lines.append(f"  {p.name:<{width}}{format_bytes(p.bytes):>12}  {p.detail}{where}")
        lines.append(f"  {'static total':<{width}}{format_bytes(self.static_bytes):>12}")
        for s in self.sizes:
            if s.activation_bytes is None:
                lines.append(f"  {s.size}: activations not modelled for this family")
                continue
            if s.denoiser_bytes is None:
                frames = " (the family's default frame count)" if family_named(self.family).default_frames else ""
                lines.append(f"  {s.size} chunk {s.chunk}: VAE decode {format_bytes(s.vae_decode_bytes)}{frames}; "
                             "denoiser activations not modelled for this family")
                continue
            largest = "-" if s.largest_chunk is None else f"{s.largest_chunk}" + (
                " or more" if s.largest_chunk == MAX_CHUNK_SEARCHED else "")
            lines.append(f"  {s.size} chunk {s.chunk}: activations {format_bytes(s.activation_bytes)} "
                         f"(denoiser {format_bytes(s.denoiser_bytes or 0)}, VAE decode "
                         f"{format_bytes(s.vae_decode_bytes or 0)}); total {format_bytes(self.static_bytes + s.activation_bytes)}; "
                         f"largest chunk that fits: {largest}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(self.verdict)
        return "\n".join(lines)


def plan_memory(model: str, config: EngineConfig | None = None, *, budget: int | None = None,
                budget_name: str = "", device: str | None = None, spare_process: bool = False) -> MemoryPlan:
    """The memory ``Engine.from_pretrained(model, config)`` would hold on ``device`` (default: the
    config's, else CUDA when this machine has one), against ``budget`` bytes. ``spare_process``: a
    server's spare engine process beside it (host memory; on a CPU the same memory)."""
    config = config or EngineConfig()
    device = device or config.device or default_device()
    device_type = torch.device(device).type
    dtype = resolve_dtype(config.dtype, device)
    spec = find_model(model)
    family = spec.family
    parts, summary = static_parts(spec, config, dtype, device_type, budget)
    notes = []
    if device_type == "cuda":
        parts.append(Part("CUDA runtime (assumed)", CUDA_RUNTIME_BYTES,
                          detail="context, kernels, library workspaces: outside torch's allocator; not measured"))
    elif device_type == "cpu":
        parts.append(Part("process runtime", CPU_RUNTIME_BYTES[bool(config.compile)],
                          detail="Python and the libraries (measured on the tiny engine, bench/memory.py)"))
    if spare_process:
        parts.append(Part("spare engine process", SPARE_PROCESS_BYTES, where="device" if device_type == "cpu" else "host",
                          detail="its imports done, no model (engine_spare_process; measured, plan/budget.py)"))
    table = _coefficients()
    static = sum(p.bytes for p in parts if p.where == "device" and not p.estimate)
    sizes = config.sizes or ((config.height or family.default_size[0], config.width or family.default_size[1]),)
    writer = "fused" if config.adapter_mode == "fused" else "slots" if config.slots else "fused"
    chunk = config.batch_limit
    # At the family's default guidance: under batch CFG the unconditional half shares the batch.
    cfg = family.doubles_batch(family.default_guidance)
    factor = CUDA_ACTIVATION_FACTOR if device_type == "cuda" else 1.0
    plans = [_size_plan(spec, table, dtype, writer, cfg, static, budget, chunk, height, width, factor)
             for height, width in sizes]
    if any(p.denoiser_bytes is None for p in plans):
        notes.append(f"no denoiser activation coefficients for {family.name} ({_dtype_name(dtype)}) in "
                     "hotlora/engine/plan/coefficients.py: bench/plan_calibrate.py measures them")
    notes.append("activations: the eager peak of one chunk (denoiser forward or VAE decode, the larger), "
                 "from coefficients measured on the CPU (engine/plan/activations.py)"
                 + (f", times {factor:.2f} on CUDA (the allocator's peak over the CPU model, measured once on "
                    "an H200 for full-size Flux)" if factor != 1.0 else "")
                 + "; the text encoders' activations are not counted")
    packed = (f" and the slots' packed copies up to {format_bytes(summary['pack_cache_bytes'])}"
              if summary["pack_cache_bytes"] else "")
    notes.append("adapters in use: one per slot at the target rank is counted (an estimate); more adapters "
                 f"held grow the adapter store's RAM cache up to its ram_budget_bytes{packed}"
                 + ("; on a CPU that is the same memory" if device_type == "cpu" else " (host memory)"))
    settings = {"slots": ",".join(config.slots), "target_rank": config.target_rank,
                "adapter_mode": config.adapter_mode, "mixed": config.mixed, "batch": chunk,
                "base_quantization": config.base_quantization, "writer": summary["writer"],
                "ceiling_modules": summary["ceiling_modules"],
                "denoiser_parameters": summary["denoiser_parameters"]}
    return MemoryPlan(model, family.name, device, _dtype_name(dtype), budget, budget_name, parts, plans, settings, notes)


def _size_plan(spec, table: dict, dtype: torch.dtype, writer: str, cfg: bool, static: int, budget: int | None,
               chunk: int, height: int, width: int, factor: float = 1.0) -> SizePlan:
    """One served size: the activation peak at the engine's chunk, and the largest chunk that fits.
    ``factor`` scales the activation model to the device (``CUDA_ACTIVATION_FACTOR``)."""
    family = spec.family

    def peak(images: int) -> tuple[int | None, dict]:
        try:
            work = activations.workload(family, spec.configs, height, width, images, cfg)
        except NotImplementedError:  # a family declaring no workload (the generic ones): weights only
            return None, {"denoiser": None, "vae_decode": None}
        predicted = {part: None if nbytes is None else int(nbytes * factor)
                     for part, nbytes in activations.predict(table, family.name, work, dtype, writer).items()}
        if predicted["denoiser"] is None:
            # A VAE measured for the family itself (Wan's video VAE), beside a denoiser not modelled: the
            # decode is the peak's lower bound. The shared AutoencoderKL fit is not extended to other VAEs.
            own = activations.coefficient(table, family.name, work.vae_part, dtype)
            return (predicted["vae_decode"] if own is not None else None), predicted
        return max(v for v in predicted.values() if v is not None), predicted

    at_chunk, predicted = peak(chunk)
    largest, fits = None, None
    if at_chunk is not None and budget is not None:  # ``static``: the static parts less the estimates
        fits = static + at_chunk <= budget
        largest = 0
        for images in range(1, MAX_CHUNK_SEARCHED + 1):
            if static + peak(images)[0] > budget:
                break
            largest = images
    return SizePlan(format_size(height, width), chunk, at_chunk, predicted["denoiser"], predicted["vae_decode"],
                    largest, fits)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["MemoryPlan", "SizePlan", "plan_memory"]
