"""Auto mode: one engine holding both writers; each request fused when its merge keeps its
adapters' effect, through the slots when it does not.

Fused mode costs nothing per step but loses, in bf16, every delta element under half a bf16 step
of its weight (a weak adapter keeps as little as ~60% of its effect, ``docs/benchmarks.md``,
"Precision"); the slots lose nothing but cost a low-rank product per Linear per step. Auto mode
measures what the merge would keep for each request (``FusedWriter.plan_for``: the fused plan's
``kept``, once per adapters-and-scales, on the request's thread) and serves it

- **fused** when ``kept >= fused_min_kept``: the adapters merged into the weights, every slot
  empty (zeros);
- **through the slots** otherwise: the weights restored to ``W0`` (a copy of the pristine
  weights, bit for bit), the adapters copied into the slots.

Exact either way: an empty slot adds exactly zero, and restored weights are the base bit for bit,
so each path's output is what that mode's own engine gives (the correctness contract holds per
path). No recompiles: the model is the slots' model throughout (PEFT layers over the base Linear,
whose weights fused mode writes in place, never replacing them), and a fused request runs the
slots' graph of the smallest rank bucket (the slots are empty), which the warm-up visits like
every bucket. With a rank-0 bucket (slots that run no LoRA product at all), a fused request would
be free of slot compute without a change here: ``SlotsWriter.swap({})`` picks the smallest bucket
that holds the (empty) slots.

An adapter with LoRA biases (lightx2v's ``.diff_b``) is decided like any other: the merge takes
them into the layers' biases; the slots hold them where the family's do (``lora_biases``: Wan),
and such a request that would need slots without them is refused by name.

Every adapter must fit the slots' layers (``target_modules``, Linear layers only), so that any
request could fall back to the slots; the pristine copy covers only those layers. An adapter above
the slots' ``target_rank`` (a high-rank LoRA, a LyCORIS LoKr's or LoHa's exact low-rank form) is
served fused when its merge keeps enough, and refused, before anything is written, when it would
need the slots.
One adapter set per forward batch, as in both writers it holds: requests with different adapters
are never batched together (``mixes_requests`` is False, and ``bind`` refuses such a batch before
writing anything).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from hotlora.adapters.binding import Bindings, bindings_key
from hotlora.engine.writers.base import SwapReport, ceiling_modules
from hotlora.engine.writers.fused import FusedWriter
from hotlora.engine.writers.slots import SlotsWriter
from hotlora.errors import AdapterRejected, InvalidRequest
from hotlora.lru import LRU

FUSED, SLOTS = "fused", "slots"


class AutoWriter:
    """The ``auto`` adapter writer (see the module docstring)."""

    mixes_requests = False
    DECISIONS = 4096  # (adapters, scales) -> path remembered; a miss re-measures (from the plan cache)

    def __init__(self, denoiser, family: str, slot_names: Iterable[str], target_rank: int, target_modules=None,
                 served_models: Iterable[str] = (), *, min_kept: float, restore: str = "auto",
                 rank_buckets: Iterable[int] = (), biases: bool = False, pointwise: str = ""):
        served_models = tuple(served_models)
        # The fused writer first: it captures the base Linear weights (and their pristine copy)
        # before PEFT wraps those Linear layers into LoRA layers. The wrapped layer keeps the same
        # Linear module and Parameter as its ``base_layer``, so fused writes reach the graph.
        linears = ceiling_modules(denoiser, target_modules, pointwise)
        self.fused = FusedWriter(denoiser, family, slot_names, target_rank, served_models, restore=restore,
                                 min_kept=0.0, linears=linears)  # measures kept; never refuses (we decide)
        self._min_kept = min_kept
        self.slots = SlotsWriter(denoiser, family, slot_names, target_rank, target_modules, served_models=served_models,
                                 rank_buckets=rank_buckets, biases=biases, pointwise=pointwise)
        self.slot_names = self.slots.slot_names
        # The slots' layers; any rank and LoRA biases where the merge takes them (what the slots
        # cannot hold is served fused only: ``_decide``).
        self.ceiling = dataclasses.replace(self.slots.ceiling, any_rank=True, biases=True,
                                           unbiased=self.fused.ceiling.unbiased)
        self._decisions: LRU[tuple, tuple[str, float]] = LRU(max_entries=self.DECISIONS)
        self.batches = {FUSED: 0, SLOTS: 0}  # forward batches (chunks) with adapters per path, for describe()

    @property
    def min_kept(self) -> float:
        return self._min_kept

    @min_kept.setter
    def min_kept(self, value: float) -> None:
        """A new floor: every request is decided again (bench/gpu_rows.py serves one adapter both ways)."""
        self._min_kept = value
        self._decisions = LRU(max_entries=self.DECISIONS)

    # ------------------------------------------------------------------ the writer interface

    def prepare(self, bindings: Bindings) -> None:
        """On the request's thread: measure what the merge keeps and choose the path; prepare
        that path's writer (the fused plan, or the slots' packed layout)."""
        mode, _ = self._decide(bindings)
        if mode == SLOTS:
            self.slots.prepare(bindings)

    def _decide(self, bindings: Bindings) -> tuple[str, float]:
        signature = bindings_key(bindings)
        decided = self._decisions.get(signature)
        if decided is None:
            plan = self.fused.plan_for(bindings)
            kept = plan.kept if plan is not None else 1.0
            decided = (FUSED if kept >= self._min_kept else SLOTS, kept)
            if decided[0] == SLOTS:
                self._refuse_above_slots(bindings, kept)
                self.fused.forget(bindings)  # never merged: its stacked factors would only hold memory
            self._decisions.put(signature, decided)
        return decided

    def _refuse_above_slots(self, bindings: Bindings, kept: float) -> None:
        """A request the merge would cut that the slots cannot hold either: refused by name."""
        unheld = {slot: b for slot, b in bindings.items() if b is not None and b.adapter.biased}
        if unheld and not self.slots.ceiling.biases:
            names = ", ".join(f"{slot}={b.adapter.name} (scale {b.scale:g})" for slot, b in sorted(unheld.items()))
            raise AdapterRejected(names, [
                f"its LoRA biases are held by no {self.slots.ceiling.family} slot, and merged into the weights it "
                f"would keep {kept:.1%} of its weight delta (fused_min_kept {self._min_kept:.0%}): auto mode serves "
                "it neither way. Serve it with adapter_mode=fused and a lower fused_min_kept"])
        target = self.slots.ceiling.target_rank
        above = {slot: b for slot, b in bindings.items() if b is not None and b.adapter.rank > target}
        if above:
            names = ", ".join(f"{slot}={b.adapter.name} (scale {b.scale:g})" for slot, b in sorted(above.items()))
            rank = max(b.adapter.rank for b in above.values())
            raise AdapterRejected(names, [
                f"rank {rank} exceeds the slots' target rank {target}, and merged into the weights it would keep "
                f"{kept:.1%} of its weight delta (fused_min_kept {self._min_kept:.0%}): auto mode serves it neither "
                "way. Serve it with adapter_mode=fused and a lower fused_min_kept (accepting the loss), or slots "
                "of a larger target_rank"])

    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        """Before a chunk: one adapter set for the whole batch, on the path chosen for it. The
        other path is emptied first (slots zeroed, or the weights restored to ``W0``)."""
        if len({bindings_key(s) for s in samples}) > 1:
            raise InvalidRequest("auto mode holds one request's adapters at a time (fused into the weights or in "
                                 "the slots); a forward batch cannot carry different adapters")
        bindings = samples[0] if samples else {}
        mode, kept = self._decide(bindings)
        if mode == FUSED:
            emptied, report = self.slots.swap({}), self.fused.swap(bindings)
        else:
            emptied, report = self.fused.swap({}), self.slots.swap(bindings)
        report.ms += emptied.ms
        report.bytes_copied += emptied.bytes_copied
        report.modules_zeroed += emptied.modules_zeroed
        report.rank_bucket = self.slots.bucket
        # Each served slot says its path; ``kept`` is what the merge keeps (fused) or would have
        # kept (slots: why the request is not fused). ``Engine`` reports both per slot.
        report.fused = {slot: {**report.fused.get(slot, {}), "mode": mode, "kept": round(kept, 6)}
                        for slot, binding in bindings.items() if binding is not None}
        if bindings_key(bindings):
            self.batches[mode] += 1
        return report

    def warmup_states(self) -> tuple:
        """The slots' rank buckets: a fused request runs the smallest (its slots are empty)."""
        return self.slots.warmup_states()

    def enter(self, state) -> None:
        self.fused.enter("fused")  # refuses inductor freezing: fused writes must stay graph inputs
        self.slots.enter(state)

    def check_intact(self) -> None:
        self.fused.check_intact()
        self.slots.check_intact()

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + self.fused.nbytes

    def describe(self) -> dict:
        fused, slots = self.fused.describe(), self.slots.describe()
        return {"writer": "auto", "slot_bytes": self.nbytes, "rank_buckets": slots["rank_buckets"],
                "restore": fused["restore"], "pristine_bytes": fused["pristine_bytes"],
                "one_adapter_set_per_batch": True, "fused_min_kept": self.min_kept,
                "batches": dict(self.batches), "merged": fused["merged"], "occupants": slots["occupants"]}


__all__ = ["AutoWriter"]
