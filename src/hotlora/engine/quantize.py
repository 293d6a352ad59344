"""A quantized base denoiser (``EngineConfig.base_quantization``): its Linear weights quantized
once at start-up with torchao, before the adapter writer is installed and before compile.

The adapters are not quantized: the slots are PEFT LoRA layers over the quantized Linear (PEFT's
torchao dispatcher, ``TorchaoLoraLinear``, never merged) and the mixed-batch banks wrap it
(``BankedLinear`` calls the base layer, whatever its weight is), so a request's LoRA runs in the
serving dtype on top of the quantized base product. Fused mode merges into the base weights and
is refused with a quantized base (``EngineConfig``).

- ``int8_weight_only``: int8 weights, one scale per output row, activations in the serving dtype
  (``Int8WeightOnlyConfig``); CPU and CUDA.
- ``float8``: row-wise FP8 weights and dynamically quantized FP8 activations
  (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``); CUDA only (FP8 matmuls
  need a Hopper or Ada GPU), refused at start-up elsewhere.
"""

from __future__ import annotations

import logging

import torch

from hotlora.settings.engine import BASE_QUANTIZATIONS

log = logging.getLogger(__name__)


def _torchao_config(method: str):
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int8WeightOnlyConfig,
            PerRow,
            quantize_,
        )
    except ImportError as exc:
        raise ImportError(f"base_quantization={method!r} needs torchao: pip install 'hotlora[quant]'") from exc
    if method == "int8_weight_only":
        return quantize_, Int8WeightOnlyConfig()
    return quantize_, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


def check_quantization(method: str, device: torch.device | str) -> None:
    """Raise ValueError for a quantization this device cannot run (before anything is loaded)."""
    if method not in BASE_QUANTIZATIONS:
        raise ValueError(f"base_quantization must be one of {', '.join(BASE_QUANTIZATIONS)}, got {method!r}")
    if method == "float8" and torch.device(device).type != "cuda":
        raise ValueError(f"base_quantization='float8' (row-wise FP8) runs on CUDA GPUs only (Hopper or Ada); "
                         f"this engine's device is {torch.device(device).type}: use int8_weight_only or none")


def quantize_denoiser(denoiser: torch.nn.Module, method: str) -> str | None:
    """Quantize every ``nn.Linear`` weight of ``denoiser`` in place (``method`` not ``none``);
    returns the method applied, or None. Before any LoRA layer exists: the LoRA stays unquantized."""
    device = next(denoiser.parameters()).device
    check_quantization(method, device)
    if method == "none":
        return None
    quantize_, config = _torchao_config(method)
    done = [(n, type(m.weight).__name__) for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
            and type(m.weight) not in (torch.Tensor, torch.nn.Parameter)]
    if done:  # quantizing twice would quantize the quantization error again (or fail inside torchao)
        raise ValueError(f"the denoiser is already quantized ({done[0][0]}: {done[0][1]}); build the engine "
                         "with base_quantization='none' to serve it as it is")
    before = weight_bytes(denoiser)
    # quantize_'s default filter: nn.Linear modules only (Conv2d stays in the serving dtype).
    quantize_(denoiser, config)
    log.info("denoiser quantized (%s): weights %.1f MiB -> %.1f MiB", method, before / 2**20,
             weight_bytes(denoiser) / 2**20)
    return method


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, a torchao tensor subclass included (its inner tensors: data, scales)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers, quantized ones counted as stored."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


__all__ = ["check_quantization", "quantize_denoiser", "tensor_bytes", "weight_bytes"]
