"""Adapter slots: created once before compile, then only ever written in place.

All slots together are one PEFT LoRA adapter on every ceiling module, of rank
``n * target_rank`` (``n`` slots) with ``lora_alpha`` equal to it (PEFT's scaling is the constant
1.0); slot ``k`` owns rows ``k, k + n, k + 2n, ...``. The adapter's weights are views into two
rank-major buffers (``packing.py`` beside this file has the layout): every module's ``lora_A`` is
``down[:rows, columns]`` and its ``lora_B`` is ``up[:rows, columns].T``. With the rows
interleaved, the first ``n * b`` rows hold every slot's ranks below ``b``: a **rank bucket** ``b``
is the model reading only those (the Parameters for each bucket are made once and compiled for
at warm-up; a swap re-points the weights to the smallest bucket that holds the request).

A swap writes a slot's adapter into the first ``r`` of its rows, ``B`` multiplied by the
request's weight and ``alpha / r``, and zeroes what the previous occupant left beyond them:

- an adapter packed for this layout (the usual case): one ``copy_`` for ``A`` and one scaled copy
  for ``B`` per slot, the memory-copy limit, with no per-module work.
- any other adapter, module by module, with ``torch._foreach_*`` ops.

Modules whose base weight the model keeps in another dtype than most (diffusers'
``_keep_in_fp32_modules``: Wan's float32 time embedder in a bf16 model) get LoRA weights of their
own dtype, as PEFT gives them: rank-major buffers of their own beside the flat ones, outside the
packed layout (an adapter touching them is written module by module).

LoRA biases (a family's ``lora_biases``: lightx2v's ``.diff_b`` on Wan) ride in PEFT's
``lora_B.bias``, which adds them scaled like ``B``: each slot keeps its bias (weight and ``alpha / r``
folded in) in a row of one ``[n, sum(out)]`` buffer, and the bias the model reads is their sum,
recomputed in place (one reduction) when a swap changes a slot's bias.

Nothing the compiled graphs guard on (shapes, strides, the scaling floats, the active-adapter
list) ever changes outside the buckets warmed up, so swaps never recompile.

Why not PEFT's ``hotswap_adapter_from_state_dict``: it copies module by module, writes the new
adapter's ``alpha / r`` into ``scaling`` (a guarded float, or a tensor only after
``prepare_model_for_compiled_hotswap``) and has no notion of a per-request weight (the
``set_adapters`` weight is silently lost). Padding, folding the weight into ``B`` and the packed
layout are what none of the libraries does, so they are written here.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from hotlora.adapters.binding import Bindings, bindings_key
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.format.validate import SlotCeiling
from hotlora.engine.device import synchronize
from hotlora.engine.writers.base import SwapReport, ceiling_modules, split_pointwise
from hotlora.engine.writers.packing import PackCache, PackedWeights, PackLayout
from hotlora.errors import InvalidRequest, SlotStateCorrupt

log = logging.getLogger(__name__)

PEFT_ADAPTER = "hotlora_slots"  # the one PEFT adapter all slots are rows of


@dataclass
class _Slot:
    """One adapter's worth of padded tensors: a PEFT slot, or one entry of a mixed-batch bank."""

    name: str
    down: dict[str, torch.Tensor]  # module -> lora_A weight [R, in]
    up: dict[str, torch.Tensor]  # module -> lora_B weight [out, R]
    rank: dict[str, int]  # module -> rank of the current occupant (0 = empty)
    sha256: str | None = None
    scale: float | None = None
    key: tuple | None = None  # the occupant's ``Binding.key``: equal keys need no write
    flat_down: torch.Tensor | None = None  # [R, sum(in)]: every module's down is a view of it
    flat_up: torch.Tensor | None = None  # [R, sum(out)]: every module's up is a transposed view of it
    # Modules outside the flat buffers: their base weights are kept in another dtype (Wan's float32
    # time embedder in a bf16 model), so their LoRA weights have buffers of that dtype of their own.
    apart: tuple[str, ...] = ()
    bias: dict[str, torch.Tensor] | None = None  # module -> this slot's LoRA bias [out] (slots with biases)
    biased: set[str] = field(default_factory=set)  # modules whose bias the occupant set (non-zero)


