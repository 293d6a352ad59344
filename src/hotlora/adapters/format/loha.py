"""LyCORIS LoHa adapters as exact low-rank updates, read through the LoRA converters.

A LoHa module stores ``delta W = (alpha / r) * (W1a @ W1b) * (W2a @ W2b)``, the element-wise
(Hadamard) product of two rank-``r`` products (LyCORIS' ``loha.py``, PEFT's
``LoHaLayer.get_delta_weight``). Row ``i`` of ``U1 V1 * U2 V2`` is
``sum_ab U1[i,a] U2[i,b] V1[a,:] * V2[b,:]``, so the delta is the LoRA ``up @ down`` with
``up[i, (a,b)] = U1[i,a] U2[i,b]`` and ``down[(a,b), j] = V1[a,j] V2[b,j]`` (row-wise and
column-wise Kronecker products), of rank ``r1 * r2``: the same numbers, summed in another order.

So a LoHa file becomes a LoRA file in its own key layout (kohya's ``lora_down`` / ``lora_up`` /
``alpha`` beside kohya and LyCORIS names, ``lora_A`` / ``lora_B`` beside diffusers' dotted
names), the alpha folded into ``up``; the family's own converter then maps the names as it maps a
LoRA of that trainer (SDXL's SGM block numbers, Flux's fused ``qkv`` split by rows, which the
exact form allows). Slots serve it when ``r1 * r2`` fits the target rank, fused and auto modes at
any rank. diffusers reads no LoHa (its converters know LoKr only) and PEFT holds the math but
turns nothing into LoRA factors, so this conversion is ours.

A LoHa on a conv layer (LyCORIS with ``conv_dim``, PEFT's LoHa ``Conv2d`` without
``use_effective_conv2d``) stores its factors flattened over the kernel (``W1b`` is
``[r, in * kh * kw]``); its exact form stays flattened, which fused mode merges into the conv
weight as it is (``validate._shape_problem``). Slots and auto mode hold Linear layers only: such a
file is refused there with the mode that serves it.

A Tucker-decomposed conv LoHa (LyCORIS ``use_tucker``, PEFT's ``use_effective_conv2d``) stores a
core ``hada_t1`` ``[r, r, kh, kw]`` with ``hada_w1_a`` ``[r, out]`` and ``hada_w1_b`` ``[r, in]``, and
``W1[p, q, k, l] = sum_ij t1[i,j,k,l] w1b[j,q] w1a[i,p]`` (PEFT's ``make_weight_cp``). Flattened over
``(in, kh, kw)`` as the conv weight is, that is ``w1a.T @ D1`` with ``D1[i, (q,k,l)] = sum_j
t1[i,j,k,l] w1b[j,q]``: rank ``r`` again, so it takes the flattened form above exactly.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hotlora.errors import AdapterFormatError

LAYOUT = "lycoris-loha"
PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
TUCKER_CORES = ("hada_t1", "hada_t2")
# The exact low-rank form multiplies ranks (LyCORIS' LoHa dims are 4-32: up to 1024): its factors,
# all modules together, are bounded before any is made, as a LoKr's (float32 elements, 4 GiB).
MAX_LOHA_ELEMENTS = 2**30
KOHYA_PREFIXES = ("lora_unet_", "lora_te", "lycoris_", "lora_transformer_")


def is_loha(state_dict: Mapping) -> bool:
    return any(".hada_" in key for key in state_dict)


def loha_as_lora(state_dict: Mapping[str, torch.Tensor], label: str,
                 peft_config: Mapping | None = None) -> dict[str, torch.Tensor]:
    """A LoHa state dict -> the same modules as exact LoRA factors, in the key form of the file's
    names. Scaling: a module's ``.alpha`` over its rank (LyCORIS, kohya), else a PEFT
    ``LoHaConfig``'s ``alpha / r``, else 1 (no alpha: LyCORIS' alpha = rank)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, _, part = key.rpartition(".")
        if not module:
            raise AdapterFormatError(f"{label}: a LoHa file with a key that names no module: {key}")
        if part not in (*PARTS, *TUCKER_CORES, "alpha"):
            raise AdapterFormatError(f"{label}: a LoHa file with keys that are not LoHa factors: {key}")
        if not value.is_floating_point():
            raise AdapterFormatError(f"{label}: {key} is {value.dtype}, not a floating-point tensor")
        modules.setdefault(module, {})[part] = value
    default_scale = _config_scale(peft_config, label)
    elements = 0
    for module, parts in modules.items():
        missing = [p for p in PARTS if p not in parts]
        if missing:
            raise AdapterFormatError(f"{label}: {module}: LoHa factors missing: {', '.join(missing)}")
        w1a, w1b, w2a, w2b = _flattened_shapes(parts, module, label)  # shapes only: nothing expanded yet
        if not all(len(t) == 2 for t in (w1a, w1b, w2a, w2b)) or w1a[1] != w1b[0] or w2a[1] != w2b[0] \
                or w1a[0] != w2a[0] or w1b[1] != w2b[1]:
            raise AdapterFormatError(f"{label}: {module}: LoHa factors of shapes "
                                     f"{[tuple(t) for t in (w1a, w1b, w2a, w2b)]} do not make one matrix")
        elements += w1a[1] * w2a[1] * (w1a[0] + w1b[1])
    if elements > MAX_LOHA_ELEMENTS:
        raise AdapterFormatError(f"{label}: the LoHa factors expand to {elements:,} elements "
                                 f"(over {MAX_LOHA_ELEMENTS:,}); refused before expanding them")
    out: dict[str, torch.Tensor] = {}
    for module, parts in modules.items():
        w1a, w1b, w2a, w2b = (t.float() for t in _flattened(parts))
        rank = w1b.shape[0]
        alpha = parts.get("alpha")
        if alpha is not None and alpha.numel() != 1:
            raise AdapterFormatError(f"{label}: {module}.alpha has {alpha.numel()} elements, not one")
        scale = float(alpha) / rank if alpha is not None else default_scale
        if not torch.isfinite(torch.tensor(scale)):
            raise AdapterFormatError(f"{label}: {module}: LoHa alpha {float(alpha)} is not a number")
        up = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1) * scale
        down = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
        if module.startswith(KOHYA_PREFIXES):
            out[f"{module}.lora_down.weight"], out[f"{module}.lora_up.weight"] = down, up
            out[f"{module}.alpha"] = torch.tensor(float(down.shape[0]))  # alpha / rank = 1: folded into up
        else:
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = down, up
    return out


