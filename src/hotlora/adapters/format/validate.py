"""Pure checks that an adapter fits the served engine, run before any weight is touched.

Every problem is collected and returned together (the resolver raises one AdapterRejected naming
the modules, for all slots of a request), so a
caller fixes their file once instead of discovering problems one round-trip at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.format.lora_config import LoraWeights
from hotlora.adapters.format.loha import LAYOUT as LOHA_LAYOUT
from hotlora.adapters.format.lokr import LAYOUT as LOKR_LAYOUT
from hotlora.families import FAMILIES, family_named
from hotlora.families.recognize import base_model_compatible, families_of_metadata, foreign_note

# Long lists are cut in messages; the count is always given.
MAX_LISTED = 8


@dataclass(frozen=True)
class SlotCeiling:
    """What the engine's slots can hold: modules (name -> (in_features, out_features)) and rank."""

    modules: Mapping[str, tuple[int, int]]
    target_rank: int
    family: str
    # Names the served model answers to (hub id, directory name, aliases). Empty: not checked.
    served_models: frozenset[str] = frozenset()
    # Whether ranks above target_rank fit: False for padded slots and banks, True where adapters
    # are merged into the weights (fused mode), whose cost does not depend on the rank.
    any_rank: bool = False
    # Conv2d layers adapters may touch: name -> weight shape (out, in, kh, kw). Only fused mode has
    # any (a merged conv delta is a plain weight update; slots and banks hold LoRA layers on Linears
    # and on the 1x1 convs of ``pointwise`` only).
    convs: Mapping[str, tuple[int, int, int, int]] = field(default_factory=dict)
    # 1x1 convs the slots and banks hold beside ``modules`` (the Linears) as Linears over the channels
    # (a family's ``pointwise_convs``): name -> (in_channels, out_channels). Their factors come as a
    # conv LoRA's, [r, in, 1, 1] and [out, r, 1, 1].
    pointwise: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # Whether LoRA biases fit (``lora_B.bias``, lightx2v's ``.diff_b``): slots of a family that
    # declares them (``ModelFamily.lora_biases``).
    biases: bool = False
    # Layers whose LoRA bias cannot be held although ``biases`` is set: fused mode merges a LoRA bias
    # into the layer's own, and these Linears have none.
    unbiased: frozenset[str] = frozenset()
    # Why no LoRA bias fits where the family's slots would hold them (a quantized base): said instead
    # of the family's rule.
    no_biases_because: str = ""
    # Layers a mixed engine's banks leave out because every sample of a batch shares a row of them
    # (``ModelFamily.mixed_batch_shared_rows``): an adapter touching them is refused, saying so.
    unbatched: frozenset[str] = frozenset()

    def holds(self, module: str) -> bool:
        """Whether a slot layer covers ``module`` (a Linear or a 1x1 conv)."""
        return module in self.modules or module in self.pointwise

    @property
    def layer_count(self) -> int:
        """The layers the slots cover: Linears and 1x1 convs."""
        return len(self.modules) + len(self.pointwise)


def is_conv(w) -> bool:
    """Conv LoRA factors (kohya LoCon, PEFT on a Conv2d): down [r, in, kh, kw], up [out, r, 1, 1]."""
    return w.down.ndim == 4 or w.up.ndim == 4


LYCORIS_KINDS = {LOKR_LAYOUT: "LoKr", LOHA_LAYOUT: "LoHa"}


