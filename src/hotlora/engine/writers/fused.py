"""Fused mode: each request's adapters merged into the denoiser's own weights, in place.

No LoRA layer is ever installed, so the compiled model is the base model and a step costs what
it costs without adapters. A pristine copy of every Linear weight (and, on SDXL, every Conv2d
weight: conv LoRA such as kohya LoCon) is taken before compile (on the device when it fits, else
in pinned host memory). ``target_modules`` is not used: merging costs the same on any layer, so
there is no ceiling to choose (the pristine copy is the price; ``describe()`` reports it). A swap
writes, for every layer the old or the new request touches::

    W = W0 + sum_k scale_k * alpha_k / r_k * B_k @ A_k    (new request touches it)
    W = W0                                              (only the old request touched it)

The sum over slots is one GEMM over the concatenated ranks, accumulated in float32 and cast to
the weight's dtype once. A conv layer's delta is the same GEMM on flattened factors: the down conv
has the layer's kernel and the up conv is 1x1, so ``B.flatten(1) @ A.flatten(1)`` reshaped to
``[out, in, kh, kw]`` is exactly what running the two LoRA convs adds. Unfusing is always a copy
of ``W0``, never a subtraction, so after any sequence of swaps "no adapters" is the base weights
bit for bit. A LoRA bias (PEFT's ``lora_B.bias``, lightx2v's ``.diff_b``) merges the same way into
the layer's own bias, ``b = b0 + sum_k scale_k * alpha_k / r_k * bias_k``, from a pristine copy of
the biases; a layer without a bias of its own cannot take one (refused at validation). The
Parameters are the same objects with the same storage throughout (``copy_``), so no dynamo guard
sees a change and a swap never recompiles. The weights must stay graph *inputs*: inductor's ``freezing`` would fold
them into the compiled code as constants and every swap would be silently ignored (``enter``
refuses to warm up with it on).

The Python work is grouped: layers of the same shape are one batched GEMM (``torch.bmm`` over
their stacked, rank-padded factors, prepared on the request's thread) and one
``torch._foreach_add_`` / ``torch._foreach_copy_`` each, so a swap issues a few calls per layer
*shape*, not per layer. Restores are one ``torch._foreach_copy_``.

Why by hand: diffusers' ``fuse_lora`` / ``unfuse_lora`` (PEFT's ``merge`` / ``unmerge``) unfuse by
subtracting the delta (drifts in low precision), compute the delta in the weight's dtype on
accelerators, work layer by layer, and need the LoRA layers installed in the model (which the
compiled graph would then contain). None of them keeps a pristine copy or folds a per-request
weight into one GEMM per layer.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from hotlora.adapters.binding import Bindings, bindings_key, factors_by_module
from hotlora.adapters.format.convert import Adapter, LoraWeights
from hotlora.adapters.format.validate import SlotCeiling
from hotlora.engine.device import synchronize
from hotlora.engine.writers.base import SwapReport, ceiling_modules, split_pointwise
from hotlora.errors import AdapterRejected, InvalidRequest, SlotStateCorrupt
from hotlora.lru import LRU

RESTORE_CHOICES = ("auto", "device", "host")


@dataclass
class _Group:
    """Layers of one weight shape a request touches: their stacked float32 factors, rank-padded to
    the group's largest concatenated rank (zero rows add nothing). Conv factors are flattened."""

    modules: list[str]
    up: torch.Tensor  # [G, out, R]: every slot's B, scale and alpha/r folded in, side by side
    down: torch.Tensor  # [G, R, in * kh * kw]: every slot's A, stacked
    shape: tuple[int, ...]  # the weights' own shape: [out, in] or [out, in, kh, kw]


@dataclass
class _Plan:
    """What one request's adapters write: built once per (adapters, scales), off the serving thread."""

    groups: list[_Group]
    modules: frozenset[str]
    fused: dict[str, dict] = field(default_factory=dict)  # slot -> {"modules", "rank", "kept"}
    nbytes: int = 0
    kept: float = 1.0  # the fraction of the intended delta the merged weights carry (``FusedWriter._kept``)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> float32 bias delta, slots summed


