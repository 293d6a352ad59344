"""Adapter writers: what puts a request's adapters into the model, behind one interface
(``base.AdapterWriter``; the text encoders' side behind ``base.TextWriter``).

Four: ``slots`` (one PEFT adapter whose rows are the slots, one request's adapters at a time,
packed for one-copy swaps), ``banks`` (per-sample bank entries: several requests in one
forward batch), ``fused`` (no LoRA layers: the adapters merged into the weights in place,
restored from a pristine copy) and ``auto`` (slots and fused together: each request fused when
its merge keeps its effect, else through the slots). Each is a writer, not a branch in the engine: the engine holds
one writer and only ever calls what ``AdapterWriter`` declares.
"""

from __future__ import annotations

import logging
from typing import Iterable

from hotlora.settings import EngineConfig
from hotlora.engine.writers.base import AdapterWriter, SwapReport, TextWriter

log = logging.getLogger(__name__)


def install_text_writer(config: EngineConfig, pipeline, family, slot_names) -> TextWriter:
    """The text encoders' writer (LoRA unfused, embeddings in reserved rows), before any compile."""
    from hotlora.engine.writers.text import TextEncodersWriter

    return TextEncodersWriter(pipeline, family, slot_names, lora=config.text_encoder_lora, rows=config.embedding_rows)


def expert_writer_problem(config: EngineConfig) -> str | None:
    """What of ``config`` ``install_expert_writers`` does not serve on several experts, or None."""
    if config.adapter_mode != "slots":
        return f"adapter_mode={config.adapter_mode!r}"
    return "mixed batches (mixed=True)" if config.mixed else None


def install_expert_writers(config: EngineConfig, experts, family: str, served_models: Iterable[str]) -> AdapterWriter:
    """The writer for a denoiser of several experts (``experts``: pipeline attribute -> model, the
    denoiser first): the configured writer on each, behind one ``ExpertsWriter``; one expert: its
    writer alone. Slots only: the other writers' pristine copies, banks and auto choices are per
    model, and serving them on two experts is not built (refused at start-up, before anything
    is installed)."""
    if len(experts) == 1:
        return install_writer(config, next(iter(experts.values())), family, served_models)
    problem = expert_writer_problem(config)
    if problem:
        from hotlora.families import UnservedModel

        raise UnservedModel(f"{problem} is not served on a model of several experts ({', '.join(experts)}): "
                            "their slots are (adapter_mode='slots', mixed=False)")
    from hotlora.engine.writers.experts import ExpertsWriter

    return ExpertsWriter({name: install_writer(config, model, family, served_models) for name, model in experts.items()})


def install_writer(config: EngineConfig, denoiser, family: str, served_models: Iterable[str]) -> AdapterWriter:
    """The writer ``config`` asks for, installed into ``denoiser`` (before compile)."""
    from hotlora.families import FAMILIES

    known = FAMILIES.get(family)  # None for a denoiser of no registered family (the tests' toy models)
    biases = known is not None and known.lora_biases  # whether the slots hold LoRA biases
    pointwise = known.pointwise_convs if known is not None else ""  # 1x1 convs held beside the Linears
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
                          rank_buckets=config.bucket_ranks, biases=biases, pointwise=pointwise)
    if config.mixed:
        from hotlora.engine.writers.banks import BanksWriter

        packed = known.packed_linears if known is not None else ()
        return BanksWriter(denoiser, family, config.slots, config.target_rank, config.target_modules, served_models,
                           entries=config.bank_entries or 2 * config.batch_limit + 1, max_batch=2 * config.batch_limit,
                           biases=biases, packed_linears=packed,
                           packed_segments=known.packed_segments if packed else None,
                           shared_rows=known.mixed_batch_shared_rows if known is not None else (),
                           sequence_first=known.sequence_first_linears if known is not None else "",
                           pointwise=pointwise)
    from hotlora.engine.writers.slots import SlotsWriter

    return SlotsWriter(denoiser, family, config.slots, config.target_rank, config.target_modules,
                       served_models=served_models, rank_buckets=config.bucket_ranks, biases=biases,
                       pointwise=pointwise)


__all__ = ["AdapterWriter", "SwapReport", "TextWriter", "install_expert_writers", "install_text_writer", "install_writer"]
