"""Mixed-adapter batches: every sample of one compiled forward pass may carry its own adapters.

Each ceiling Linear (and 1x1 conv: a family's ``pointwise_convs``) is replaced by a ``BankedLinear``
holding *banks* of rank-padded adapters (``down [E, R, in]``, ``up [E, out, R]``; entry 0 stays zero). A shared ``BankSelector`` buffer
holds, per adapter kind (identity, style, ...), one entry index per sample; the layer gathers
each sample's matrices and adds ``up[i] @ down[i] @ x`` per kind, and with LoRA biases (a family's
``lora_biases``: lightx2v's ``.diff_b`` on Wan) each sample's bias row ``bias[i]`` too. The index is a *tensor* that is
written in place, so any assignment of adapters to batch positions runs the same graph.

Some Linears see the samples on their second axis ([tokens, batch, ...]: ERNIE-Image's MLPs; a
family's ``sequence_first_linears``): those index it there. A few denoisers feed some Linears every
sample's tokens packed into one sequence with no batch axis (Z-Image's embedders: a family's ``packed_linears``). A hook on the denoiser records each
call's per-sample token counts (the family's ``packed_segments``) in the selector, and those layers
add each sample's adapters over its own run of tokens. Such layers sit outside the compiled blocks
(regional compilation), so their per-call Python counts cost no recompile.

Written here by hand because no library offers it: PEFT's per-sample ``adapter_names`` is a list
guarded by value under torch.compile (every new list recompiles), and it cannot fold a different
scale per sample. The LoRA math is the same as PEFT's: ``base(x) + scale * B @ A @ x``.
"""

from __future__ import annotations

import re
import time
from typing import Iterable, Sequence

import torch
from torch import nn

from hotlora.adapters.binding import Binding, Bindings
from hotlora.adapters.format.validate import SlotCeiling
from hotlora.engine.device import synchronize
from hotlora.engine.writers.base import SwapReport, ceiling_modules, split_pointwise
from hotlora.engine.writers.slots import _Slot, write_biases, write_padded
from hotlora.errors import InvalidRequest, SlotStateCorrupt
from hotlora.lru import LRU


class BankSelector(nn.Module):
    """Per kind, per sample: which bank entry applies. Shared by every BankedLinear. ``segments``:
    per packed-layer prefix, the current call's token count of each sample (set by the hook)."""

    def __init__(self, kinds: int, max_batch: int):
        super().__init__()
        self.register_buffer("index", torch.zeros(kinds, max_batch, dtype=torch.long), persistent=False)
        self.segments: dict[str, list[int]] = {}


