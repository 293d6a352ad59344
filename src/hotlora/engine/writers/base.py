"""What every adapter writer shares: the two protocols the engine calls, the report of a swap, and
the ceiling's Linear layers.

An ``AdapterWriter`` puts a request's adapters into the denoiser (slots, banks, fused, auto); a
``TextWriter`` applies their text-encoder parts. The engine holds one of each and only ever calls
what these declare. Writers take ``Bindings`` (slot -> ``Binding``) made by ``Engine.prepare``
from specs ``Engine.check`` checked: they trust them and check nothing of the request again.
"The same as last time" is ``Binding.key`` (``bindings_key`` for a whole mapping) in every writer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

import torch

from hotlora.adapters.binding import Bindings
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.format.validate import SlotCeiling

if TYPE_CHECKING:
    from hotlora.engine.writers.text import TextChecks


@dataclass
class SwapReport:
    ms: float = 0.0
    bytes_copied: int = 0
    modules_written: int = 0
    modules_zeroed: int = 0
    packed_writes: int = 0  # slots written with one copy per buffer
    per_module_writes: int = 0  # slots given an adapter module by module (not packed for this layout)
    rank_bucket: int = 0  # the rank the model runs for this request (see SlotsWriter.rank_buckets)
    adapters: dict[str, str | None] = field(default_factory=dict)  # slot -> sha256
    # Fused mode: slot -> {"modules": how many layers its adapter was merged into, "rank": its rank}
    fused: dict[str, dict] = field(default_factory=dict)
    text_ms: float = 0.0  # the text encoders' part: their LoRA applied, embeddings copied (not in ``ms``; Timings.swap_ms has both)

    def add(self, other: "SwapReport") -> None:
        """Fold a later swap of the same request (the next chunk's) into this report."""
        for name in ("ms", "bytes_copied", "modules_written", "modules_zeroed", "packed_writes", "per_module_writes",
                     "text_ms"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rank_bucket, self.adapters = other.rank_bucket, dict(other.adapters)
        self.fused = {**self.fused, **other.fused}


class AdapterWriter(Protocol):
    slot_names: tuple[str, ...]
    ceiling: SlotCeiling  # what adapters must fit: modules, shapes, rank (checked before prepare)
    mixes_requests: bool  # whether one bind may carry several requests' different adapters

    def prepare(self, bindings: Bindings) -> None:
        """On the request's thread, after validation: any per-adapter work the swap should not pay
        (a layout copy). Never mutates the adapters."""

    def bind(self, samples: Sequence[Bindings], repeat: int = 1) -> SwapReport:
        """On the serving thread, before a chunk: sample i runs ``samples[i]`` (``repeat`` tiles the
        batch for classifier-free guidance). InvalidRequest, before writing anything, for what
        this writer cannot hold."""

    def warmup_states(self) -> tuple:
        """Every state steady state may run in (the engine enters and warms up each)."""

    def enter(self, state) -> None:
        """Switch to ``state`` (one of ``warmup_states``) for the warm-up."""

    def check_intact(self) -> None:
        """SlotStateCorrupt if what the model reads is no longer this writer's."""

    def describe(self) -> dict:
        """For /readyz and the logs: the writer's kind, memory (``slot_bytes``) and state."""

    @property
    def nbytes(self) -> int:
        """Memory the writer holds on the device."""


class TextWriter(Protocol):
    """The text encoders' side of a request (engine/writers/text.py): text-encoder LoRA applied,
    pivotal-tuning embeddings in reserved token rows, prompts mapped onto those rows. A second
    protocol, not an ``AdapterWriter``: it applies a request's state once per encoding (not per
    chunk), and besides weights it rewrites the request's prompts. The engine calls it only
    through these, one method per phase."""

    lora_encoders: tuple[str, ...]  # text encoders whose LoRA is applied; others' is skipped
    checks: "TextChecks"  # what ``problems`` and ``prepare``'s checks read, as plain data (it pickles)

    def problems(self, adapter: Adapter) -> list[str]:
        """Validation, with the rest of the adapter: what of its text parts cannot be served."""

    def prepare(self, bindings: Bindings, *texts: str | None) -> None:
        """On the request's thread: InvalidRequest for token names or prompts it cannot serve,
        then ``stage``."""

    def stage(self, bindings: Bindings) -> None:
        """Any per-request planning ``apply`` should not pay (checked already)."""

    def signature(self, bindings: Bindings) -> tuple:
        """What the text encoders hold for ``bindings``: equal signatures encode prompts alike."""

    def apply(self, bindings: Bindings) -> float:
        """On the serving thread, before prompts are encoded: the state ``bindings`` needs.
        Milliseconds spent (0 when it was already held)."""

    def prompts(self, bindings: Bindings, prompt: str, negative: str | None = None) -> dict:
        """The pipeline's prompt arguments for this request (its trainer tokens mapped)."""

    def check_intact(self) -> None:
        """SlotStateCorrupt if what the encoders read is no longer this writer's."""

    def describe(self) -> dict:
        """For /readyz: the LoRA and reserved rows per text encoder."""

    @property
    def nbytes(self) -> int:
        """Memory the writer holds on the device."""


def ceiling_modules(denoiser: torch.nn.Module, target_modules: Iterable[str] | str | None,
                    pointwise: str = "") -> dict[str, tuple[int, int]]:
    """The layers a writer covers, name -> (in, out): every Linear, and the 1x1 convs whose names
    match ``pointwise`` (a family's ``pointwise_convs``: a Linear over the channels); all of them, or
    those ``target_modules`` names (exact names or suffixes, or one regex)."""
    linears = {name: (m.in_features, m.out_features) for name, m in denoiser.named_modules()
               if isinstance(m, torch.nn.Linear)}
    if pointwise:
        pattern = re.compile(pointwise)
        linears.update({name: (m.in_channels, m.out_channels) for name, m in denoiser.named_modules()
                        if is_pointwise_conv(m) and pattern.fullmatch(name)})
    if target_modules is None:
        chosen = list(linears)
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        chosen = [n for n in linears if pattern.fullmatch(n)]
    else:
        wanted = list(target_modules)
        missing = [n for n in wanted if n not in linears and not any(l.endswith("." + n) for l in linears)]
        if missing:
            raise ValueError(f"target modules not found among the denoiser's Linear layers: {', '.join(missing[:8])}")
        chosen = [n for n in linears if n in wanted or any(n.endswith("." + w) for w in wanted)]
    if not chosen:
        raise ValueError("the slot ceiling selects no Linear layer of the denoiser")
    return {n: linears[n] for n in chosen}


def is_pointwise_conv(module: torch.nn.Module) -> bool:
    """A Conv2d that is a Linear over the channels at every pixel: 1x1, stride 1, no padding,
    dilation or groups. A LoRA on it (down conv 1x1 too, as PEFT and kohya make it) is then
    ``B @ A`` over the channels, what a Linear LoRA of the same factors computes."""
    return (isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1) and module.stride == (1, 1)
            and module.padding in ((0, 0), "valid") and module.dilation == (1, 1) and module.groups == 1)


def split_pointwise(denoiser: torch.nn.Module, modules: Mapping[str, tuple[int, int]]):
    """``ceiling_modules``' layers as a ``SlotCeiling`` holds them: (the Linears, the 1x1 convs)."""
    convs = {name for name in modules if isinstance(denoiser.get_submodule(name), torch.nn.Conv2d)}
    return ({n: s for n, s in modules.items() if n not in convs}, {n: s for n, s in modules.items() if n in convs})
