"""Slots on every expert of a mixture-of-experts denoiser (Wan 2.2 A14B: ``transformer`` for the
high-noise steps, ``transformer_2`` below ``boundary_ratio``): one writer per expert behind the one
``AdapterWriter`` the engine holds.

An adapter names the second expert's modules ``transformer_2.<module>`` (``format.convert`` reads
them so), the first expert's as for any denoiser. Each expert's writer gets the adapter's share of
its own modules (a view of the adapter; none for an adapter without that expert's keys, whose slot
is then emptied for the request, as diffusers runs that expert without the adapter). Every expert's
slots are written before a chunk runs, so whichever expert a step calls reads the request's LoRA.

Written here: diffusers loads each expert's LoRA with its own ``load_lora_weights`` call
(``load_into_transformer_2=True``); nothing in diffusers or PEFT hot-swaps into two models at once.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from hotlora.adapters.binding import Binding, Bindings
from hotlora.adapters.format.convert import Adapter
from hotlora.engine.writers.base import AdapterWriter, SwapReport


class ExpertsWriter:
    """``experts``: pipeline attribute -> that expert's writer, the denoiser's first (its modules keep
    their names; another expert's are prefixed with its attribute)."""

    def __init__(self, experts: Mapping[str, AdapterWriter]):
        names = list(experts)
        self.writers = {("" if name == names[0] else f"{name}."): writer for name, writer in experts.items()}
        self.names = {prefix: name for prefix, name in zip(self.writers, names)}
        first = self.writers[""]
        self.slot_names = first.slot_names
        self.mixes_requests = first.mixes_requests
        # One ceiling over every expert, as adapters name their modules: validation sees them all.
        self.ceiling = dataclasses.replace(first.ceiling, modules={
            f"{prefix}{module}": shape for prefix, writer in self.writers.items()
            for module, shape in writer.ceiling.modules.items()})

    def _view(self, prefix: str, adapter: Adapter) -> Adapter:
        """``adapter`` with only the modules under ``prefix`` (their names without it). Made anew each
        time, not memoized: a memo would keep adapters alive after the store let them go; the expert's
        writer finds its packs and occupants by the view's ``key``, equal for equal content."""
        if prefix:
            modules = {m[len(prefix):]: w for m, w in adapter.modules.items() if m.startswith(prefix)}
        else:  # the first expert: every module not under another expert's prefix
            others = tuple(p for p in self.writers if p)
            modules = {m: w for m, w in adapter.modules.items() if not m.startswith(others)}
        return dataclasses.replace(adapter, modules=modules)

    def _bindings(self, prefix: str, bindings: Bindings) -> dict:
        return {slot: None if b is None else Binding(self._view(prefix, b.adapter), b.scale)
                for slot, b in bindings.items()}

    def prepare(self, bindings: Bindings) -> None:
        for prefix, writer in self.writers.items():
            writer.prepare(self._bindings(prefix, bindings))

    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        report = None
        for prefix, writer in self.writers.items():
            part = writer.bind([self._bindings(prefix, s) for s in samples], repeat)
            if report is None:
                report = part
            else:
                report.ms += part.ms
                for name in ("bytes_copied", "modules_written", "modules_zeroed", "packed_writes", "per_module_writes"):
                    setattr(report, name, getattr(report, name) + getattr(part, name))
                report.rank_bucket = max(report.rank_bucket, part.rank_bucket)
        return report

    def warmup_states(self) -> tuple:
        return self.writers[""].warmup_states()  # every expert's writer is built alike: the same states

    def enter(self, state) -> None:
        for writer in self.writers.values():
            writer.enter(state)

    def check_intact(self) -> None:
        for writer in self.writers.values():
            writer.check_intact()

    def describe(self) -> dict:
        described = self.writers[""].describe()
        return {**described, "slot_bytes": self.nbytes,
                "experts": {self.names[prefix]: w.describe() for prefix, w in self.writers.items()}}

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writers.values())

    @property
    def pack_cache_bytes(self) -> int:
        return sum(getattr(w, "pack_cache_bytes", 0) for w in self.writers.values())


__all__ = ["ExpertsWriter"]
