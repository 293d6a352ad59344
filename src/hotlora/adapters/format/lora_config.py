r"""A LoRA's ``LoraConfig``, read without trusting it: each module's rank and ``alpha / r`` scaling
as PEFT would set them, with the config's ``rank_pattern`` / ``alpha_pattern`` matched by plain
string comparison (``Patterns``) instead of the regexes PEFT runs, and its numbers checked.

Written here by hand, because no library does it: PEFT's ``get_pattern_key`` runs each key from
the file as a regex, where ``((\w+)+)+Q`` blocks the process with the GIL held.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from hotlora.errors import AdapterFormatError

# A rank_pattern / alpha_pattern key hotlora matches: a module name or suffix, optionally anchored
# with ``^`` (diffusers writes those, PEFT #2419) and ``$`` (hotlora's export does). No other regex.
PATTERN_KEY = re.compile(r"\^?[A-Za-z0-9_.]+\$?")
MAX_NAME_CHARS = 256
MAX_PATTERN_KEYS = 4096
# Pattern lookups cost modules x keys; far above a full-size SDXL LoRA's ~1000 x ~1000.
MAX_PATTERN_PAIRS = 4_000_000


@dataclass(frozen=True)
class LoraWeights:
    """One module's low-rank update: ``delta W = scaling * up @ down``, and with a ``bias``
    ``delta b = scaling * bias`` (PEFT's ``lora_B.bias``: lightx2v's ``.diff_b``)."""

    down: torch.Tensor  # A: [rank, in_features]
    up: torch.Tensor  # B: [out_features, rank]
    scaling: float  # alpha / rank as PEFT computes it (alpha / sqrt(rank) for rsLoRA)
    bias: torch.Tensor | None = None  # [out_features], scaled like B (PEFT: inside lora_B)

    @property
    def rank(self) -> int:
        return self.down.shape[0]


def module_weights(pairs, config, *, declared_ranks: bool, label: str) -> dict[str, LoraWeights]:
    """Each module's weights and ``alpha / r`` scaling, as PEFT would set them from ``config``.

    The rank is the tensors' own (A's rows). With metadata the config also declares one; when it
    differs, ``load_lora_weights`` fails on a size mismatch, so the file is refused here.
    Without metadata the config's ranks were derived from these same tensors.
    """
    alphas = Patterns(config.alpha_pattern, "alpha_pattern", label, len(pairs))
    ranks = Patterns(config.rank_pattern, "rank_pattern", label, len(pairs)) if declared_ranks else None
    rslora = bool(config.use_rslora)
    modules = {}
    for module, (down, up, *bias) in pairs.items():
        r = down.shape[0]
        if ranks is not None:
            declared = ranks.get(module, config.r)
            if isinstance(declared, bool) or not isinstance(declared, int) or declared != r:
                raise AdapterFormatError(
                    f"{label}: metadata declares rank {shown(declared)} for {module}, its weights have rank {r}"
                )
        alpha = checked_number(alphas.get(module, config.lora_alpha), f"lora_alpha of {module}", label)
        try:  # as PEFT computes it, tensor alphas (kohya files without metadata) included
            scaling = float(alpha / math.sqrt(r) if rslora else alpha / r)
        except (OverflowError, ValueError, RuntimeError) as exc:
            raise AdapterFormatError(f"{label}: alpha / rank of {module} is not a number ({exc})") from exc
        modules[module] = LoraWeights(down=down, up=up, scaling=scaling, bias=bias[0] if bias else None)
    return modules


class Patterns:
    r"""A ``rank_pattern`` / ``alpha_pattern`` lookup that gives what PEFT's ``get_pattern_key`` gives,
    for keys that are module names, without running a regex from the file.

    PEFT matches ``re.match(rf"(.*\.)?({key})$", module)`` and takes the first key that matches.
    For a key of letters, digits, ``_`` and ``.`` (a wildcard there), optionally ``^``/``$``-anchored,
    that regex can only match the last ``len(body)`` characters of the module, starting at the
    module's start or right after a ``.`` (``^`` allows only the start), so it is one
    fixed-position comparison. Any other key is refused: a regex there can take forever.
    """

    def __init__(self, patterns, field_name: str, label: str, modules: int):
        if patterns is None:
            patterns = {}
        if not isinstance(patterns, Mapping):
            raise AdapterFormatError(f"{label}: {field_name} is a {type(patterns).__name__}, not a mapping")
        if len(patterns) > MAX_PATTERN_KEYS or len(patterns) * modules > MAX_PATTERN_PAIRS:
            raise AdapterFormatError(
                f"{label}: {field_name} has {len(patterns)} keys for {modules} modules; hotlora matches at most "
                f"{MAX_PATTERN_KEYS} keys and {MAX_PATTERN_PAIRS} key-module pairs"
            )
        self._entries = []
        for key, value in patterns.items():
            if not isinstance(key, str) or len(key) > MAX_NAME_CHARS or not PATTERN_KEY.fullmatch(key):
                raise AdapterFormatError(
                    f"{label}: {field_name} key {shown(key)} is not a module name (letters, digits, _ and ., "
                    f"optionally ^...$): regex patterns are not run"
                )
            body = key.removeprefix("^").removesuffix("$")
            # The body holds no quantifier: its own regex matches in time linear in its length.
            self._entries.append((key.startswith("^"), body, re.compile(re.escape(body).replace(r"\.", ".")), value))

    def get(self, module: str, default):
        for anchored, body, literal, value in self._entries:
            start = len(module) - len(body)
            if start < 0 or (start > 0 and (anchored or module[start - 1] != ".")):
                continue
            if literal.fullmatch(module, start):
                return value
        return default


def checked_number(value, what: str, label: str):
    """A config's alpha: a finite real number, or a one-element tensor (diffusers passes kohya
    alphas as tensors); returned as is, so the scaling is computed with PEFT's own types."""
    if isinstance(value, torch.Tensor):
        ok = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
        try:
            number = value.detach().reshape(()).double().item() if ok else None
        except RuntimeError:  # a dtype with no conversion to double
            ok = False
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            number = float(value) if ok else None
        except OverflowError:
            ok = False
    if not ok or not math.isfinite(number):
        raise AdapterFormatError(f"{label}: {what} is {shown(value)}, not a finite number")
    return value


def shown(value) -> str:
    """A value from the file, cut short for a message."""
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
    return text if len(text) <= 80 else text[:77] + "..."