def _flattened_shapes(parts: Mapping[str, torch.Tensor], module: str, label: str) -> tuple[tuple[int, ...], ...]:
    """The shapes ``_flattened`` gives, checked without computing anything: the Tucker contraction's
    ``[r, in * kh * kw]`` is bounded with the rest (``MAX_LOHA_ELEMENTS``) before it is made, since a
    file's kernel sizes multiply it beyond the file's own size."""
    cores = [parts.get(core) for core in TUCKER_CORES]
    if all(core is None for core in cores):
        return tuple(tuple(parts[p].shape) for p in PARTS)
    if any(core is None for core in cores):
        raise AdapterFormatError(f"{label}: {module}: a Tucker LoHa needs both hada_t1 and hada_t2")
    shapes = []
    for core, a, b in zip(cores, (parts["hada_w1_a"], parts["hada_w2_a"]), (parts["hada_w1_b"], parts["hada_w2_b"])):
        if core.ndim != 4 or a.ndim != 2 or b.ndim != 2 or core.shape[0] != a.shape[0] or core.shape[1] != b.shape[0]:
            raise AdapterFormatError(f"{label}: {module}: Tucker LoHa factors of shapes "
                                     f"{[tuple(t.shape) for t in (core, a, b)]} do not make one kernel")
        shapes += [(a.shape[1], a.shape[0]), (core.shape[0], b.shape[1] * core.shape[2] * core.shape[3])]
    return tuple(shapes)


def _flattened(parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The module's ``(w1a, w1b, w2a, w2b)`` in the flattened form ``W = (w1a @ w1b) * (w2a @ w2b)``,
    a Tucker pair rewritten into it (the module docstring); ``_flattened_shapes`` checked it first."""
    if parts.get("hada_t1") is None:
        return tuple(parts[p] for p in PARTS)
    out = []
    for core, a, b in zip((parts["hada_t1"], parts["hada_t2"]), (parts["hada_w1_a"], parts["hada_w2_a"]),
                          (parts["hada_w1_b"], parts["hada_w2_b"])):
        out += [a.T, torch.einsum("ijkl,jq->iqkl", core.float(), b.float()).reshape(core.shape[0], -1)]
    return tuple(out)


def _config_scale(peft_config: Mapping | None, label: str) -> float:
    """PEFT's ``LoHaConfig`` (``adapter_config.json`` beside its weights): ``alpha / r``, one for
    every module (per-module patterns are not read: refused)."""
    if not peft_config:
        return 1.0
    if peft_config.get("rank_pattern") or peft_config.get("alpha_pattern"):
        raise AdapterFormatError(f"{label}: a LoHa config with rank_pattern / alpha_pattern is not served")
    r, alpha = peft_config.get("r", 8), peft_config.get("alpha", 8)
    if not isinstance(r, (int, float)) or not isinstance(alpha, (int, float)) or not r:
        raise AdapterFormatError(f"{label}: a LoHa config's r {r!r} and alpha {alpha!r} are not numbers")
    return float(alpha) / float(r)
