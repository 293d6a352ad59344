"""The bytes a warm engine holds, part by part, counted exactly on the meta device.

The parts are built from their configs with no weights (``models.build_parts``), then the engine's
own start-up code runs on them in the engine's order: ``quantize_denoiser`` (torchao's
``quantize_``), ``weight_bytes``, ``install_expert_writers`` (the slots' PEFT adapter and its buffers, the
banks, or fused mode's pristine copies) and ``install_text_writer`` (the reserved embedding rows;
text-encoder LoRA is unfused: its factor cache's bound). Every figure is the ``nbytes`` of tensors those functions made, not
a formula, with one exception: ``float8`` (torchao refuses to build FP8 weights without a CUDA
device), whose bytes are torchao's row-wise layout: one byte per weight and a float32 scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hotlora.settings import EngineConfig
from hotlora.engine.plan.models import ModelSpec, build_parts, on_meta
from hotlora.engine.quantize import check_quantization, quantize_denoiser, weight_bytes
from hotlora.engine.writers import install_expert_writers, install_text_writer


@dataclass
class Part:
    name: str
    bytes: int
    where: str = "device"  # "device" (counted against the budget) or "host" (pinned host memory)
    detail: str = ""
    # An estimate of memory that comes with serving, not a tensor the warm engine holds: counted in the
    # totals, but a plan that fits only without it still fits (with a warning), it is not refused.
    estimate: bool = False


def _float8_bytes(denoiser: torch.nn.Module) -> int:
    """The denoiser's bytes with every Linear weight in torchao's row-wise FP8 layout."""
    total = weight_bytes(denoiser)
    for module in denoiser.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            total += weight.numel() * 1 + weight.shape[0] * 4 - weight.nbytes
    return total


def _place(restore: str, device_type: str, nbytes: int, budget: int | None, used: int) -> str:
    """Where the engine keeps a pristine copy: FusedWriter._where's rule (on CUDA with "auto", the
    device when it fits in the free memory minus a quarter of the device), with the budget's free
    memory after what is already on the device."""
    if restore != "auto":
        return restore
    if device_type != "cuda" or budget is None:
        return "device"
    return "device" if nbytes <= (budget - used) - budget // 4 else "host"


# What the static parts depend on (the rest of EngineConfig changes activations or nothing here).
STATIC_FIELDS = ("slots", "target_rank", "target_modules", "mixed", "bank_entries", "rank_buckets", "adapter_mode",
                 "fused_restore", "base_quantization", "text_encoder_lora", "embedding_rows")
_BUILT_IN_PLANS: dict[tuple, tuple[list[Part], dict]] = {}  # built-in models' configs never change


def static_parts(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device_type: str,
                 budget: int | None = None) -> tuple[list[Part], dict]:
    """Every part the warm engine holds and a summary of what was installed (for the report).
    A built-in model's parts are remembered per settings (installing PEFT on 504 meta layers
    takes seconds; the published configurations cannot change under a running process)."""
    key = (spec.name, str(dtype), device_type, budget, config.batch_limit if config.mixed else None,
           *(getattr(config, name) for name in STATIC_FIELDS))
    if spec.folder is None and key in _BUILT_IN_PLANS:
        parts, summary = _BUILT_IN_PLANS[key]
        return [replace(p) for p in parts], dict(summary)
    parts, summary = _static_parts(spec, config, dtype, device_type, budget)
    if spec.folder is None:
        if len(_BUILT_IN_PLANS) >= 32:
            _BUILT_IN_PLANS.clear()
        _BUILT_IN_PLANS[key] = [replace(p) for p in parts], dict(summary)
    return parts, summary


def _static_parts(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device_type: str,
                  budget: int | None) -> tuple[list[Part], dict]:
    check_quantization(config.base_quantization, device_type)  # float8 off CUDA is refused, as the engine does
    parts = build_parts(spec, dtype)
    family = spec.family
    # Every expert the model holds (Wan 2.2 A14B's transformer_2 beside its transformer): each held
    # in memory, quantized and given slots as the engine does (``WarmModel.experts``); one runs at a
    # time, so the activation peak stays one denoiser's.
    experts = {name: getattr(parts, name) for name in (family.denoiser, *family.other_denoisers) if hasattr(parts, name)}
    counts = {name: sum(p.numel() for p in expert.parameters()) for name, expert in experts.items()}  # before LoRA
    parameters = counts[family.denoiser]
    # The writers on meta tensors keep their pristine copies "on the device" (meta); where the
    # engine would keep them is decided below with the budget, as FusedWriter decides at start-up.
    meta_config = config.replace(fused_restore="device")
    expert_bytes = {}
    with on_meta(dtype):
        for name, expert in experts.items():
            if config.base_quantization == "float8":
                expert_bytes[name] = _float8_bytes(expert)
            else:
                quantize_denoiser(expert, config.base_quantization)
                expert_bytes[name] = weight_bytes(expert)
        writer = install_expert_writers(meta_config, experts, family.name, ())
        text = install_text_writer(meta_config, parts, family, writer.slot_names)
    others = {c: weight_bytes(getattr(parts, c)) for c in ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae")
              if hasattr(parts, c)}
    result = [Part(name, nbytes, detail=f"{counts[name]:,} parameters, "
                   f"{_dtype_name(dtype)}" + (f", {config.base_quantization}" if config.base_quantization != "none" else ""))
              for name, nbytes in expert_bytes.items()]
    for component, nbytes in others.items():
        count = sum(p.numel() for p in getattr(parts, component).parameters())
        result.append(Part(component, nbytes, detail=f"{count:,} parameters"))
    used = sum(p.bytes for p in result)
    described = writer.describe()
    kind = described["writer"]
    if kind == "fused":
        where = _place(config.fused_restore, device_type, writer.pristine_bytes, budget, used)
        result.append(Part("fused pristine copy", writer.pristine_bytes, where,
                           f"{described['fusable_modules']} layers"))
        used += writer.pristine_bytes if where == "device" else 0
        # Prepared requests' stacked factors stay on the device up to this bound (an LRU, empty at
        # start-up: not in ``used``, which is what the engine sees when it places the copies).
        result.append(Part("fused plan cache (bound)", type(writer).PLAN_CACHE_BYTES,
                           detail="prepared requests' factors, at most"))
    else:
        detail = (f"{len(writer.slot_names)} slots x rank {config.target_rank} on {writer.ceiling.layer_count} "
                  f"layers" + (f", {described['entries']} bank entries" if kind == "banks" else ""))
        result.append(Part(f"{kind} (LoRA buffers)", writer.nbytes, detail=detail))
        used += writer.nbytes
        if kind == "slots":
            result.append(_adapters_in_use(writer, dtype, device_type))
    for encoder, lora in text.lora.items():
        # Text-encoder LoRA runs unfused (writers/text_lora.py): no pristine copy, only the factors
        # of recent requests, on the encoder's device up to this bound (empty at start-up).
        result.append(Part(f"{encoder} LoRA factors (bound)", type(lora).PLAN_CACHE_BYTES,
                           detail="recent requests' text-encoder LoRA factors, at most"))
    summary = {"family": family.name, "denoiser_parameters": parameters, "writer": kind,
               "ceiling_modules": writer.ceiling.layer_count, "pack_cache_bytes": getattr(writer, "pack_cache_bytes", 0),
               "embedding_rows": {te: rows.rows * len(writer.slot_names) for te, rows in text.rows.items()}}
    return result, summary


def _adapters_in_use(writer, dtype: torch.dtype, device_type: str) -> Part:
    """An estimate, not the engine's tensors: what serving adds beside the slots, one adapter per slot
    at the target rank on every ceiling Linear: the adapter store's copy (float16, as trainers write
    them: 2 bytes an element) and its packed copy (the slots' dtype, writers/packing.py). Measured at
    full size (SDXL, bf16, a kohya rank-32 and an attention-only diffusers rank-128 adapter in two
    slots): the peak resident memory grew ~2.1 GiB when they were served, against 2.58 GiB estimated
    (docs/benchmarks.md, "Full size"). Host memory beside a GPU."""
    slots = len(writer.slot_names)
    elements = writer.nbytes // dtype.itemsize // max(1, slots)  # one slot's, at the target rank
    nbytes = slots * elements * (2 + dtype.itemsize)
    return Part("adapters in use (estimate)", nbytes, "host" if device_type == "cuda" else "device",
                "one adapter per slot at the target rank: the store's float16 copy and its packed copy",
                estimate=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["Part", "static_parts"]