# Long: every check an adapter must pass, in one pass, so that a refusal lists all its problems at once.
def problems_with(adapter: Adapter, ceiling: SlotCeiling) -> list[str]:
    problems: list[str] = []
    if adapter.family != ceiling.family:
        problems.append(f"adapter is for the {adapter.family} family, the engine serves {ceiling.family}")
    if not adapter.modules and not adapter.text_modules:
        problems.append("adapter holds no LoRA modules")
    if not base_model_compatible(adapter.base_model, ceiling.served_models):
        named = [f.name for f in families_of_metadata(None, adapter.base_model) if f.name != ceiling.family]
        problems.append(
            f"adapter declares base model {adapter.base_model!r}"
            + (f" (a {' or '.join(named)} model)" if named else "")
            + f"; this server serves {', '.join(sorted(ceiling.served_models))} ({ceiling.family} family)"
        )
    too_big = {m: w.rank for m, w in adapter.modules.items() if w.rank > ceiling.target_rank and not ceiling.any_rank}
    if too_big:
        problems.append(
            f"rank {max(too_big.values())} exceeds the engine's target rank {ceiling.target_rank} "
            f"in {_listed(too_big)}"
            + (f" (the exact low-rank form of a LyCORIS {LYCORIS_KINDS[adapter.layout]}: fused mode, "
               "adapter_mode='fused', serves it at any rank)" if adapter.layout in LYCORIS_KINDS else "")
        )
    # Conv layers get their own message: the fix is another adapter mode, not another ceiling.
    convs = [m for m, w in adapter.modules.items()
             if is_conv(w) and not ceiling.convs and not ceiling.holds(m)]
    if convs:
        problems.append(f"conv LoRA on {len(convs)} layer(s) ({_listed(convs)}): this engine holds LoRA on "
                        "Linear layers only; conv LoRA (e.g. kohya LoCon on SDXL) is served in fused mode "
                        "(adapter_mode='fused'), not by slots or banks")
    absent = _absent_experts(adapter, ceiling)
    for expert, count in absent.items():
        problems.append(f"LoRA for {expert} ({count} module(s)), a second expert the served model does not have "
                        f"(a one-transformer {ceiling.family} model): give it an adapter for its transformer only")
    outside = [m for m in adapter.modules if not ceiling.holds(m) and m not in ceiling.convs and m not in convs
               and m.split(".", 1)[0] not in absent]
    foreign = ""
    if outside:
        # Perhaps another family's LoRA, named when its layer names or metadata say so (names that
        # are the served family's, beyond a narrowed ceiling or its block count, say nothing).
        foreign = (foreign_note(family_named(ceiling.family), outside, declared=adapter.base_model)
                   if ceiling.family in FAMILIES else "")
        note = foreign
        if adapter.layout == LOHA_LAYOUT and not ceiling.convs:  # its conv layers' factors look like a Linear's
            note += " (a LyCORIS LoHa's conv layers are served in fused mode, adapter_mode='fused')"
        shared = [m for m in outside if m in ceiling.unbatched]
        if shared:
            note += (f"; {_listed(shared)} compute rows that every sample of a mixed batch shares, so a mixed "
                     "engine holds no adapter there: serve such adapters with mixed=False")
        problems.append(f"{len(outside)} module(s) outside the slot ceiling: {_listed(outside)}{note}")
    biased = adapter.biased
    if biased and not ceiling.biases:  # slots or banks of a family whose slots hold none
        why = ceiling.no_biases_because or (f"the {ceiling.family} slots hold no LoRA bias; fused mode "
                                            "(adapter_mode='fused') merges them into the layers' biases")
        problems.append(f"LoRA biases (lora_B.bias, lightx2v's .diff_b) on {len(biased)} module(s) ({_listed(biased)}): "
                        + why)
    unmergeable = [m for m in biased if m in ceiling.unbiased] if ceiling.biases else []
    if unmergeable:
        problems.append(f"LoRA biases on {len(unmergeable)} layer(s) without a bias of their own "
                        f"({_listed(unmergeable)}): fused mode merges a LoRA bias into the layer's bias")
    bad_dtype, bad_shape, non_finite, bad_scale = [], [], [], []
    for module, w in adapter.modules.items():
        bias = () if w.bias is None else (w.bias,)
        if not all(t.is_floating_point() for t in (w.down, w.up, *bias)):
            bad_dtype.append(f"{module} ({'/'.join(str(t.dtype) for t in (w.down, w.up, *bias))})")
            continue
        shape = _shape_problem(module, w, ceiling, flattened_convs=adapter.layout == LOHA_LAYOUT)
        if shape:
            bad_shape.append(shape)
        if not all(torch.isfinite(t).all() for t in (w.down, w.up, *bias)):
            non_finite.append(module)
        if not math.isfinite(w.scaling):
            bad_scale.append(module)
    if bad_dtype:
        problems.append(f"non-floating dtype in {_listed(bad_dtype)}")
    if bad_shape:
        # Names alike, widths not: trainers write Flux.1 and Flux.2 (klein 4B and 9B alike) under the
        # same names, so only the widths tell, and only a file's metadata could say which model it is.
        model = f"this {ceiling.family} model" if ceiling.family else "this model"
        hint = "" if foreign else (f": widths {model}'s layers do not have (a LoRA trained on another base model "
                                 "whose layers have the same names, or on another size of this one?)")
        problems.append(f"shape mismatch in {_listed(bad_shape)}{hint}")
    if non_finite:
        problems.append(f"NaN or infinite values in {_listed(non_finite)}")
    if bad_scale:
        problems.append(f"non-finite alpha/rank scaling in {_listed(bad_scale)}")
    return problems


