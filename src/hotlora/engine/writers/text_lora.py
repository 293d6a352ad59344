"""Text-encoder LoRA, unfused: each touched Linear of a text encoder adds ``up @ (down @ x)`` to its
output through a forward hook, with the request's factors (its scale and ``alpha / r`` folded into
``up``). The encoder's weights are never written.

Why not merged (as it was, with a ``FusedWriter`` per text encoder): measured at full size (SDXL's
CLIP-L and CLIP-G, float32 on a CPU) the merge cost ~2 s every time a text adapter came back and
a pristine copy of every CLIP Linear (2.86 GB) to restore from; and in bf16 a merge drops every
delta element under half a bf16 step of its weight, as the denoiser's fused mode does (#26). A
text encoder runs once per chunk on 77 tokens, not once per step, so the unfused branch costs a
few small matmuls per encode: no pristine copy, a swap that only re-points which factors the
hooks read (an adapter that comes back costs nothing), and the adapter's whole effect in any dtype.
It is also what plain diffusers computes (``load_lora_weights`` installs PEFT's unfused LoRA
layers in the text encoders), not an approximation of it.

Written by hand: PEFT's LoRA layers would have to be installed per adapter (diffusers' hotswap
refuses text encoders), and no library re-points per-request factors on an uncompiled module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from hotlora.adapters.binding import Bindings, bindings_key, factors_by_module
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.adapters.format.validate import SlotCeiling
from hotlora.engine.writers.base import ceiling_modules
from hotlora.errors import SlotStateCorrupt
from hotlora.lru import LRU


@dataclass
class _Factors:
    down: torch.Tensor  # [R, in]: every slot's A, stacked
    up: torch.Tensor  # [out, R]: every slot's B, side by side, each times scale * alpha / r


@dataclass
class _Plan:
    factors: dict[str, _Factors]
    fused: dict[str, dict]  # slot -> {"modules", "rank"}: what the response and describe() report
    nbytes: int


class UnfusedTextLora:
    """One text encoder's LoRA, applied unfused (see the module docstring)."""

    PLAN_CACHE_BYTES = 256 * 1024**2  # recent requests' factors, on the encoder's device

    def __init__(self, encoder: torch.nn.Module, family: str, weights_of: Callable[[Adapter], Mapping[str, LoraWeights]]):
        self.weights_of = weights_of
        modules = ceiling_modules(encoder, None)
        # Any Linear, any rank: the branch costs the same on any of them.
        self.ceiling = SlotCeiling(modules=modules, target_rank=0, family=family, any_rank=True)
        self._layers = {m: encoder.get_submodule(m) for m in modules}
        first = next(iter(encoder.parameters()))
        self.device, self.dtype = first.device, first.dtype
        self._active: dict[str, _Factors] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._current: tuple = ()
        self._bound: dict[str, dict] = {}
        self._plans: LRU[tuple, _Plan] = LRU(max_cost=self.PLAN_CACHE_BYTES, cost=lambda plan: plan.nbytes)

    def prepare(self, bindings: Bindings) -> None:
        """On the request's thread: the request's factors stacked per layer, on the device (cached)."""
        signature = bindings_key(bindings)
        if signature and self._plans.get(signature) is None:
            self._plans.put(signature, self._plan(bindings))

    @torch.no_grad()
    def _plan(self, bindings: Bindings) -> _Plan:
        per_module, bound = factors_by_module(bindings, self.weights_of)
        factors, nbytes = {}, 0
        for module, parts in per_module.items():
            # float32 before scaling (one rounding into the encoder's dtype), as diffusers' PEFT
            # layers hold the factors in the encoder's dtype.
            down = torch.cat([a.float() for a, _, _ in parts]).to(self.device, self.dtype)
            up = torch.cat([b.float() * factor for _, b, factor in parts], dim=1).to(self.device, self.dtype)
            factors[module] = _Factors(down.contiguous(), up.contiguous())
            nbytes += down.nbytes + up.nbytes
        return _Plan(factors, bound, nbytes)

    def swap(self, bindings: Bindings) -> float:
        """Point the hooks at ``bindings``'s factors (hooks only on the layers it touches).
        Milliseconds spent; nothing is written when it is already bound."""
        signature = bindings_key(bindings)
        if signature == self._current:
            return 0.0
        began = time.perf_counter()
        plan = (self._plans.get(signature) or self._plan(bindings)) if signature else _Plan({}, {}, 0)
        for module in [m for m in self._hooks if m not in plan.factors]:
            self._hooks.pop(module).remove()
        self._active = plan.factors
        for module in plan.factors:
            if module not in self._hooks:
                self._hooks[module] = self._layers[module].register_forward_hook(self._hook(module))
        self._current, self._bound = signature, plan.fused
        return (time.perf_counter() - began) * 1000

    def _hook(self, module: str):
        def add_lora(layer, args, output):
            factors = self._active.get(module)
            if factors is None:
                return output
            x = args[0].to(factors.down.dtype)
            return output + F.linear(F.linear(x, factors.down), factors.up).to(output.dtype)

        return add_lora

    def check_intact(self) -> None:
        for module, handle in self._hooks.items():
            if handle.id not in self._layers[module]._forward_hooks:
                raise SlotStateCorrupt(f"{module}: the text encoder's LoRA hook was removed outside the engine")

    @property
    def nbytes(self) -> int:
        return self._plans.total_cost

    def describe(self) -> dict:
        return {"mode": "unfused", "pristine_bytes": 0, "lora_modules": len(self._layers),
                "factor_bytes": self.nbytes, "bound": {slot: dict(info) for slot, info in self._bound.items()}}
