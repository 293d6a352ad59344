"""What a run gives back: ``GenerationResult``, one per request, with its images finished for the
output type asked and what each slot's adapter was served as."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from hotlora.engine import guard
from hotlora.engine.request import Bindings, Timings
from hotlora.engine.writers import SwapReport


@dataclass(kw_only=True)
class GenerationResult:
    images: Any  # list[PIL.Image] for "pil", else one array/tensor with the pack on dim 0
    seeds: list[int]
    timings: Timings
    swap: SwapReport
    adapters: dict[str, dict | None] = field(default_factory=dict)  # slot -> what was served
    recompiles: int = 0
    size: str = ""  # the size served, WIDTHxHEIGHT
    snapped_from: str | None = None  # the size asked for when the policy snapped it to ``size``


def served_adapters(bindings: Bindings, text_encoders=(), fused: Mapping[str, dict] | None = None,
                    path: str = "slots") -> dict:
    """What a response reports about each slot's adapter: ``mode``, the path that served it
    (``fused``: merged into the weights; ``slots``: unfused LoRA branches, slots or banks; auto
    mode's writer says which per request, else the engine's ``path``); in fused and auto mode also
    ``fused_kept``, the fraction of the request's weight delta the merge carries (``FusedWriter._kept``;
    auto mode, served through the slots: what it would have carried, the reason it was not fused)."""
    fused = fused or {}
    return {slot: {"sha256": a.sha256, "layout": a.layout, "rank": a.rank, "scale": scale, "name": a.name,
                   "text_encoders": sorted(te for te in a.text_modules if te in text_encoders),
                   "embedding_tokens": list(a.embeddings.tokens) if a.embeddings is not None else [],
                   "skipped": guard.skipped(a, text_encoders), "mode": fused.get(slot, {}).get("mode", path),
                   **({"fused_kept": fused[slot]["kept"]} if "kept" in fused.get(slot, {}) else {})}
            for slot, (a, scale) in bindings.items()}


def finish_images(pipeline, images, output_type: str):
    """Encode PIL (finiteness was checked inside the engine section)."""
    if output_type == "pil":
        images = pipeline.image_processor.numpy_to_pil(pipeline.image_processor.pt_to_numpy(images))
    return images