def served_experts(ceiling: SlotCeiling) -> tuple[str, ...]:
    """The family's other denoisers the ceiling has slots in (Wan 2.2 A14B's ``transformer_2``;
    none for a one-transformer model)."""
    family = FAMILIES.get(ceiling.family)
    if family is None:
        return ()
    return tuple(e for e in family.other_denoisers if any(c.startswith(f"{e}.") for c in ceiling.modules))


def _absent_experts(adapter: Adapter, ceiling: SlotCeiling) -> dict[str, int]:
    """Another expert's LoRA (Wan 2.2's ``transformer_2.*`` modules) given to a model without that
    expert: expert -> its module count. Said as such, not as modules outside the ceiling (plain
    diffusers drops such keys without a word)."""
    family = FAMILIES.get(ceiling.family)
    if family is None or not family.other_denoisers:
        return {}
    absent_experts = set(family.other_denoisers) - set(served_experts(ceiling))
    absent: dict[str, int] = {}
    for module in adapter.modules:
        expert = module.split(".", 1)[0]
        if expert in absent_experts:
            absent[expert] = absent.get(expert, 0) + 1
    return absent


def _shape_problem(module: str, w, ceiling: SlotCeiling, flattened_convs: bool = False) -> str | None:
    """What is wrong with a module's factor shapes, or None. A Linear takes A [r, in] and B [out, r];
    a Conv2d of weight [out, in, kh, kw] takes A [r, in, kh, kw] and B [out, r, 1, 1] (the down
    conv has the layer's kernel, the up conv is 1x1: the delta is B.flatten(1) @ A.flatten(1)), or
    with ``flattened_convs`` the same flattened, A [r, in * kh * kw] and B [out, r] (a LyCORIS LoHa on a
    conv layer: its factors are flattened over the kernel, and so is its exact low-rank form; a LoRA
    file's conv factors are 4-D, and diffusers refuses 2-D ones)."""
    shapes = f"A {tuple(w.down.shape)}, B {tuple(w.up.shape)}"
    if module in ceiling.convs:
        out_c, in_c, kh, kw = ceiling.convs[module]
        r = w.down.shape[0] if w.down.ndim else 0
        conv = tuple(w.down.shape) == (r, in_c, kh, kw) and tuple(w.up.shape) == (out_c, r, 1, 1)
        flat = flattened_convs and tuple(w.down.shape) == (r, in_c * kh * kw) and tuple(w.up.shape) == (out_c, r)
        if not (conv or flat):
            return f"{module} ({shapes}; base conv weight is {(out_c, in_c, kh, kw)})"
        return None
    if is_conv(w) and not ceiling.holds(module):
        return None  # not a layer of this ceiling: reported once, above
    if w.bias is not None:
        shapes += f", bias {tuple(w.bias.shape)}"
    if module in ceiling.pointwise and w.down.ndim == w.up.ndim == 4:
        if tuple(w.down.shape[2:]) != (1, 1) or tuple(w.up.shape[2:]) != (1, 1):
            return f"{module} ({shapes}; base layer is a 1x1 conv)"
        w = LoraWeights(w.down.flatten(1), w.up.flatten(1), w.scaling, w.bias)  # its factors as a Linear's
    if (w.down.ndim != 2 or w.up.ndim != 2 or w.up.shape[1] != w.down.shape[0]
            or (w.bias is not None and tuple(w.bias.shape) != (w.up.shape[0],))):
        return f"{module} ({shapes})"
    if ceiling.holds(module):
        in_features, out_features = ceiling.modules.get(module) or ceiling.pointwise[module]
        if w.down.shape[1] != in_features or w.up.shape[0] != out_features:
            return f"{module} ({shapes}; base layer is {in_features} -> {out_features})"
    return None


def _listed(items) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:MAX_LISTED])
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return shown + more