class SlotsWriter:
    """The slots of one denoiser (the ``slots`` adapter writer). Owns every LoRA tensor in it;
    nothing else writes them. One request's adapters at a time."""

    mixes_requests = False
    # Packed copies of prepared adapters (engine/writers/packing.py; host memory beside a GPU): at
    # least two requests' worth, the one swapping in and the next one being prepared. One full-size
    # Flux adapter of rank 128 on every Linear is 1.39 GB: a fixed 2 GiB would evict a pair's first
    # adapter while preparing its second, and that slot would then be copied module by module.
    MIN_PACK_CACHE_BYTES = 2 * 1024**3

    def __init__(self, denoiser, family: str, slot_names: Iterable[str], target_rank: int, target_modules=None,
                 served_models: Iterable[str] = (), rank_buckets: Iterable[int] = (), biases: bool = False,
                 pointwise: str = ""):
        """``pointwise``: the family's ``pointwise_convs``, 1x1 convs held beside the Linears."""
        self.slot_names = tuple(slot_names)
        if len(set(self.slot_names)) != len(self.slot_names):
            raise ValueError(f"slot names must be unique, got {self.slot_names}")
        if target_rank < 1:
            raise ValueError("target_rank must be >= 1")
        bad = [b for b in rank_buckets if not isinstance(b, int) or not 0 <= b <= target_rank]
        if bad:
            raise ValueError(f"rank buckets must be integers in 0..target_rank ({target_rank}), got {bad}")
        # The ranks the model is compiled for; a request runs the smallest that holds its adapters.
        # No slots (the benchmarks' baseline): nothing to bucket, one state.
        self.rank_buckets = tuple(sorted({*rank_buckets, target_rank})) if self.slot_names else (target_rank,)
        modules = ceiling_modules(denoiser, target_modules, pointwise)
        # PEFT's LoRA layer on a torchao-quantized weight (base_quantization) takes no lora_bias: such
        # slots hold none, and a biased adapter is refused saying so (the banks' layers hold them).
        quantized = [n for n in modules if type(denoiser.get_submodule(n).weight) not in (torch.Tensor, torch.nn.Parameter)]
        because = (f"the {family} slots over a quantized base hold no LoRA bias (PEFT's LoRA layer on a torchao "
                   "weight takes none); mixed batches (mixed=True) hold them" if biases and quantized else "")
        if because:
            log.warning("%s: biased adapters will be refused", because)
        linears, convs = split_pointwise(denoiser, modules)
        self.ceiling = SlotCeiling(modules=linears, target_rank=target_rank, family=family,
                                   served_models=frozenset(n for n in served_models if n),
                                   biases=biases and bool(self.slot_names) and not quantized,
                                   no_biases_because=because, pointwise=convs)
        # PEFT gives a LoRA layer its base weight's dtype; a model may keep some modules in another
        # (diffusers' ``_keep_in_fp32_modules``): those stay out of the flat buffers (one dtype), so an
        # adapter touching them is written module by module (``pack`` leaves it unpacked).
        dtypes = {name: lora_dtype(denoiser.get_submodule(name)) for name in modules}
        widths: dict[torch.dtype, int] = {}  # the flat buffers take the dtype of most of the slots' columns
        for name, dtype in dtypes.items():
            widths[dtype] = widths.get(dtype, 0) + sum(modules[name])
        self.dtype = max(widths, key=widths.get) if widths else torch.get_default_dtype()
        self.apart = tuple(name for name, dtype in dtypes.items() if dtype != self.dtype)
        self.layout = PackLayout.of({name: shape for name, shape in modules.items() if name not in self.apart})
        self._dtypes = dtypes
        self._slots: dict[str, _Slot] = {}
        self._peft: list[tuple[str, torch.nn.ModuleDict, torch.nn.ModuleDict]] = []  # what the model reads
        self._layers: list[torch.nn.Module] = []  # the PEFT LoRA layers (bucket 0 switches their branch off)
        self._bucket_weights: dict[int, list[tuple[torch.nn.Parameter, torch.nn.Parameter]]] = {}
        self._bucket_pointers: dict[int, int] = {}  # id(Parameter) -> where its data must stay
        # LoRA biases: every slot's rows ([n, width]) and their sum, the model's lora_B.bias Parameters
        # (views of it); the flat pair first, then one pair per module kept apart.
        self._bias_sums: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bias_params: list[tuple[torch.nn.Parameter, int]] = []  # (Parameter, its data_ptr)
        self.bucket = target_rank
        self.device = next(denoiser.parameters()).device
        if self.slot_names:  # no slots at all is the baseline the benchmarks measure the slots' cost against
            self._slots = self._install(denoiser, modules)
        self.pack_cache_bytes = max(self.MIN_PACK_CACHE_BYTES, 2 * self.nbytes)
        self.packs = PackCache(self.layout, self.pack_cache_bytes)

    # Long: the PEFT adapter, its buffers (flat, and per module for modules of another dtype), every
    # bucket's Parameters and the slots' views are made together, from the same buffers, once.
    def _install(self, denoiser, modules) -> dict[str, _Slot]:
        """One PEFT adapter of rank ``len(slots) * target_rank`` on the ceiling, whose weights are
        views into two zeroed rank-major buffers, the slots' rows interleaved: row ``i * n + k``
        is rank ``i`` of slot ``k``, so the ranks below ``b`` of every slot are the first ``n * b``
        rows (what a rank bucket ``b`` runs).

        One adapter instead of one per slot: a Linear then runs one pair of low-rank products of
        rank 2R instead of two pairs of rank R, reading its input and adding into its output once
        per step, not once per slot (measured on the tiny model: 45% over no slots with two
        adapters of rank 16, 31% with one of rank 32).
        """
        from peft import LoraConfig

        n, rank = len(self.slot_names), self.ceiling.target_rank
        total = rank * n
        # An anchored alternation of exact names: PEFT's list matching is by suffix and would
        # widen the ceiling ("proj_out" would match every ".proj_out").
        exact = "|".join(re.escape(m) for m in modules)
        # alpha == r: PEFT's scaling is the constant 1.0 whatever rows a bucket runs; each slot's
        # weight and alpha/r go into B.
        config = LoraConfig(r=total, lora_alpha=total, target_modules=f"^(?:{exact})$", lora_dropout=0.0,
                            lora_bias=self.ceiling.biases)
        with warnings.catch_warnings():
            # A torchao-quantized base (base_quantization): PEFT warns that its LoRA layer cannot
            # merge; the slots never merge (fused mode is refused with a quantized base).
            warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without", UserWarning)
            # PEFT's weights on the meta device (it leaves them there), replaced at once by ``_point``: real
            # ones were allocated and freed, 1.29 GiB at full SDXL, kept resident on a CPU, reserved on CUDA.
            with torch.device("meta"):
                denoiser.add_adapter(config, adapter_name=PEFT_ADAPTER)
        denoiser.set_adapters([PEFT_ADAPTER], [1.0])  # once, before compile
        # The dtype and device PEFT gives LoRA weights: the base weight's (``lora_dtype``).
        device = denoiser.get_submodule(next(iter(modules))).get_base_layer().weight.device
        all_down = torch.zeros(total, self.layout.down_width, dtype=self.dtype, device=device)
        all_up = torch.zeros(total, self.layout.up_width, dtype=self.dtype, device=device)
        # Modules of another dtype: rank-major buffers of their own, [total, in] and [total, out].
        apart = {name: (torch.zeros(total, modules[name][0], dtype=self._dtypes[name], device=device),
                        torch.zeros(total, modules[name][1], dtype=self._dtypes[name], device=device))
                 for name in self.apart}

        def down_view(rows_of, name, rows=None):  # rows_of: the flat buffer's rows -> the module's
            return apart[name][0][rows_of][:rows] if name in apart else self.layout.down_view(all_down[rows_of], name, rows)

        def up_view(rows_of, name, rows=None):
            return apart[name][1][rows_of][:rows].t() if name in apart else self.layout.up_view(all_up[rows_of], name, rows)

        for name in modules:
            layer = denoiser.get_submodule(name)
            self._peft.append((name, layer.lora_A, layer.lora_B))
            self._layers.append(layer)
        # One set of Parameters per bucket, made once: switching buckets re-points the PEFT
        # weights to the same objects every time, which is what the compiled graphs were made for.
        def as_layer(view, name):  # a 1x1 conv's LoRA convs read [rows, in, 1, 1] and [out, rows, 1, 1]
            return view[..., None, None] if name in self.ceiling.pointwise else view

        for bucket in (b for b in self.rank_buckets if b):
            rows = bucket * n
            self._bucket_weights[bucket] = [
                (torch.nn.Parameter(as_layer(down_view(slice(None), name, rows), name), requires_grad=False),
                 torch.nn.Parameter(as_layer(up_view(slice(None), name, rows), name), requires_grad=False))
                for name, _, _ in self._peft
            ]
        if len(self._bucket_weights) > 1:
            # The rows a bucket reads are one symbolic size in the compiled graphs, not a constant per
            # bucket: one graph serves every non-zero bucket (pipeline.py's hold_weight_shapes has dynamo
            # read module weights' marks). Marked before the first trace, so none is compiled static.
            for pairs in self._bucket_weights.values():
                for down, up in pairs:
                    torch._dynamo.maybe_mark_dynamic(down, 0)
                    torch._dynamo.maybe_mark_dynamic(up, 1)
                    for dim in range(1, down.ndim):  # the features (and a 1x1 conv's unit axes)
                        torch._dynamo.mark_static(down, dim)
                    for dim in (0, *range(2, up.ndim)):
                        torch._dynamo.mark_static(up, dim)
        if 0 in self.rank_buckets:  # reads no rows: held at the smallest bucket's, so its guards never vary
            self._bucket_weights[0] = self._bucket_weights[min(b for b in self.rank_buckets if b)]
        self._bucket_pointers = {id(p): p.data_ptr() for pairs in self._bucket_weights.values()
                                 for pair in pairs for p in pair}
        self._point(rank)
        bias_of = self._install_biases(n, modules, device) if self.ceiling.biases else None
        return {
            slot: _Slot(slot, {m: down_view(slice(k, None, n), m) for m in modules},
                        {m: up_view(slice(k, None, n), m) for m in modules}, dict.fromkeys(modules, 0),
                        flat_down=all_down[k::n], flat_up=all_up[k::n], apart=self.apart,
                        bias=None if bias_of is None else {m: bias_of(k, m) for m in modules})
            for k, slot in enumerate(self.slot_names)
        }

    def _install_biases(self, n: int, modules, device):
        """Zeroed bias rows for every slot and their sum, whose views become each LoRA layer's
        ``lora_B.bias`` (PEFT made them on the meta device); returns (slot index, module) -> that
        slot's bias view."""
        rows = torch.zeros(n, self.layout.up_width, dtype=self.dtype, device=device)
        apart = {name: torch.zeros(n, modules[name][1], dtype=self._dtypes[name], device=device) for name in self.apart}
        self._bias_sums = [(rows, torch.zeros(self.layout.up_width, dtype=self.dtype, device=device))]
        self._bias_sums += [(apart[name], torch.zeros(modules[name][1], dtype=self._dtypes[name], device=device))
                            for name in self.apart]
        sums = {name: total for name, (_, total) in zip(self.apart, self._bias_sums[1:])}

        def columns(name):
            return slice(*self.layout.up_columns[name])

        for name, _, up in self._peft:
            summed = sums[name] if name in apart else self._bias_sums[0][1][columns(name)]
            up[PEFT_ADAPTER].bias = torch.nn.Parameter(summed, requires_grad=False)
            self._bias_params.append((up[PEFT_ADAPTER].bias, summed.data_ptr()))
        return lambda k, name: apart[name][k] if name in apart else rows[k, columns(name)]

    def _sum_biases(self) -> None:
        for rows, total in self._bias_sums:
            torch.sum(rows, dim=0, out=total)

    def _point(self, bucket: int) -> None:
        """Make the model read the first ``slots * bucket`` rows of the slot buffers. Bucket 0 (no
        adapter in any slot) runs no LoRA branch at all: PEFT's own "adapters disabled" path, the
        base layer alone, compiled at warm-up like any bucket (a module attribute dynamo guards on).
        Set on the layers directly: PEFT's ``enable_adapters(True)`` would also mark the slot
        weights trainable (``requires_grad``, which the graphs guard on too)."""
        for (_, down, up), (a, b) in zip(self._peft, self._bucket_weights[bucket]):
            down[PEFT_ADAPTER].weight = a
            up[PEFT_ADAPTER].weight = b
        for layer in self._layers:
            layer._disable_adapters = bucket == 0
        self.bucket = bucket

    def use_bucket(self, bucket: int) -> None:
        """Run the rank bucket ``bucket`` (warm-up visits each); slots must fit in it."""
        if bucket not in self.rank_buckets:
            raise ValueError(f"{bucket} is not one of the rank buckets {self.rank_buckets}")
        needed = self.rows_in_use()
        if needed > bucket:
            raise ValueError(f"the slots hold rank {needed}, more than bucket {bucket}")
        if self.slot_names and bucket != self.bucket:
            self._point(bucket)

    def rows_in_use(self) -> int:
        """The highest rank any slot's occupant uses (its zero-padded rows beyond it are unread)."""
        return max((max(s.rank.values(), default=0) for s in self._slots.values()), default=0)

    def check_intact(self) -> None:
        """Raise SlotStateCorrupt if a weight the model reads is not the current bucket's view of
        the slot buffers: replaced (``module.weight = ...``) or given other storage
        (``weight.data = ...``). Either would silently drop every later swap."""
        for (name, down, up), (a, b) in zip(self._peft, self._bucket_weights.get(self.bucket, [])):
            for held, expected in ((down[PEFT_ADAPTER].weight, a), (up[PEFT_ADAPTER].weight, b)):
                if held is not expected or held.data_ptr() != self._bucket_pointers[id(expected)]:
                    raise SlotStateCorrupt(f"{name}: the LoRA weights the model reads are no longer the slots'")
        for (name, _, up), (param, pointer) in zip(self._peft, self._bias_params):
            if up[PEFT_ADAPTER].bias is not param or param.data_ptr() != pointer:
                raise SlotStateCorrupt(f"{name}: the LoRA bias the model reads is no longer the slots'")
        if any(layer.disable_adapters != (self.bucket == 0) for layer in self._layers):
            raise SlotStateCorrupt(f"the slots' LoRA branches are switched {'on' if self.bucket == 0 else 'off'} "
                                   f"outside the engine (rank bucket {self.bucket})")

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for s in self._slots.values() for t in (*s.down.values(), *s.up.values()))
                + sum(rows.nbytes + total.nbytes for rows, total in self._bias_sums))

    def describe(self) -> dict:
        return {"writer": "slots", "slot_bytes": self.nbytes, "rank_buckets": list(self.rank_buckets[:-1]),
                "occupants": {name: (s.sha256, s.scale) for name, s in self._slots.items()}}

    # ------------------------------------------------------------------ the writer interface

    def prepare(self, bindings: Bindings) -> None:
        """On the request's thread: lay the adapters out for a one-copy swap (side table)."""
        for adapter, _ in bindings.values():
            self.packs.prepare(adapter)

    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        """Before a chunk: every sample's adapters in place. The slots hold one request's adapters,
        so every sample must carry the same; a repeated bind of what is in place copies nothing."""
        if len({bindings_key(s) for s in samples}) > 1:
            raise InvalidRequest("this engine's slots hold one request's adapters at a time; "
                                 "build it with mixed=True to batch requests with different adapters")
        return self.swap(samples[0] if samples else {})

    def warmup_states(self) -> tuple[int, ...]:
        """The states steady state may run in: one per rank bucket, largest first."""
        return tuple(reversed(self.rank_buckets))

    def enter(self, state: int) -> None:
        self.use_bucket(state)

    @torch.no_grad()
    def swap(self, bindings: Bindings) -> SwapReport:
        """Write each slot's adapter (or zeros) in place. Callers validate first.

        Slots not named in ``bindings`` are emptied: a request gets exactly the adapters it
        names, never a previous request's.
        """
        start = time.perf_counter()
        report = SwapReport()
        biases_changed = False
        for name, slot in self._slots.items():
            assigned = bindings.get(name)
            adapter, scale = assigned if assigned is not None else (None, 0.0)
            if adapter is not None and slot.key == assigned.key:
                report.adapters[name] = adapter.sha256
                continue  # already in place: the cheapest swap is none
            packed = self.packs.get(adapter) if adapter is not None else None
            if packed is not None and packed.layout_key == self.layout.key and scale != 0.0:
                write_packed(slot, packed, float(scale), report)
            else:
                write_padded(slot, adapter, float(scale), report)
            biases_changed |= write_biases(slot, adapter, float(scale))
            slot.sha256, slot.scale = (adapter.sha256, float(scale)) if adapter is not None else (None, None)
            slot.key = assigned.key if adapter is not None else None
            report.adapters[name] = slot.sha256
        if biases_changed:
            self._sum_biases()
        if len(self.rank_buckets) > 1:
            needed = self.rows_in_use()
            bucket = next(b for b in self.rank_buckets if b >= needed)
            if bucket != self.bucket:
                self._point(bucket)
        report.rank_bucket = self.bucket
        synchronize(self.device)  # host-to-device copies are asynchronous
        report.ms = (time.perf_counter() - start) * 1000
        return report


