"""An adapter laid out exactly as the engine's slots hold it, so a swap is one copy per matrix.

A slot keeps every ceiling module's ``A`` side by side in one rank-major buffer ``[R, sum(in)]``
and every ``B`` (transposed) in another ``[R, sum(out)]``. An adapter of rank ``r`` packed in the
same layout is then two contiguous blocks, ``[r, sum(in)]`` and ``[r, sum(out)]``, and writing it
into a slot is one ``copy_`` for ``A`` and one scaled copy for ``B`` (its ``alpha / r`` times the
request's weight): the memory-copy limit, with no per-module work on the serving thread.
Per-module copies (hundreds of small launches on a GPU, one per tensor on a CPU) are what kept
swaps far above a plain copy before.

Packing happens on the thread that prepares a request, never on the serving thread, and never
changes the adapter (adapters are immutable once cached, and know nothing of any layout): the
packed copy lives in the writer's ``PackCache``, a side table keyed by the adapter's identity and
bounded in bytes. An adapter covering only a few of the ceiling's modules (or with very uneven
ranks) would pack into mostly zeros; it is left per-module (see ``MAX_PADDING``) and the slot
copies it module by module. So is one whose packing was evicted before its swap: still exact.

Written by hand: no library lays LoRA weights out for in-place serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from hotlora.adapters.format.convert import Adapter
from hotlora.lru import LRU

# A packed adapter may hold at most this much more than its own weights (zero padding for
# modules it does not cover and for ranks below its largest); beyond it, it stays per-module.
# 2.0: an attention-only adapter on the full SDXL U-Net pads to 1.86x (attention is 54% of the
# Linear widths), and at full size its per-module swap took 278 ms against 83 ms for a packed one
# of the same rank on every Linear (the same bytes as its padded pack): copying zeros in two
# contiguous copies beats hundreds of strided per-module writes up to ~3x the bytes. The price is
# the pack cache's memory (up to 2x the adapter's bytes per entry, within the writer's pack_cache_bytes).
MAX_PADDING = 2.0
_UNKNOWN = object()


@dataclass(frozen=True)
class PackLayout:
    """Where each ceiling module sits in a slot's two rank-major buffers."""

    key: tuple  # identifies the layout: the ordered (module, in, out) triples
    down_columns: Mapping[str, tuple[int, int]]  # module -> [start, end) in the A buffer
    up_columns: Mapping[str, tuple[int, int]]  # module -> [start, end) in the B buffer
    down_width: int
    up_width: int

    @classmethod
    def of(cls, modules: Mapping[str, tuple[int, int]]) -> "PackLayout":
        """``modules``: name -> (in_features, out_features), in the order the slots hold them."""
        down, up, a, b = {}, {}, 0, 0
        for name, (in_features, out_features) in modules.items():
            down[name], up[name] = (a, a + in_features), (b, b + out_features)
            a, b = a + in_features, b + out_features
        key = tuple((name, i, o) for name, (i, o) in modules.items())
        return cls(key, down, up, a, b)

    def down_view(self, buffer: torch.Tensor, module: str, rows: int | None = None) -> torch.Tensor:
        """Module's ``A`` ([rows, in]) as a view of a ``[R, down_width]`` buffer."""
        start, end = self.down_columns[module]
        return buffer[:rows, start:end]

    def up_view(self, buffer: torch.Tensor, module: str, rows: int | None = None) -> torch.Tensor:
        """Module's ``B`` ([out, rows]) as a view of a ``[R, up_width]`` buffer."""
        start, end = self.up_columns[module]
        return buffer[:rows, start:end].t()


@dataclass(frozen=True)
class PackedWeights:
    """An adapter in a slot's layout: ``delta W_m = scaling * up_m @ down_m`` for every module."""

    layout_key: tuple
    down: torch.Tensor  # [rows, down_width]
    up: torch.Tensor  # [rows, up_width]; B transposed, per-module scalings folded in when they differ
    scaling: float  # the one scaling left to apply (1.0 when folded in)
    folded: bool  # True when each module's own scaling is already in ``up``

    @property
    def rows(self) -> int:
        return self.down.shape[0]


class PackCache:
    """Packed copies of the adapters requests were prepared with, least recently used out first,
    under a byte budget. Thread-safe: requests' threads put, the serving thread gets."""

    def __init__(self, layout: PackLayout, budget_bytes: int):
        self.layout = layout
        # An adapter that stays per-module is remembered too (as None, at no cost): asked once.
        self._entries: LRU[tuple, PackedWeights | None] = LRU(max_cost=budget_bytes, cost=_nbytes)

    def prepare(self, adapter: Adapter) -> None:
        """Pack ``adapter`` (validated) unless it is packed already or stays per-module."""
        if self._entries.get(adapter.key, _UNKNOWN) is _UNKNOWN:
            self._entries.put(adapter.key, pack(adapter, self.layout))

    def get(self, adapter: Adapter) -> PackedWeights | None:
        return self._entries.get(adapter.key)

    @property
    def bytes(self) -> int:
        return self._entries.total_cost


def _nbytes(packed: PackedWeights | None) -> int:
    return 0 if packed is None else packed.down.nbytes + packed.up.nbytes


def pack(adapter: Adapter, layout: PackLayout) -> PackedWeights | None:
    """A packed copy of ``adapter`` (validated) for ``layout``, or None if it stays per-module.
    The adapter itself is not changed."""
    weights = adapter.modules
    if not weights or any(m not in layout.down_columns for m in weights):
        return None
    dtypes = {w.down.dtype for w in weights.values()} | {w.up.dtype for w in weights.values()}
    if len(dtypes) != 1:
        return None
    rows = adapter.rank
    if rows * (layout.down_width + layout.up_width) > MAX_PADDING * sum(w.down.numel() + w.up.numel()
                                                                         for w in weights.values()):
        return None
    first = next(iter(weights.values())).down
    dtype, pinned = dtypes.pop(), first.is_pinned()
    down = torch.zeros(rows, layout.down_width, dtype=dtype, device=first.device, pin_memory=pinned)
    up = torch.zeros(rows, layout.up_width, dtype=dtype, device=first.device, pin_memory=pinned)
    scalings = {w.scaling for w in weights.values()}
    uniform = len(scalings) == 1
    with torch.no_grad():
        for module, w in weights.items():
            # flatten(1): a 1x1 conv's factors ([r, in, 1, 1], [out, r, 1, 1]) as a Linear's
            layout.down_view(down, module, w.rank).copy_(w.down.flatten(1))
            if uniform:
                layout.up_view(up, module, w.rank).copy_(w.up.flatten(1))
            else:  # fold each module's own alpha/r in now; one scalar is left for the request's weight
                layout.up_view(up, module, w.rank).copy_(w.up.flatten(1).float() * w.scaling)
    return PackedWeights(layout.key, down, up, scalings.pop() if uniform else 1.0, folded=not uniform)


