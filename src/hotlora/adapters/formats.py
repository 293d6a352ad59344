"""Read a LoRA in any layout diffusers understands and turn it into one canonical form.

The canonical form is what the engine copies into its slots: per denoiser module a down matrix
``A [r, in]``, an up matrix ``B [out, r]`` and the scaling PEFT would apply (``alpha / r``).

Conversion is diffusers' own: the pipeline class's ``lora_state_dict`` converts kohya, XLabs and
the other community layouts, and ``_create_lora_config`` derives the exact ``LoraConfig`` (ranks,
alphas, patterns) that ``load_lora_weights`` would build. We then read the per-module rank and
alpha with PEFT's own pattern matcher. Mirroring those calls, instead of re-deriving alphas, is
what makes a hot-swapped slot equal to a fresh ``load_lora_weights``.

Written here by hand, because no library does it: the PEFT on-disk layout
(``base_model.model.*`` + ``adapter_config.json``), which Flux's ``lora_state_dict`` mistakes for
another format and fails on with a ``KeyError``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from hotlora.adapters.families import Family, pipeline_class
from hotlora.errors import AdapterFormatError, AdapterNotFound

log = logging.getLogger(__name__)

PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# The file names diffusers and PEFT write, in the order we look for them in a directory.
WEIGHT_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")


@dataclass(frozen=True)
class LoraWeights:
    """One module's low-rank update: ``delta W = scaling * up @ down``."""

    down: torch.Tensor  # A: [rank, in_features]
    up: torch.Tensor  # B: [out_features, rank]
    scaling: float  # alpha / rank as PEFT computes it (alpha / sqrt(rank) for rsLoRA)

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class Adapter:
    """A LoRA for one denoiser, converted once, ready to be validated and copied into a slot."""

    name: str
    family: str
    layout: str  # diffusers | peft | kohya | xlabs
    modules: dict[str, LoraWeights]
    sha256: str
    base_model: str | None = None
    skipped_keys: list[str] = field(default_factory=list)  # text-encoder keys: not served

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(w.down.nbytes + w.up.nbytes for w in self.modules.values())


def load_adapter(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    family: Family,
    *,
    name: str | None = None,
    denoiser_config: Mapping | None = None,
) -> Adapter:
    """Read ``source`` (a .safetensors file, a directory, or a state dict) into an :class:`Adapter`.

    ``denoiser_config`` is the served UNet's config; SDXL kohya files need it to map SGM block
    numbers the way ``load_lora_weights`` does.
    """
    if isinstance(source, Mapping):
        raw, file_metadata, peft_config = dict(source), None, None
        label = name or "<state dict>"
        digest = _hash_state_dict(raw)
    else:
        path = Path(source)
        label = name or str(path)
        raw, file_metadata, peft_config, digest = _read_files(path)
    return _canonicalize(raw, file_metadata, peft_config, family, label, digest, denoiser_config)


def _read_files(path: Path):
    if not path.exists():
        raise AdapterNotFound(f"adapter not found: {path} does not exist")
    peft_config = None
    if path.is_dir():
        config_file = path / PEFT_CONFIG
        if config_file.is_file():
            peft_config = _read_json(config_file)
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            found = sorted(p.name for p in path.glob("*.safetensors"))
            if len(found) != 1:
                raise AdapterNotFound(
                    f"adapter directory {path} holds {len(found)} .safetensors files ({', '.join(found) or 'none'}); "
                    "name the file"
                )
            weights = path / found[0]
        path = weights
    elif (path.parent / PEFT_CONFIG).is_file() and path.name == "adapter_model.safetensors":
        peft_config = _read_json(path.parent / PEFT_CONFIG)
    if path.suffix != ".safetensors":
        raise AdapterFormatError(
            f"{path.name}: only .safetensors adapters are accepted (pickled .bin files can run code)"
        )
    data = path.read_bytes()
    try:
        from safetensors.torch import load as load_safetensors

        raw = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error type and plain ones for bad headers
        raise AdapterFormatError(f"{path.name}: not a readable safetensors file ({exc})") from exc
    from diffusers.loaders.lora_base import _load_sft_state_dict_metadata

    file_metadata = _load_sft_state_dict_metadata(str(path))
    return raw, file_metadata, peft_config, hashlib.sha256(data).hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterFormatError(f"{path}: unreadable JSON ({exc})") from exc