def lora_dtype(layer) -> torch.dtype:
    """The dtype PEFT gives a LoRA layer's weights: its base weight's, or the default dtype where that
    is not floating point (a quantized base)."""
    base = getattr(layer, "get_base_layer", lambda: layer)().weight
    return base.dtype if base.dtype.is_floating_point else torch.get_default_dtype()


@torch.no_grad()
def write_padded(slot: _Slot, adapter: Adapter | None, scale: float, report: SwapReport) -> None:
    """Copy ``adapter`` (scale and alpha/r folded into B) into one slot's rank-padded tensors, in
    place, zeroing only what the previous occupant left beyond the new rank.

    The path for adapters that are not packed for the slots (``write_packed`` is the fast one).
    The work is gathered into lists and done with ``torch._foreach_*``: one multi-tensor kernel
    per kind of operation instead of several small launches per module.
    """
    incoming = adapter.modules if adapter is not None else {}
    if incoming and scale != 0.0:
        report.per_module_writes += 1
    copy_dst, copy_src, scaled, factors, zero = [], [], [], [], []
    for module, down in slot.down.items():
        up = slot.up[module]
        previous = slot.rank[module]
        weights = incoming.get(module)
        if weights is None or scale == 0.0:
            if previous:
                zero += [down[:previous], up[:, :previous]]
                report.modules_zeroed += 1
            slot.rank[module] = 0
            continue
        r = weights.rank
        copy_dst += [down[:r], up[:, :r]]
        copy_src += [weights.down.flatten(1), weights.up.flatten(1)]  # a 1x1 conv's factors as a Linear's
        scaled.append(up[:, :r])
        factors.append(weights.scaling * scale)
        if previous > r:
            zero += [down[r:previous], up[:, r:previous]]
        slot.rank[module] = r
        report.modules_written += 1
        report.bytes_copied += weights.down.nbytes + weights.up.nbytes
    if zero:
        torch._foreach_zero_(zero)
    if copy_dst:
        torch._foreach_copy_(copy_dst, copy_src, non_blocking=True)
        torch._foreach_mul_(scaled, factors)


