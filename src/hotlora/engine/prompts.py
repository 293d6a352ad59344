"""A mixed forward batch's prompt arguments: one entry per image, encoded group by group when the
requests need different text-encoder states.

Apart from ``core`` so the engine keeps to preparing and running; the text side is reached only
through the ``TextWriter`` protocol (``apply``, ``prompts``, ``signature``).
"""

from __future__ import annotations

from typing import Sequence


from hotlora.families import ModelFamily


def batch_prompts(text, pipeline, family: ModelFamily, requests: Sequence, cfg: bool, swap) -> dict:
    """The prompt arguments of one mixed forward batch (``requests``: PreparedRequests), one entry
    per image; ``swap.text_ms`` grows by the text writer's applies. Requests whose text encoders must
    hold the same (no text parts, or the same ones) are encoded by the pipeline itself; requests
    needing different text-encoder states (two users' embeddings under the same token names,
    different text-encoder LoRA) are encoded group by group here, each with its own state applied,
    and the pipeline is given the embeddings.

    Under CFG, requests with and without a negative prompt are encoded apart too: a pipeline may
    make zeros for a missing negative prompt (SDXL's ``force_zeros_for_empty_prompt``) but encode
    a given one, even "", and one call cannot do both for a list of prompts. Each
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
        encoded = family.encode_prompts(pipeline, columns([texts[owners[i]] for i in images]), cfg)
        for row, image in enumerate(images):
            parts[image] = {name: tensor[row:row + 1] for name, tensor in encoded.items()}
    return family.join_encoded([parts[i] for i in range(len(owners))])


def columns(rows: list[dict]) -> dict:
    """Per-image prompt arguments -> per-argument lists. An argument a row lacks takes what the
    pipeline would derive: ``prompt_2`` (and SD3's ``prompt_3``) is ``prompt``, ``negative_prompt_2`` the
    negative prompt.
    A missing negative prompt beside given ones becomes "" (one list per argument): only without
    CFG, where no negative is encoded; under CFG ``batch_prompts`` never mixes the two kinds, as
    a missing one may be zeros, not ""."""
    names = {name for row in rows for name in row}

    def default(name: str, row: dict):
        base = name.rstrip("0123456789").removesuffix("_")  # prompt_2, prompt_3 -> prompt
        return row.get(base) if base != name and base in ("prompt", "negative_prompt") else None

    return {name: [row.get(name) or default(name, row) or "" for row in rows] for name in sorted(names)}