def _hash_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key]
        digest.update(key.encode())
        if isinstance(tensor, torch.Tensor):
            digest.update(str(tensor.dtype).encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def detect_layout(keys) -> str:
    keys = list(keys)
    if any(k.startswith(PEFT_PREFIX) for k in keys):
        return "peft"
    if any(k.startswith(("lora_unet_", "lora_te")) or ".lora_down." in k for k in keys):
        return "kohya"
    if any(".processor." in k for k in keys):
        return "xlabs"
    return "diffusers"


def _canonicalize(raw, file_metadata, peft_config, family: Family, label, digest, denoiser_config) -> Adapter:
    from diffusers.utils.peft_utils import _create_lora_config
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
    from peft.utils.other import get_pattern_key

    bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise AdapterFormatError(f"{label}: entries that are not tensors: {', '.join(sorted(bad)[:5])}")
    layout = detect_layout(raw)
    prefix = family.denoiser
    metadata = file_metadata
    if layout == "peft":
        # PEFT saves keys relative to the wrapped model and the LoraConfig beside them.
        raw = {f"{prefix}.{k.removeprefix(PEFT_PREFIX)}": v for k, v in raw.items()}
        if peft_config is not None:
            metadata = {f"{prefix}.{k}": v for k, v in _lora_config_fields(peft_config).items()}

    state_dict, network_alphas, metadata = _diffusers_state_dict(raw, metadata, family, label, denoiser_config)

    ours = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
    skipped = sorted(k for k in state_dict if not k.startswith(f"{prefix}."))
    if not ours:
        raise AdapterFormatError(
            f"{label}: no LoRA weights for the {family.name} {prefix} found "
            f"({len(state_dict)} keys, e.g. {', '.join(sorted(state_dict)[:3]) or 'none'})"
        )
    if skipped:
        log.warning("%s: skipping %d keys outside the %s (text-encoder LoRAs are not served)", label, len(skipped), prefix)
    if metadata is not None:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    if network_alphas:
        network_alphas = {
            k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items() if k.startswith(f"{prefix}.")
        }
    if "lora_A" not in next(iter(ours)):
        ours = convert_unet_state_dict_to_peft(ours)

    # The same rank dict and config construction as diffusers' load_lora_adapter.
    rank = {f"^{k}": v.shape[1] for k, v in ours.items() if "lora_B" in k and v.ndim > 1}
    try:
        config = _create_lora_config(ours, network_alphas, metadata, rank)
    except Exception as exc:
        raise AdapterFormatError(f"{label}: cannot derive a LoRA config ({exc})") from exc
    if config.use_dora:
        raise AdapterFormatError(f"{label}: DoRA adapters cannot be hot-swapped")

    modules: dict[str, LoraWeights] = {}
    unpaired = []
    for key in ours:
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        up = ours.get(f"{module}.lora_B.weight")
        if up is None or not key.endswith(".weight"):
            unpaired.append(module)
            continue
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        modules[module] = LoraWeights(down=ours[key], up=up, scaling=float(scaling))
    extra = sorted(k for k in ours if ".lora_A." not in k and ".lora_B.weight" not in k)
    orphans = sorted(k.split(".lora_B.")[0] for k in ours if ".lora_B.weight" in k and k.replace("lora_B", "lora_A") not in ours)
    if unpaired or extra or orphans:
        shown = sorted(set(unpaired + orphans)) + extra
        raise AdapterFormatError(f"{label}: unsupported or unpaired LoRA keys: {', '.join(shown[:8])}")

    return Adapter(
        name=label,
        family=family.name,
        layout=layout,
        modules=modules,
        sha256=digest,
        base_model=_declared_base_model(file_metadata, peft_config),
        skipped_keys=skipped,
    )


def _diffusers_state_dict(raw, metadata, family: Family, label, denoiser_config):
    """Run diffusers' own detection and conversion for this family."""
    cls = pipeline_class(family)
    kwargs = {"return_lora_metadata": True}
    if family.name == "flux":
        kwargs["return_alphas"] = True
    elif denoiser_config is not None:
        kwargs["unet_config"] = denoiser_config
    try:
        state_dict, network_alphas, file_meta = cls.lora_state_dict(raw, **kwargs)
    except Exception as exc:  # converters raise ValueError, KeyError, AssertionError, ...
        raise AdapterFormatError(f"{label}: diffusers cannot convert this LoRA ({type(exc).__name__}: {exc})") from exc
    return state_dict, network_alphas, metadata if metadata is not None else file_meta


def _lora_config_fields(peft_config: dict) -> dict:
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__)
    return {k: v for k, v in peft_config.items() if k in known and k not in {"base_model_name_or_path", "revision"}}


def _declared_base_model(file_metadata, peft_config) -> str | None:
    if peft_config and peft_config.get("base_model_name_or_path"):
        return peft_config["base_model_name_or_path"]
    if file_metadata:
        for key, value in file_metadata.items():
            if key.endswith("base_model") or key.endswith("base_model_name_or_path"):
                return str(value)
    return None
