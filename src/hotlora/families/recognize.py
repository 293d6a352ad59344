"""Which family a LoRA that does not fit the served one was made for, so that the refusal can name
both ("this is an SDXL LoRA; this engine serves flux") instead of only listing keys.

Three signals: the module names distinctive of a family's denoiser, as diffusers and the trainers
name them (``ModelFamily.lora_key_pattern``); failing those, which families' denoisers have a layer
of every name a file's modules have (``vocabulary.py``: an attention-only LoRA's names are shared by
several); and what trainers write about the base model in a file's metadata (kohya's
``ss_base_model_version``, the ``modelspec.architecture`` of sd-scripts and ai-toolkit, a declared
base model id: ``ModelFamily.base_model_markers``). No
library does this (diffusers' converters only say a key is incompatible), so it is ours. The
family guess is only ever used to word an error: nothing is served or refused because of it.

Beside it, what is decided by: whether a declared base model id names a served model
(``base_model_compatible``: the full id or its last part), for validation, the inference API's
``/models/{id}`` and the Ray ingress's routing of a Hub adapter to its base. Torch-free (the
ingress imports it).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Iterable, Mapping

from hotlora.families import FAMILIES, REGISTERED, ModelFamily
from hotlora.families.vocabulary import families_of_modules

# Metadata keys whose values name the base model a trainer trained on.
BASE_MODEL_KEYS = ("ss_base_model_version", "modelspec.architecture", "ss_sd_model_name", "base_model",
                   "base_model_name_or_path", "modelspec.implementation")
SAMPLED_KEYS = 2000  # a hostile file may hold millions of keys: a sample says as much


@cache
def _pattern(family: ModelFamily) -> re.Pattern | None:
    return re.compile(family.lora_key_pattern) if family.lora_key_pattern else None


def families_of_keys(keys: Iterable[str]) -> list[ModelFamily]:
    """The registered families whose distinctive module names the most of ``keys`` match (several
    when they tie), if that is at least a tenth of them."""
    sample = [key for _, key in zip(range(SAMPLED_KEYS), keys)]
    scores = {}
    for family in REGISTERED:
        pattern = _pattern(family)
        if pattern is not None:
            scores[family] = sum(1 for key in sample if pattern.search(key))
    best = max(scores.values(), default=0)
    if not sample or best * 10 < len(sample) or best == 0:
        return []
    return [family for family, hits in scores.items() if hits == best]


# What LoRA files put around a module's name: the model part's prefix, the factor's suffix.
PART_PREFIX = re.compile(r"^(base_model\.model\.|diffusion_model\.|transformer\.|unet\.)")
FACTOR_SUFFIX = re.compile(r"\.(lora_[AB]|lora_down|lora_up)(\.[A-Za-z_]+)?\.weight$|\.alpha$")


def module_names(keys: Iterable[str]) -> list[str]:
    """The module names a file's keys (or module names, unchanged) are about, in diffusers' naming."""
    return list(dict.fromkeys(FACTOR_SUFFIX.sub("", PART_PREFIX.sub("", key)) for key in keys))


def families_of_metadata(metadata: Mapping | None, declared: str | None = None) -> list[ModelFamily]:
    """The registered families a file's base-model metadata (or its declared base model) names. Where
    one family's marker is part of another's found in the same text ("qwen-image" in "qwen-image-2.1"),
    the longer one names it."""
    texts = [str(value).lower() for key, value in (metadata or {}).items() if key.endswith(BASE_MODEL_KEYS)]
    if declared:
        texts.append(declared.lower())
    named = set()
    for text in texts:
        found = [(family, marker) for family in REGISTERED for marker in family.base_model_markers if marker in text]
        named |= {family for family, marker in found
                  if not any(marker != longer and marker in longer for _, longer in found)}
    return [family for family in REGISTERED if family in named]


def _model_names(name: str) -> set[str]:
    name = name.strip().rstrip("/").lower()
    return {name, name.rsplit("/", 1)[-1]}


def base_model_compatible(declared: str | None, served: Iterable[str]) -> bool:
    """An adapter declaring no base model, or one the served model answers to (full id or its last part)."""
    served = [name for name in served if name]
    if not declared or not served:
        return True
    wanted = _model_names(declared)
    return any(wanted & _model_names(name) for name in served)


def foreign_note(served: ModelFamily, keys: Iterable[str], metadata: Mapping | None = None,
                 declared: str | None = None) -> str:
    """``"; it looks like a sdxl LoRA (...); this engine serves flux"``, or "" when nothing
    recognisable points to another family. ``keys``: a file's keys or the modules they name."""
    keys = list(keys)
    by_metadata = [f for f in families_of_metadata(metadata, declared) if f is not served]
    patterned = families_of_keys(keys)
    # names: the families' layer-name vocabularies, over the sample the patterns read (a hostile file
    # may hold millions of keys)
    fitting = families_of_modules(module_names(keys[:SAMPLED_KEYS]))
    if (served in patterned or served.name in fitting) and not by_metadata:
        return ""  # its names are the served family's: a damaged or partial file, not a foreign one
    by_keys = [f for f in patterned if f is not served]
    by_names = [FAMILIES[name] for name in fitting if name != served.name]
    others = list(dict.fromkeys([*by_metadata, *(by_keys or by_names)]))  # a pattern is the surer sign
    if not others:
        return ""
    names = " or ".join(f.name for f in others)  # all of them: several only where names are shared
    named_by_declared = any(f is not served for f in families_of_metadata(None, declared))
    why = ((f"it declares base model {declared!r}" if named_by_declared else "its metadata names that base model")
           if by_metadata else f"keys such as {keys[0]!r}" if by_keys
           else f"its layer names, such as {keys[0]!r}, are that model's and not all this one's")
    return f"; it looks like a LoRA for the {names} family ({why}); this engine serves the {served.name} family"
