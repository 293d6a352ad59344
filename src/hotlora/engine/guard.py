"""Whose fault is a non-finite pack: the request's adapters, or a corrupted engine.

A pack that comes out NaN/inf while the request carries adapters and every base weight of every
model in the pipeline is still finite was overflowed by those adapters (or their scales): a 422
for that request, the engine stays warm. Anything else is an engine fault (rebuild). The weight
scan runs on failures only.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from hotlora.adapters.binding import Binding
from hotlora.adapters.format.convert import Adapter
from hotlora.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)


class NonFiniteOutput(InvalidRequest):
    """The pack came out NaN/inf with this request's adapters while every base weight is finite:
    the adapters (or their scales) overflowed it. The caller's fault; the engine stays warm."""


def check_finite(images, resolved: Mapping[str, Binding], pipeline) -> None:
    if _all_finite(images):
        return
    if resolved and base_weights_finite(pipeline):
        served = ", ".join(f"{slot}={a.name} at scale {scale:g}" for slot, (a, scale) in resolved.items())
        raise NonFiniteOutput(f"the images came out non-finite (NaN/inf) with {served}; the base model is "
                              "intact: lower the scale or check the adapter's weights")
    raise EngineError("the denoiser produced non-finite values")


def base_weights_finite(pipeline) -> bool:
    """Every weight of every model in the pipeline, the adapter writer's own LoRA weights excluded."""
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            for name, tensor in [*component.named_parameters(), *component.named_buffers()]:
                if "lora_" not in name and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    log.error("base weight %s is not finite", name)
                    return False
    return True


def skipped(adapter: Adapter, applied_text_encoders=()) -> dict | None:
    """What of the adapter's file this engine does not apply, so a caller sees it in the response,
    not only in the server's log: keys no served model part takes (Flux's T5 LoRA, which diffusers
    drops too), and text-encoder LoRA when the engine runs without it (``text_encoder_lora=False``)."""
    keys = list(adapter.skipped_keys)
    off = sorted(te for te in adapter.text_modules if te not in applied_text_encoders)
    if not keys and not off:
        return None
    parts = sorted({*(_part(key) for key in keys), *off})
    count = len(keys) + sum(2 * len(adapter.text_modules[te]) for te in off)  # A and B per module
    return {"keys": count, "parts": parts,
            "reason": "weights for model parts this engine does not apply LoRA to (diffusers does not load "
                      "Flux's T5 LoRA; text-encoder LoRA is off when text_encoder_lora is false)"}


def _part(key: str) -> str:
    """The model a skipped key belongs to: ``text_encoder_2`` for diffusers names, ``lora_te3`` for
    kohya's (whose module names have no dots: the first dotted part would be one per layer)."""
    if key.startswith("lora_te"):
        return key.split("_", 2)[0] + "_" + key.split("_", 2)[1]
    return key.split(".", 1)[0]


def _all_finite(images) -> bool:
    if isinstance(images, torch.Tensor):
        return bool(torch.isfinite(images).all())
    import numpy as np

    return bool(np.isfinite(images).all())