class BankedLinear(nn.Module):
    """A ceiling layer with its banks: a Linear, or a 1x1 conv (``channels_first``: a Linear over the
    channels of its [batch, channels, h, w] input)."""

    def __init__(self, base: nn.Linear | nn.Conv2d, entries: int, rank: int, selector: BankSelector,
                 biases: bool = False, packed: str | None = None, sequence_first: bool = False):
        super().__init__()
        self.base = base
        self.packed = packed  # the packed-layer prefix whose segments split this layer's input, or None
        self.sequence_first = sequence_first  # its input is [tokens, batch, ...] (ERNIE-Image's MLPs)
        self.channels_first = isinstance(base, nn.Conv2d)
        self.in_features, self.out_features = (
            (base.in_channels, base.out_channels) if self.channels_first else (base.in_features, base.out_features))
        kwargs = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.register_buffer("down", torch.zeros(entries, rank, self.in_features, **kwargs), persistent=False)
        self.register_buffer("up", torch.zeros(entries, self.out_features, rank, **kwargs), persistent=False)
        # Each entry's LoRA bias ([entries, out], scaled like up), or None where the family holds none.
        self.register_buffer("lora_bias", torch.zeros(entries, self.out_features, **kwargs) if biases else None,
                             persistent=False)
        self.selector = selector

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's: denoisers read a Linear's ``weight.dtype`` (Z-Image's timestep embedder)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.packed is not None:
            return y + self._packed_delta(x)
        if self.sequence_first:  # [tokens, batch, ...]: the samples are the second axis
            return self._add_adapters(y.transpose(0, 1), x.transpose(0, 1)).transpose(0, 1)
        if self.channels_first:  # [batch, channels, h, w]: the features are the second axis
            return self._add_adapters(y.movedim(1, -1), x.movedim(1, -1)).movedim(-1, 1)
        return self._add_adapters(y, x)

    def _add_adapters(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` plus each sample's adapters of every kind (``x``: [batch, ..., in])."""
        index = self.selector.index[:, : x.shape[0]]
        for kind in range(index.shape[0]):
            chosen = index[kind]
            hidden = torch.einsum("b...i,bri->b...r", x, self.down[chosen])
            y = y + torch.einsum("b...r,bor->b...o", hidden, self.up[chosen])
            if self.lora_bias is not None:  # [b, out] broadcast over the sample's tokens
                y = y + self.lora_bias[chosen].view(x.shape[0], *([1] * (y.ndim - 2)), -1)
        return y

    def _packed_delta(self, x: torch.Tensor) -> torch.Tensor:
        """Every sample's adapters over its own run of the packed tokens (``x``: [tokens, ..., in])."""
        segments = self.selector.segments.get(self.packed)
        if segments is None or sum(segments) != x.shape[0]:
            raise SlotStateCorrupt(f"packed layer {self.packed!r} got {x.shape[0]} tokens; the denoiser call's "
                                   f"samples hold {segments}")
        index = self.selector.index[:, : len(segments)]
        deltas = []
        for sample, tokens in enumerate(x.split(segments)):
            chosen = index[:, sample]  # one entry per kind
            hidden = torch.einsum("t...i,kri->kt...r", tokens, self.down[chosen])
            delta = torch.einsum("kt...r,kor->t...o", hidden, self.up[chosen])
            if self.lora_bias is not None:
                delta = delta + self.lora_bias[chosen].sum(dim=0)
            deltas.append(delta)
        return torch.cat(deltas)


class BanksWriter:
    """The banks of one denoiser, their entries' occupants, and the per-sample selection (the
    ``banks`` adapter writer: several requests' adapters in one forward batch)."""

    mixes_requests = True

    def __init__(self, denoiser: nn.Module, family: str, slot_names: Iterable[str], target_rank: int,
                 target_modules=None, served_models: Iterable[str] = (), *, entries: int, max_batch: int,
                 biases: bool = False, packed_linears: Sequence[str] = (), packed_segments=None,
                 shared_rows: Sequence[str] = (), sequence_first: str = "", pointwise: str = ""):
        """``packed_linears`` and ``packed_segments``: the family's (``ModelFamily``), for denoisers
        that pack samples into one sequence before some Linears; ``shared_rows``: its layers left
        out (``ModelFamily.mixed_batch_shared_rows``); ``sequence_first``: a pattern of the layers
        whose input is sequence-first (``ModelFamily.sequence_first_linears``); ``pointwise``: the 1x1
        convs held beside the Linears (``ModelFamily.pointwise_convs``)."""
        self.slot_names = tuple(slot_names)
        if entries < 2:
            raise ValueError("a bank needs at least 2 entries (entry 0 is the empty adapter)")
        modules = ceiling_modules(denoiser, target_modules, pointwise)
        unbatched = frozenset(name for name in modules if name.startswith(tuple(shared_rows)))
        modules = {name: shape for name, shape in modules.items() if name not in unbatched}
        linears, convs = split_pointwise(denoiser, modules)
        self.ceiling = SlotCeiling(modules=linears, target_rank=target_rank, family=family,
                                   served_models=frozenset(n for n in served_models if n), biases=biases,
                                   unbatched=unbatched, pointwise=convs)
        self.device = device = next(denoiser.parameters()).device
        self.selector = BankSelector(len(self.slot_names), max_batch).to(device)
        self.max_batch = max_batch
        layers: dict[str, BankedLinear] = {}
        for name in modules:
            parent_name, _, child = name.rpartition(".")
            parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
            packed = next((prefix for prefix in packed_linears if name.startswith(prefix)), None)
            layers[name] = BankedLinear(getattr(parent, child), entries, target_rank, self.selector, biases, packed,
                                        bool(sequence_first) and re.fullmatch(sequence_first, name) is not None)
            setattr(parent, child, layers[name])
        if packed_linears:
            selector = self.selector

            def record_segments(module, args, kwargs):
                selector.segments = packed_segments(args, kwargs)

            denoiser.register_forward_pre_hook(record_segments, with_kwargs=True)
        self._layers = layers
        self._entries = [
            _Slot(f"entry-{e}", {m: l.down[e] for m, l in layers.items()}, {m: l.up[e] for m, l in layers.items()},
                  dict.fromkeys(layers, 0), bias={m: l.lora_bias[e] for m, l in layers.items()} if biases else None)
            for e in range(entries)
        ]
        # Resident (sha256, scale) -> entry, in least-recently-used order; entry 0 is never given out.
        self._resident: LRU[tuple[str, float], int] = LRU()  # bounded by the bank: entries recycled below
        self._layout = self._fingerprint()

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(l.down.nbytes + l.up.nbytes + (l.lora_bias.nbytes if l.lora_bias is not None else 0)
                   for l in self._layers.values())

    def _fingerprint(self):
        return [(l.down.data_ptr(), l.up.data_ptr(), tuple(l.down.shape),
                 None if l.lora_bias is None else l.lora_bias.data_ptr()) for l in self._layers.values()]

    def check_intact(self) -> None:
        if self._fingerprint() != self._layout:
            raise SlotStateCorrupt("bank tensors were replaced or reshaped outside the banks writer")

    # ------------------------------------------------------------------ the writer interface

    def prepare(self, bindings: Bindings) -> None:
        """Nothing to lay out: bank entries are written module by module."""

    def warmup_states(self) -> tuple[str, ...]:
        return ("banks",)  # one graph serves any assignment of entries

    def enter(self, state: str) -> None:
        pass

    def describe(self) -> dict:
        return {"writer": "banks", "slot_bytes": self.nbytes, "entries": self.entries, "resident": len(self._resident)}

    @torch.no_grad()
    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        """Make every sample's adapters resident and point the selector at them.

        ``samples`` lists each real sample's ``{slot: (adapter, scale)}``; ``repeat`` tiles the
        selection for pipelines that run a doubled batch (classifier-free guidance).
        """
        start = time.perf_counter()
        report = SwapReport()
        if len(samples) * repeat > self.max_batch:  # before anything is written
            raise InvalidRequest(f"batch of {len(samples) * repeat} exceeds the bank's {self.max_batch}")
        wanted: dict[tuple, Binding] = {}  # Binding.key -> binding: one entry per distinct binding
        for sample in samples:
            for slot, assigned in sample.items():
                if assigned is not None and assigned.writes:
                    wanted[assigned.key] = assigned
        if len(wanted) > self.entries - 1:
            raise InvalidRequest(f"{len(wanted)} distinct adapters in one batch; the bank holds {self.entries - 1}")
        for key in wanted:
            self._resident.get(key)  # now among the most recently used
        taken = set(self._resident.values())
        free = [e for e in range(1, self.entries) if e not in taken]
        for key, binding in wanted.items():
            if key in self._resident:
                continue
            if free:
                entry = free.pop()
            else:  # recycle the least recently used entry this batch does not need
                _, entry = self._resident.pop_oldest(exclude=wanted)
            write_padded(self._entries[entry], binding.adapter, float(binding.scale), report)
            write_biases(self._entries[entry], binding.adapter, float(binding.scale))
            self._resident.put(key, entry)
        index = torch.zeros(len(self.slot_names), len(samples), dtype=torch.long)
        for position, sample in enumerate(samples):
            for kind, slot in enumerate(self.slot_names):
                assigned = sample.get(slot)
                if assigned is not None and assigned.writes:
                    index[kind, position] = self._resident.get(assigned.key)
        index = index.repeat(1, repeat)
        self.selector.index.zero_()
        self.selector.index[:, : index.shape[1]].copy_(index)
        for sample in samples:
            for slot, assigned in sample.items():
                report.adapters[slot] = assigned[0].sha256 if assigned else None
        synchronize(self.device)  # host-to-device copies are asynchronous
        report.ms = (time.perf_counter() - start) * 1000
        return report