def conv_modules(denoiser: torch.nn.Module) -> dict[str, tuple[int, int, int, int]]:
    """The Conv2d layers fused mode may merge into: name -> weight shape. Grouped convs are left out
    (a LoRA's down conv would not have the layer's channel groups); Flux has no Conv2d at all."""
    return {name: tuple(m.weight.shape) for name, m in denoiser.named_modules()
            if isinstance(m, torch.nn.Conv2d) and m.groups == 1}


class FusedWriter:
    """The ``fused`` adapter writer (see the module docstring)."""

    mixes_requests = False  # the weights hold one adapter set: one request per forward batch
    PLAN_CACHE_BYTES = 512 * 1024**2  # prepared requests' stacked factors kept on the device
    SCRATCH_BYTES = 256 * 1024**2  # float32 deltas computed at once (a group is cut into chunks)

    def __init__(self, denoiser: torch.nn.Module, family: str, slot_names: Iterable[str], target_rank: int,
                 served_models: Iterable[str] = (), restore: str = "auto",
                 weights_of: Callable[[Adapter], Mapping[str, LoraWeights]] | None = None,
                 min_kept: float | None = 0.0, linears: Mapping[str, tuple[int, int]] | None = None):
        # What of an adapter this writer merges: the denoiser's modules, or (the text encoders'
        # writers) one text encoder's.
        self.weights_of = weights_of or (lambda adapter: adapter.modules)
        # Below it a request is refused before anything is written. None: not measured (the text
        # encoders' writers, which merge in every adapter mode).
        self.min_kept = min_kept
        self.slot_names = tuple(slot_names)
        if len(set(self.slot_names)) != len(self.slot_names):
            raise ValueError(f"slot names must be unique, got {self.slot_names}")
        if restore not in RESTORE_CHOICES:
            raise ValueError(f"fused_restore must be one of {', '.join(RESTORE_CHOICES)}, got {restore!r}")
        # Every Linear and Conv2d of the denoiser, any rank: merging costs the same whatever the
        # layer or rank (target_modules is not consulted: see the module docstring). ``linears``:
        # those layers only (auto mode: the slots' ceiling, which every adapter must fit so that it
        # can fall back to the slots; the pristine copy covers no more): Linears, and the 1x1 convs
        # of a family's ``pointwise_convs``, merged as convs.
        if linears is None:
            modules, convs = ceiling_modules(denoiser, None), conv_modules(denoiser)
        else:
            modules, pointwise = split_pointwise(denoiser, linears)
            convs = {name: tuple(denoiser.get_submodule(name).weight.shape) for name in pointwise}
        self.device = next(denoiser.parameters()).device
        layers = [*modules, *convs]
        self._params: dict[str, torch.nn.Parameter] = {m: denoiser.get_submodule(m).weight for m in layers}
        self._layers = {m: denoiser.get_submodule(m) for m in layers}
        # The Linears' own biases: where a LoRA bias merges.
        self._biases = {m: self._layers[m].bias for m in modules if getattr(self._layers[m], "bias", None) is not None}
        self.ceiling = SlotCeiling(modules=modules, target_rank=target_rank, family=family,
                                   served_models=frozenset(n for n in served_models if n), any_rank=True,
                                   convs=convs, biases=True, unbiased=frozenset(m for m in modules if m not in self._biases))
        self._pointers = {m: p.data_ptr() for m, p in self._params.items()}
        self._bias_pointers = {m: b.data_ptr() for m, b in self._biases.items()}
        self.pristine_bytes = sum(p.nbytes for p in [*self._params.values(), *self._biases.values()])
        self.restore = self._where(restore)
        with torch.no_grad():
            self._pristine = {m: self._kept_copy(p) for m, p in self._params.items()}
            self._pristine_biases = {m: self._kept_copy(b) for m, b in self._biases.items()}
        self._current: tuple | None = ()  # signature of what is merged; None: unknown (a failed swap)
        self._touched: frozenset[str] = frozenset()  # layers that differ from W0 now
        self._biased: frozenset[str] = frozenset()  # layers whose bias differs from b0 now
        self._fused: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._plans: LRU[tuple, _Plan] = LRU(max_cost=self.PLAN_CACHE_BYTES, cost=lambda plan: plan.nbytes)

    def _kept_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pristine copy where ``restore`` keeps them: on the device, or in (pinned) host memory."""
        if self.restore == "device":
            return tensor.detach().clone()
        copy = tensor.detach().to("cpu", copy=True)
        return copy.pin_memory() if self.device.type == "cuda" else copy

    def _where(self, restore: str) -> str:
        """"auto": the device when the pristine copy fits in its free memory with room to run
        (a quarter of the device kept free for activations), else pinned host memory."""
        if restore != "auto":
            return restore
        if self.device.type != "cuda":
            return "device"  # CPU: device memory is host memory
        free, total = torch.cuda.mem_get_info(self.device)
        return "device" if self.pristine_bytes <= free - total // 4 else "host"

    # ------------------------------------------------------------------ the writer interface

    def prepare(self, bindings: Bindings) -> None:
        """On the request's thread: stack the request's factors per layer shape (the swap then
        only runs GEMMs and copies) and measure what the merge keeps; a request whose merged
        weights would carry less than ``min_kept`` of its delta is refused here, before the
        weights are touched."""
        plan = self.plan_for(bindings)
        if plan is not None and self.min_kept is not None and plan.kept < self.min_kept:
            dtype = next(iter(self._params.values())).dtype
            names = ", ".join(f"{slot}={b.adapter.name} (scale {b.scale:g})" for slot, b in sorted(bindings.items())
                              if b is not None and b.writes)
            raise AdapterRejected(names, [
                f"merged into the {str(dtype).removeprefix('torch.')} weights, it would keep {plan.kept:.1%} of its "
                f"weight delta (fused_min_kept {self.min_kept:.0%}): delta elements under half a "
                f"{str(dtype).removeprefix('torch.')} step of their weight vanish in the merge. Serve it with "
                "adapter_mode=slots (unfused, nothing lost) or auto (slots for such requests), or lower "
                "fused_min_kept to accept the loss"])

    def plan_for(self, bindings: Bindings) -> _Plan | None:
        """The request's plan (``kept`` measured), from the cache or built now and cached; None for
        a request that merges nothing."""
        signature = bindings_key(bindings)
        if not signature:
            return None
        plan = self._plans.get(signature)
        if plan is None:
            plan = self._plan(bindings)
            self._plans.put(signature, plan)
        return plan

    def forget(self, bindings: Bindings) -> None:
        """Drop the request's cached plan (auto mode: a request served through the slots never
        merges, so its stacked factors would only hold device memory)."""
        self._plans.pop(bindings_key(bindings))

    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        """Before a chunk: the weights hold one adapter set, so every sample must carry the same."""
        if len({bindings_key(s) for s in samples}) > 1:
            raise InvalidRequest("fused mode merges one request's adapters into the weights; a forward batch "
                                 "cannot carry different adapters")
        return self.swap(samples[0] if samples else {})

    def warmup_states(self) -> tuple[str, ...]:
        return ("fused",)  # one graph: the base model's, whatever is merged into its weights

    def enter(self, state: str) -> None:
        # Called before the first (compiling) forward: frozen weights would be constants of the
        # graph, and every later swap would be ignored by it.
        if torch._inductor.config.freezing:
            raise RuntimeError("fused mode needs the weights as graph inputs: torch._inductor.config.freezing "
                               "must be off")

    def check_intact(self) -> None:
        for module, param in self._params.items():
            if self._layers[module].weight is not param or param.data_ptr() != self._pointers[module]:
                raise SlotStateCorrupt(f"{module}: the weight the model reads is no longer the one fused mode writes")
        for module, bias in self._biases.items():
            if self._layers[module].bias is not bias or bias.data_ptr() != self._bias_pointers[module]:
                raise SlotStateCorrupt(f"{module}: the bias the model reads is no longer the one fused mode writes")

    @property
    def nbytes(self) -> int:
        return self.pristine_bytes if self.restore == "device" else 0

    def describe(self) -> dict:
        return {"writer": "fused", "slot_bytes": self.nbytes, "restore": self.restore,
                "pristine_bytes": self.pristine_bytes, "fusable_modules": len(self._params),
                "fusable_convs": len(self.ceiling.convs),
                "one_adapter_set_per_batch": True,  # requests are never merged into one forward batch
                "merged": {slot: dict(info) for slot, info in self._fused.items()},
                "plan_cache_bytes": self._plans.total_cost}

    # ------------------------------------------------------------------ the swap

    @torch.no_grad()
    def _plan(self, bindings: Bindings) -> _Plan:
        per_module, fused = factors_by_module(bindings, self.weights_of)
        shapes: dict[tuple[int, ...], list[str]] = {}
        for module in per_module:
            shapes.setdefault(tuple(self._params[module].shape), []).append(module)
        groups, nbytes = [], 0
        kwargs = {"dtype": torch.float32, "device": self.device}
        for shape, modules in shapes.items():
            out_features, in_features = shape[0], math.prod(shape[1:])  # a conv: in * kh * kw
            rank = max(sum(a.shape[0] for a, _, _ in per_module[m]) for m in modules)
            up = torch.zeros(len(modules), out_features, rank, **kwargs)
            down = torch.zeros(len(modules), rank, in_features, **kwargs)
            for g, module in enumerate(modules):
                row = 0
                for a, b, factor in per_module[module]:
                    r = a.shape[0]
                    # flatten(1): a conv's B [out, r, 1, 1] and A [r, in, kh, kw]; a no-op for a Linear
                    up[g, :, row:row + r].copy_(b.flatten(1)).mul_(factor)  # float32 before scaling: one rounding
                    down[g, row:row + r].copy_(a.flatten(1))
                    row += r
            groups.append(_Group(modules, up, down, shape))
            nbytes += up.nbytes + down.nbytes
        biases = self._bias_deltas(bindings)
        nbytes += sum(b.nbytes for b in biases.values())
        kept = self._kept(groups) if self.min_kept is not None else 1.0
        for info in fused.values():
            if self.min_kept is not None:
                info["kept"] = round(kept, 6)  # the request's merge as a whole: its slots share each layer
        return _Plan(groups, frozenset(per_module), fused, nbytes, kept, biases)

    def _bias_deltas(self, bindings: Bindings) -> dict[str, torch.Tensor]:
        """module -> the float32 sum of every slot's LoRA bias, each times its alpha/r and scale."""
        biases: dict[str, torch.Tensor] = {}
        for slot in sorted(bindings):
            binding = bindings[slot]
            if binding is None or not binding.writes:
                continue
            for module, w in self.weights_of(binding.adapter).items():
                if w.bias is not None:
                    delta = w.bias.to(self.device, torch.float32) * (w.scaling * float(binding.scale))
                    biases[module] = delta if module not in biases else biases[module] + delta
        return biases

    @torch.no_grad()
    def _kept(self, groups: list[_Group]) -> float:
        """What fraction of the intended delta ``D`` the merged weights will carry, over every layer
        the request touches: ``<cast(W0 + D) - W0, D> / |D|^2``. In float32 the merge keeps all of
        it (1.0 up to float32 rounding); in bf16 every element of ``D`` under half a bf16 step of
        its weight rounds away, and a weak adapter loses much of its effect (docs/benchmarks.md).
        The same GEMMs and the same cast as the merge itself, on the request's thread, once per
        plan (a request whose adapters and scales are cached costs nothing)."""
        carried = total = 0.0
        for group in groups:
            dtype = self._params[group.modules[0]].dtype
            for names, delta in self._deltas(group):
                base = torch.stack([self._pristine[m].to(self.device).reshape(delta.shape[1:]) for m in names]).float()
                merged = (base + delta).to(dtype).float() - base
                carried += float((merged * delta).sum(dtype=torch.float64))
                total += float((delta * delta).sum(dtype=torch.float64))
        return carried / total if total > 0 else 1.0

    def _deltas(self, group: _Group):
        """The group's float32 deltas ``[n, out, in]``, ``SCRATCH_BYTES`` at a time, with their layers."""
        out_features, in_features = group.up.shape[1], group.down.shape[2]
        step = max(1, self.SCRATCH_BYTES // (4 * out_features * in_features))
        for lo in range(0, len(group.modules), step):
            yield group.modules[lo:lo + step], torch.bmm(group.up[lo:lo + step], group.down[lo:lo + step])

    @torch.no_grad()
    def swap(self, bindings: Bindings) -> SwapReport:
        """Merge ``bindings`` (slot -> (adapter, scale)) into the weights; slots not named are
        empty. Callers validate first. The same adapters and scales as now: nothing is written."""
        start = time.perf_counter()
        report = SwapReport()
        signature = bindings_key(bindings)
        for slot, value in bindings.items():
            report.adapters[slot] = value[0].sha256 if value is not None else None
        with self._lock:
            if signature != self._current:
                plan = (self._plans.get(signature) if signature else None) or self._plan(bindings)
                try:
                    self._write(plan, report)
                except BaseException:
                    # Unknown state: the next swap restores every layer from W0 (and b0).
                    self._current, self._touched, self._biased = None, frozenset(self._params), frozenset(self._biases)
                    raise
                self._current, self._touched, self._fused = signature, plan.modules, plan.fused
                self._biased = frozenset(plan.biases)
            report.fused = {slot: dict(info) for slot, info in self._fused.items()}
        report.ms = (time.perf_counter() - start) * 1000
        return report

    def _write(self, plan: _Plan, report: SwapReport) -> None:
        params, pristine = self._params, self._pristine
        stale = [m for m in self._touched if m not in plan.modules]
        if stale:  # only the old request touched them: back to W0 by copy, never by subtraction
            torch._foreach_copy_([params[m] for m in stale], [pristine[m] for m in stale], non_blocking=True)
            report.modules_zeroed += len(stale)
        if plan.modules and self.restore == "host":
            # W0 comes over the bus once, into W itself; the merge below then reads it there.
            fused = sorted(plan.modules)
            torch._foreach_copy_([params[m] for m in fused], [pristine[m] for m in fused], non_blocking=True)
        source = params if self.restore == "host" else pristine
        for group in plan.groups:
            for names, delta in self._deltas(group):
                deltas = [d.view(group.shape) for d in delta]
                torch._foreach_add_(deltas, [source[m] for m in names])  # W0 + delta, in float32
                torch._foreach_copy_([params[m] for m in names], deltas)  # cast once
        self._write_biases(plan)
        report.modules_written += len(plan.modules)
        report.bytes_copied += sum(params[m].nbytes for m in (*stale, *plan.modules))
        synchronize(self.device)  # host-to-device copies are asynchronous

    def _write_biases(self, plan: _Plan) -> None:
        """b0 back where the old request merged a bias and this one does none; b0 + delta where it does."""
        stale = [m for m in self._biased if m not in plan.biases]
        if stale:
            torch._foreach_copy_([self._biases[m] for m in stale], [self._pristine_biases[m] for m in stale],
                                 non_blocking=True)
        if plan.biases:
            names = list(plan.biases)
            merged = torch._foreach_add([plan.biases[m] for m in names],
                                        [self._pristine_biases[m].to(self.device) for m in names])  # float32
            torch._foreach_copy_([self._biases[m] for m in names], merged)  # cast once
