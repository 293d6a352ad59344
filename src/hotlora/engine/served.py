"""What a response reports about each slot's adapter (``GenerationResult.adapters``)."""

from __future__ import annotations

from typing import Mapping

from hotlora.engine import guard
from hotlora.engine.request import Resolved


def served_adapters(resolved: Resolved, text_encoders=(), fused: Mapping[str, dict] | None = None,
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
            for slot, (a, scale) in resolved.items()}
