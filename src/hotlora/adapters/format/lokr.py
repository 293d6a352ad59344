"""LyCORIS LoKr adapters as exact low-rank updates, so every adapter mode serves them.

A LoKr module stores ``delta W = scaling * kron(W1, W2)``, each factor a full matrix or a product
``W_a @ W_b`` (PEFT's ``LoKrLayer.get_delta_weight``). By the mixed-product property,
``kron(U1 @ V1, U2 @ V2) = kron(U1, U2) @ kron(V1, V2)``, so with each factor written as
``U @ V`` (a decomposed factor as its two halves, a full ``m x n`` one as ``I @ W`` or ``W @ I``,
whichever inner size is smaller) the delta is the LoRA ``up @ down`` with ``up = kron(U1, U2)`` and
``down = kron(V1, V2)``, of rank ``inner(W1) * inner(W2)``: the same numbers, summed in another
order. Slots serve it when that rank fits the target rank; fused mode at any rank.

The same form splits a LoKr on a fused projection exactly: the rows of ``up`` are the rows of the
delta, so ``to_qkv``'s update is three LoRAs sharing ``down``. (diffusers instead fuses the model's
projections before loading such a file, a new module layout the warm engine cannot take.)

diffusers reads the trainers' LoKr layouts (``lora_state_dict``: ai-toolkit's Z-Image and Flux.2,
LyCORIS' own) and bakes their alphas into the factors; PEFT holds the math. Neither turns a LoKr
into LoRA factors, so that part is ours.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hotlora.adapters.format.lora_config import LoraWeights, Patterns, checked_number
from hotlora.errors import AdapterFormatError

LAYOUT = "lycoris-lokr"
PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
# diffusers' fused attention projections (``fuse_qkv_projections``) -> the ones a served model has.
FUSED_PROJECTIONS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
MAX_LOKR_RANK = 16384  # the exact low-rank form of a full-size LoKr (Flux.2 klein: 3072) stays below this
# The expanded factors of one file, all modules together (float32 elements, 4 GiB): kB-sized factors
# expand to matrices of the layers' size, and the modules a file names are checked against the
# ceiling only after conversion, so the expansion is bounded before anything is materialised.
MAX_LOKR_ELEMENTS = 2**30


def is_lokr(state_dict: Mapping) -> bool:
    return any(".lokr_" in key for key in state_dict)


def _factor(parts: Mapping[str, torch.Tensor], which: str, module: str, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Factor ``which`` (w1 or w2) of a module as ``(U, V)`` with ``W = U @ V``."""
    full, a, b = (parts.get(f"lokr_{which}{suffix}") for suffix in ("", "_a", "_b"))
    if full is not None and a is None and b is None:
        if full.ndim != 2:
            raise AdapterFormatError(f"{label}: {module}: conv or Tucker LoKr factors ({tuple(full.shape)}) "
                                     "are not served (Linear layers only)")
        rows, cols = full.shape
        eye = torch.eye(min(rows, cols), dtype=full.dtype)
        return (eye, full) if rows <= cols else (full, eye)
    if full is None and a is not None and b is not None and a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0]:
        return a, b
    raise AdapterFormatError(f"{label}: {module}: LoKr factor {which} must be lokr_{which} or lokr_{which}_a with "
                             f"lokr_{which}_b of matching rank")


def lokr_modules(ours: Mapping[str, torch.Tensor], metadata: Mapping | None, label: str) -> dict[str, LoraWeights]:
    """PEFT-form LoKr keys (``module.lokr_w1`` ..., the denoiser prefix removed) -> each module's
    exact low-rank weights. ``metadata``: the file's ``LoKrConfig`` (its alpha / r is the scaling,
    patterns matched without running them as regexes), or None (diffusers baked the alphas into
    the factors: scaling 1, as its ``_create_lokr_config`` sets alpha = r)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in ours.items():
        module, _, part = key.rpartition(".")
        if part not in PARTS or not module:
            raise AdapterFormatError(f"{label}: a LoKr file with keys that are not LoKr factors: {key}")
        if not value.is_floating_point():
            raise AdapterFormatError(f"{label}: {key} is {value.dtype}, not a floating-point tensor")
        modules.setdefault(module, {})[part] = value
    scalings = _scalings(metadata, list(modules), label)
    factors = {module: (*_factor(parts, "w1", module, label), *_factor(parts, "w2", module, label))
               for module, parts in modules.items()}
    elements = 0
    for module, (u1, v1, u2, v2) in factors.items():
        rank = v1.shape[0] * v2.shape[0]
        if rank > MAX_LOKR_RANK:
            raise AdapterFormatError(f"{label}: {module}: LoKr of exact rank {rank} (over {MAX_LOKR_RANK})")
        elements += rank * (u1.shape[0] * u2.shape[0] + v1.shape[1] * v2.shape[1])
    if elements > MAX_LOKR_ELEMENTS:
        raise AdapterFormatError(f"{label}: the LoKr factors expand to {elements:,} elements "
                                 f"(over {MAX_LOKR_ELEMENTS:,}); refused before expanding them")
    out: dict[str, LoraWeights] = {}
    for module, (u1, v1, u2, v2) in factors.items():
        up = torch.kron(u1.float(), u2.float())
        down = torch.kron(v1.float(), v2.float())
        leaf = module.rsplit(".", 1)[-1]
        targets = [f"{module.rsplit('.', 1)[0]}.{name}" if "." in module else name
                   for name in FUSED_PROJECTIONS.get(leaf, ())]
        if targets:
            if up.shape[0] % len(targets):
                raise AdapterFormatError(f"{label}: {module}: {up.shape[0]} output rows do not split into "
                                         f"{', '.join(targets)}")
            for target, rows in zip(targets, up.chunk(len(targets))):
                out[target] = LoraWeights(down=down, up=rows.contiguous(), scaling=scalings[module])
        else:
            out[module] = LoraWeights(down=down, up=up, scaling=scalings[module])
    return out


def _scalings(metadata: Mapping | None, modules: list[str], label: str) -> dict[str, float]:
    if not metadata:
        return {module: 1.0 for module in modules}
    r, alpha = metadata.get("r", 8), metadata.get("alpha", metadata.get("lora_alpha", 8))
    ranks = Patterns(metadata.get("rank_pattern") or {}, "rank_pattern", label, len(modules))
    alphas = Patterns(metadata.get("alpha_pattern") or {}, "alpha_pattern", label, len(modules))
    out = {}
    for module in modules:
        rank = checked_number(ranks.get(module, r), f"LoKr r of {module}", label)
        if not rank:
            raise AdapterFormatError(f"{label}: LoKr r of {module} is 0")
        out[module] = float(checked_number(alphas.get(module, alpha), f"LoKr alpha of {module}", label) / rank)
    return out
