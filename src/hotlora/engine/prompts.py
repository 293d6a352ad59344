"""A mixed forward batch's prompt arguments: one entry per image, encoded group by group when the
requests need different text-encoder states.

Apart from ``core`` so the engine keeps to preparing and running; the text side is reached only
through the ``TextWriter`` protocol (``apply``, ``prompts``, ``signature``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hotlora.adapters.families import Family


def batch_prompts(text, pipeline, family: Family, requests: Sequence, cfg: bool, swap) -> dict:
    """The prompt arguments of one mixed forward batch (``requests``: PreparedRequests), one entry
    per image; ``swap.text_ms`` grows by the text writer's applies. Requests whose text encoders must
    hold the same (no text parts, or the same ones) are encoded by the pipeline itself; requests
    needing different text-encoder states (two users' embeddings under the same token names,
    different text-encoder LoRA) are encoded group by group here, each with its own state applied,
    and the pipeline is given the embeddings.

    Under CFG, requests with and without a negative prompt are encoded apart too: SDXL's
    ``encode_prompt`` makes zeros for a missing negative prompt (``force_zeros_for_empty_prompt``)
    but encodes a given one, even "", and one call cannot do both for a list of prompts. Each
    group is encoded exactly as it would be alone, and the batch still denoises together (an
    extra text-encoder pass per group, rather than a ``batch_key`` that would split the batch)."""
    groups: dict[tuple, list[int]] = {}
    for i, request in enumerate(requests):
        key = (text.signature(request.adapters), cfg and request.negative_prompt is None)
        groups.setdefault(key, []).append(i)
    texts = [text.prompts(r.adapters, r.prompt, r.negative_prompt) for r in requests]
    owners = [i for i, r in enumerate(requests) for _ in range(r.num_images)]  # image -> its request
    if len(groups) == 1:
        swap.text_ms += text.apply(requests[0].adapters)
        return columns([texts[i] for i in owners])
    parts: dict[int, dict] = {}
    for members in groups.values():
        swap.text_ms += text.apply(requests[members[0]].adapters)
        images = [image for image, owner in enumerate(owners) if owner in members]
        encoded = encode_prompts(pipeline, family, columns([texts[owners[i]] for i in images]), cfg)
        for row, image in enumerate(images):
            parts[image] = {name: tensor[row:row + 1] for name, tensor in encoded.items()}
    return {name: torch.cat([parts[i][name] for i in range(len(owners))]) for name in parts[0]}


def columns(rows: list[dict]) -> dict:
    """Per-image prompt arguments -> per-argument lists. An argument a row lacks takes what the
    pipeline would derive: ``prompt_2`` is ``prompt``, ``negative_prompt_2`` the negative prompt.
    A missing negative prompt beside given ones becomes "" (one list per argument): only without
    CFG, where no negative is encoded; under CFG ``batch_prompts`` never mixes the two kinds, as
    a missing one is zeros on SDXL, not ""."""
    names = {name for row in rows for name in row}
    defaults = {"prompt_2": lambda row: row["prompt"], "negative_prompt_2": lambda row: row.get("negative_prompt")}
    return {name: [row.get(name) or (defaults[name](row) if name in defaults else None) or "" for row in rows]
            for name in sorted(names)}


def encode_prompts(pipeline, family: Family, kwargs: Mapping[str, list], cfg: bool) -> dict:
    """The pipeline's own ``encode_prompt`` on one group of prompts (one text state): the embedding
    arguments its ``__call__`` takes instead of prompts."""
    device = pipeline.device
    if family.name == "flux":
        embeds, pooled, _ = pipeline.encode_prompt(prompt=kwargs["prompt"], prompt_2=kwargs.get("prompt_2"),
                                                   device=device, num_images_per_prompt=1)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    embeds, negative, pooled, negative_pooled = pipeline.encode_prompt(
        prompt=kwargs["prompt"], prompt_2=kwargs.get("prompt_2"), device=device, num_images_per_prompt=1,
        do_classifier_free_guidance=cfg, negative_prompt=kwargs.get("negative_prompt"),
        negative_prompt_2=kwargs.get("negative_prompt_2"))
    out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    if cfg:
        out.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
    return out
