"""Adapter writers: what puts a request's adapters into the model, behind one interface.

Four: ``slots`` (one PEFT adapter whose rows are the slots, one request's adapters at a time,
packed for one-copy swaps), ``banks`` (per-sample bank entries: several requests in one
forward batch), ``fused`` (no LoRA layers: the adapters merged into the weights in place,
restored from a pristine copy) and ``auto`` (slots and fused together: each request fused when
its merge keeps its effect, else through the slots). Each is a writer, not a branch in the engine: the engine holds
one writer and only ever calls what ``AdapterWriter`` declares.

Writers take ``{slot: Binding}`` made by ``Engine.prepare`` from specs ``Engine.check`` checked
(slots included): they trust them and check nothing of the request again. "The same as last time"
is ``Binding.key`` (``assignment_key`` for a whole assignment) in every writer.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Protocol, Sequence

from hotlora.adapters.binding import Binding, Bindings
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.format.validate import SlotCeiling
from hotlora.settings import EngineConfig
from hotlora.engine.writers.slots import SwapReport

Assignment = Bindings  # slot -> Binding (None or absent: empty); ``Binding.key`` says what changed

log = logging.getLogger(__name__)


class AdapterWriter(Protocol):
    slot_names: tuple[str, ...]
    ceiling: SlotCeiling  # what adapters must fit: modules, shapes, rank (checked before prepare)
    mixes_requests: bool  # whether one bind may carry several requests' different adapters

    def prepare(self, resolved: Mapping[str, Binding]) -> None:
        """On the request's thread, after validation: any per-adapter work the swap should not pay
        (a layout copy). Never mutates the adapters."""

    def bind(self, samples: Sequence[Assignment], repeat: int = 1) -> SwapReport:
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
    protocol, not an ``AdapterWriter``: it binds once per request (not per chunk), and besides
    weights it rewrites the request's prompts. The engine calls it only through these, one
    method per phase."""

    lora_encoders: tuple[str, ...]  # text encoders whose LoRA is applied; others' is skipped

    def problems(self, adapter: Adapter) -> list[str]:
        """Validation, with the rest of the adapter: what of its text parts cannot be served."""

    def prepare(self, resolved: Mapping[str, Binding], *texts: str | None) -> None:
        """On the request's thread: InvalidRequest for token names or prompts it cannot serve,
        then any per-request planning the bind should not pay."""

    def signature(self, resolved: Mapping[str, Binding]) -> tuple:
        """What the text encoders hold for ``resolved``: equal signatures encode prompts alike."""

    def bind(self, resolved: Mapping[str, Binding]) -> float:
        """On the serving thread, before prompts are encoded: the state ``resolved`` needs.
        Milliseconds spent (0 when it was already held)."""

    def prompts(self, resolved: Mapping[str, Binding], prompt: str, negative: str | None = None) -> dict:
        """The pipeline's prompt arguments for this request (its trainer tokens mapped)."""

    def check_intact(self) -> None:
        """SlotStateCorrupt if what the encoders read is no longer this writer's."""

    def describe(self) -> dict:
        """For /readyz: merged LoRA and reserved rows per text encoder."""

    @property
    def nbytes(self) -> int:
        """Memory the writer holds on the device."""


def install_text_writer(config: EngineConfig, pipeline, family, slot_names) -> TextWriter:
    """The text encoders' writer (LoRA unfused, embeddings in reserved rows), before any compile."""
    from hotlora.engine.writers.text import TextEncoders

    return TextEncoders(pipeline, family, slot_names, lora=config.text_encoder_lora, rows=config.embedding_rows)


def install_writer(config: EngineConfig, denoiser, family: str, served_models: Iterable[str]) -> AdapterWriter:
    """The writer ``config`` asks for, installed into ``denoiser`` (before compile)."""
    if config.adapter_mode == "fused":
        from hotlora.engine.writers.fused import FusedWriter

        if config.target_modules is not None:
            # Said once at start-up: someone narrowing the ceiling expects adapters outside it refused.
            log.warning("fused mode ignores target_modules=%r: adapters may touch any Linear (and Conv2d on "
                        "SDXL), and the pristine copy covers all of them", config.target_modules)

        return FusedWriter(denoiser, family, config.slots, config.target_rank, served_models,
                           restore=config.fused_restore, min_kept=config.fused_min_kept)
    if config.adapter_mode == "auto":
        from hotlora.engine.writers.auto import AutoWriter

        return AutoWriter(denoiser, family, config.slots, config.target_rank, config.target_modules, served_models,
                          min_kept=config.fused_min_kept, restore=config.fused_restore,
                          rank_buckets=config.bucket_ranks)
    if config.mixed:
        from hotlora.engine.writers.banks import AdapterBank

        return AdapterBank(denoiser, family, config.slots, config.target_rank, config.target_modules, served_models,
                           entries=config.bank_entries or 2 * config.batch_limit + 1, max_batch=2 * config.batch_limit)
    from hotlora.engine.writers.slots import SlotBank

    return SlotBank(denoiser, family, config.slots, config.target_rank, config.target_modules,
                    served_models=served_models, rank_buckets=config.bucket_ranks)


__all__ = ["AdapterWriter", "Assignment", "SwapReport", "TextWriter", "install_text_writer", "install_writer"]
