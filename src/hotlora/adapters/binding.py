"""What a request asks of its slots, as typed values: ``AdapterSpec`` before anything is fetched,
``Binding`` once its adapter is loaded and checked.

They live in ``adapters`` (not ``engine``) because the resolver, which is below the engine, makes
them; ``engine.request``, the engine's records, re-exports them. Neither imports torch (the
request's records travel through processes without it). ``Bindings`` (slot -> Binding) is the one
mapping type a request's adapters take from the resolver to the writers. ``Binding.key`` is the
one answer to "is this the same as last time": every writer (slots, banks, fused, the text
encoders) asks it, so two writers never disagree about what changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

if TYPE_CHECKING:
    from hotlora.adapters.format.convert import Adapter


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """One slot's adapter as a request names it: a reference (or a path, state dict, Adapter),
    a scale (None: the catalog entry's default, else 1.0) and optional pivotal-tuning token names.
    ``low_noise``: on a model of two experts (Wan 2.2 A14B), a second reference, the low-noise
    expert's LoRA as its trainer ships it (a file of its own); ``ref`` is then the high-noise one's,
    and the slot holds the two as one pair adapter (``format.export.pair_experts``)."""

    ref: Any
    scale: float | None = None
    tokens: tuple[str, ...] | None = None
    low_noise: Any = None

    @property
    def refs(self) -> list:
        """Every reference this spec names (the access check and the store's look at each)."""
        return [self.ref] if self.low_noise is None else [self.ref, self.low_noise]


class Binding(NamedTuple):
    """One slot's checked adapter and scale. A tuple, so ``adapter, scale = binding`` reads it."""

    adapter: "Adapter"
    scale: float

    @property
    def key(self) -> tuple:
        """What this binding writes: the adapter's identity (weights, alphas, embeddings and their
        token names) and its scale. Equal keys write equal tensors."""
        return (self.adapter.key, float(self.scale))

    @property
    def writes(self) -> bool:
        """Scale 0 writes nothing: the slot then holds what an empty one holds."""
        return float(self.scale) != 0.0


Bindings = Mapping[str, "Binding | None"]  # slot -> binding (None, or absent: the slot is empty)


def bindings_key(bindings: Bindings) -> tuple:
    """What a whole mapping writes: each slot's ``Binding.key``; empty slots and scale 0 write
    nothing, so they are left out (``{}`` and ``{"style": Binding(a, 0.0)}`` are the same state)."""
    return tuple(sorted((slot, b.key) for slot, b in bindings.items() if b is not None and b.writes))


def factors_by_module(bindings: Bindings, weights_of: Callable[["Adapter"], Mapping]) -> tuple[dict, dict]:
    """What ``bindings`` write, layer by layer, for the writers that stack a request's factors (fused
    mode, the text encoders): ``{module: [(down, up, alpha/r x scale), ...]}`` in slot-name order, and
    per writing slot ``{"modules": n, "rank": r}``. ``weights_of(adapter)``: the adapter's LoraWeights
    for this writer's layers (``{module: LoraWeights}``)."""
    per_module: dict[str, list] = {}
    bound = {}
    for slot in sorted(bindings):
        binding = bindings[slot]
        if binding is None or not binding.writes:
            continue
        weights = weights_of(binding.adapter)
        for module, w in weights.items():
            per_module.setdefault(module, []).append((w.down, w.up, w.scaling * float(binding.scale)))
        bound[slot] = {"modules": len(weights), "rank": max((w.rank for w in weights.values()), default=0)}
    return per_module, bound
