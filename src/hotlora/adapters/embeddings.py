"""Pivotal-tuning embeddings: the token vectors a LoRA was trained with, read and checked.

diffusers' advanced training scripts (``train_dreambooth_lora_{sdxl,flux}_advanced.py``) save the
learned vectors of their new tokens ``<s0>``, ``<s1>``, ... beside the LoRA as
``<name>_emb.safetensors``, one tensor per text encoder (SDXL: ``clip_l`` [n, 768] and ``clip_g``
[n, 1280]; Flux: ``clip_l`` and, with ``--enable_t5_ti``, ``t5``). The Hugging Face inference API
reads ``embeddings.safetensors`` from a LoRA repo (also under its older names ``text_encoders_0``
/ ``text_encoders_1``) and maps row i to token ``<s{i}>``. hotlora does the same unless the
request or catalog entry names the tokens.

Knows nothing of the engine: the engine checks the tokens against its tokenizers and the vector
widths against its text encoders.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from hotlora.families import ModelFamily
from hotlora.errors import AdapterFormatError

EMBEDDINGS_FILE = "embeddings.safetensors"  # the Hugging Face inference API's name
EMBEDDINGS_SUFFIX = "_emb.safetensors"  # diffusers' advanced training scripts: <output dir name>_emb.safetensors
MAX_TOKENS = 64  # trainers use 2 to 8; the engine reserves fewer rows per slot still
TOKEN = re.compile(r"\S{1,64}")  # a token a prompt can carry: no whitespace (the tokenizers split on it)


@dataclass(frozen=True)
class Embeddings:
    """The vectors of ``tokens``, per text encoder (pipeline attribute): row i is token i."""

    tokens: tuple[str, ...]
    vectors: Mapping[str, torch.Tensor]  # text encoder -> [len(tokens), hidden size]
    sha256: str

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.vectors.values())

    def named(self, tokens: Sequence[str] | None) -> "Embeddings":
        """The same vectors under other token names (a request's or catalog entry's ``tokens``)."""
        if tokens is None or tuple(tokens) == self.tokens:
            return self
        return Embeddings(checked_tokens(tokens, len(self.tokens), "embeddings"), self.vectors, self.sha256)


def is_embeddings_file(name: str) -> bool:
    return name == EMBEDDINGS_FILE or name.endswith(EMBEDDINGS_SUFFIX)


def embeddings_file_in(directory: Path, label: str) -> Path | None:
    """The embeddings beside a LoRA in ``directory``: ``embeddings.safetensors``, else the one
    ``*_emb.safetensors``; None when there is none."""
    if (directory / EMBEDDINGS_FILE).is_file():
        return directory / EMBEDDINGS_FILE
    found = sorted(p for p in directory.glob(f"*{EMBEDDINGS_SUFFIX}") if p.is_file())
    if len(found) > 1:
        raise AdapterFormatError(f"{label}: several embedding files ({', '.join(p.name for p in found[:4])}); "
                                 f"keep one, or name it {EMBEDDINGS_FILE}")
    return found[0] if found else None


def checked_tokens(tokens, count: int, label: str) -> tuple[str, ...]:
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise AdapterFormatError(f"{label}: tokens must be a list of strings")
    tokens = tuple(tokens)
    bad = [t for t in tokens if not isinstance(t, str) or not TOKEN.fullmatch(t)]
    if bad:
        raise AdapterFormatError(f"{label}: tokens must be 1-64 characters without whitespace, got {bad[0]!r:.80}")
    if len(set(tokens)) != len(tokens):
        raise AdapterFormatError(f"{label}: tokens repeat ({', '.join(tokens[:8])})")
    if len(tokens) != count:
        raise AdapterFormatError(f"{label}: {len(tokens)} token names for {count} embedding rows")
    return tokens


def parse_embeddings(tensors: Mapping[str, torch.Tensor], family: ModelFamily, label: str,
                     tokens: Sequence[str] | None = None) -> Embeddings:
    """An embeddings file's tensors (``clip_l``, ``clip_g``, ``t5``, ...) for ``family``."""
    targets = dict(family.embedding_keys)
    unknown = sorted(k for k in tensors if k not in targets)
    if unknown:
        raise AdapterFormatError(f"{label}: embedding keys {', '.join(unknown[:8])} name no text encoder of the "
                                 f"{family.name} family (known: {', '.join(targets)})")
    vectors: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        encoder = targets[key]
        if encoder in vectors:
            raise AdapterFormatError(f"{label}: two embedding keys for the same text encoder ({encoder})")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or not tensor.is_floating_point():
            raise AdapterFormatError(f"{label}: embedding {key} must be a 2-D floating tensor [tokens, width]")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterFormatError(f"{label}: embedding {key} holds NaN or infinite values")
        vectors[encoder] = tensor
    if not vectors:
        raise AdapterFormatError(f"{label}: the embeddings file holds no vectors")
    rows = {v.shape[0] for v in vectors.values()}
    if len(rows) != 1 or not 1 <= next(iter(rows)) <= MAX_TOKENS:
        raise AdapterFormatError(f"{label}: embeddings must have the same number of rows (1..{MAX_TOKENS}) for every "
                                 f"text encoder, got {sorted(rows)}")
    count = next(iter(rows))
    names = checked_tokens(tokens, count, label) if tokens is not None else tuple(f"<s{i}>" for i in range(count))
    digest = hashlib.sha256()
    for encoder in sorted(vectors):
        digest.update(f"{encoder}|{vectors[encoder].dtype}|{tuple(vectors[encoder].shape)}".encode())
        digest.update(vectors[encoder].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return Embeddings(names, vectors, digest.hexdigest())