@torch.no_grad()
def write_biases(slot: _Slot, adapter: Adapter | None, scale: float) -> bool:
    """Write ``adapter``'s LoRA biases (scale and alpha/r folded in, as in B) into a slot that holds
    biases, zeroing what the previous occupant set; whether anything was written (the summed bias
    the model reads is then stale)."""
    if slot.bias is None:
        return False
    incoming = {m: w for m, w in adapter.modules.items() if w.bias is not None} if adapter and scale else {}
    stale = [slot.bias[m] for m in slot.biased - incoming.keys()]
    if stale:
        torch._foreach_zero_(stale)
    if incoming:
        targets = [slot.bias[m] for m in incoming]
        torch._foreach_copy_(targets, [w.bias for w in incoming.values()], non_blocking=True)
        torch._foreach_mul_(targets, [w.scaling * scale for w in incoming.values()])
    changed = bool(stale or incoming)
    slot.biased = set(incoming)
    return changed


@torch.no_grad()
def write_packed(slot: _Slot, packed: PackedWeights, scale: float, report: SwapReport) -> None:
    """Copy a packed adapter into a slot's flat buffers (one copy for A, one scaled copy for B),
    then zero the rows the previous occupant used beyond this one's rank."""
    rows = packed.rows
    previous = max(slot.rank.values(), default=0)
    down, up = slot.flat_down[:rows], slot.flat_up[:rows]
    factor = packed.scaling * scale
    down.copy_(packed.down, non_blocking=True)
    if factor == 1.0:
        up.copy_(packed.up, non_blocking=True)
    elif packed.up.device == up.device:
        torch.mul(packed.up, factor, out=up)  # one pass: read once, write once
    else:  # host to device: the transfer is the cost; the multiply runs at device memory speed
        up.copy_(packed.up, non_blocking=True)
        up.mul_(factor)
    if previous > rows:
        slot.flat_down[rows:previous].zero_()
        slot.flat_up[rows:previous].zero_()
    # A packed adapter touches no module kept apart (``pack``): what a previous occupant left there goes.
    for module in slot.apart:
        if slot.rank[module]:
            slot.down[module][:slot.rank[module]].zero_()
            slot.up[module][:, :slot.rank[module]].zero_()
    # Rows below ``rows`` that a module does not use are zeros in the packing: the module's
    # occupied rank is ``rows`` as far as later per-module writes are concerned.
    slot.rank = {module: 0 if module in slot.apart else rows for module in slot.rank}
    report.packed_writes += 1
    report.modules_written += len(slot.rank)
    report.bytes_copied += packed.down.nbytes + packed.up.nbytes
