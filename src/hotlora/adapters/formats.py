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
import io
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from hotlora.adapters.families import Family, pipeline_class
from hotlora.errors import AdapterFormatError, AdapterNotFound

if TYPE_CHECKING:
    from hotlora.adapters.packing import PackedWeights

log = logging.getLogger(__name__)

PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


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
    # Set once by adapters.packing when the weights are re-laid out for the engine's slots; the
    # modules' tensors are then views into it.
    packed: "PackedWeights | None" = field(default=None, repr=False, compare=False)

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(w.down.nbytes + w.up.nbytes for w in self.modules.values())


@dataclass(frozen=True)
class ReadLimits:
    """What a file must respect before its contents are parsed."""

    max_bytes: int = 2 * 1024**3
    max_header_bytes: int = 16 * 1024**2
    allow_pickle: bool = False  # .bin/.pt, read with torch.load(weights_only=True)


def load_adapter(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    family: Family,
    *,
    name: str | None = None,
    denoiser_config: Mapping | None = None,
    limits: ReadLimits = ReadLimits(),
) -> Adapter:
    """Read ``source`` (a weights file, a directory, or a state dict) into an :class:`Adapter`.

    ``denoiser_config`` is the served UNet's config; SDXL kohya files need it to map SGM block
    numbers the way ``load_lora_weights`` does.
    """
    if isinstance(source, Mapping):
        raw, file_metadata, extra, digest = dict(source), None, {}, _hash_state_dict(source)
        label = name or "<state dict>"
    else:
        path = Path(source)
        label = name or str(path)
        raw, file_metadata, extra, digest = _read_files(path, limits, label)
    return _canonicalize(raw, file_metadata, extra, family, label, digest, denoiser_config)


def _read_files(path: Path, limits: ReadLimits, label: str):
    """The weights, diffusers' LoRA metadata, PEFT config / model card (``extra``) and sha256."""
    if not path.exists():
        raise AdapterNotFound(f"adapter not found: {label} does not exist")
    extra: dict = {}
    directory = path if path.is_dir() else path.parent
    if (directory / PEFT_CONFIG).is_file() and (path.is_dir() or path.name == "adapter_model.safetensors"):
        extra["peft_config"] = _read_json(directory / PEFT_CONFIG)
    if path.is_dir():
        extra["model_card"] = _model_card_base_model(path / "README.md")
        path = path / _weight_file_in(path, limits, label)
    if path.suffix == ".safetensors":
        data = _read_capped(path, limits, label)
        _check_safetensors_header(data, limits, label)
        try:
            from safetensors.torch import load as load_safetensors

            raw = load_safetensors(data)
        except Exception as exc:  # safetensors raises its own error type and plain ones for bad headers
            raise AdapterFormatError(f"{label}: not a readable safetensors file ({exc})") from exc
        from diffusers.loaders.lora_base import _load_sft_state_dict_metadata

        extra["header_base_model"] = _header_base_model(data)
        return raw, _load_sft_state_dict_metadata(str(path)), extra, hashlib.sha256(data).hexdigest()
    if path.suffix in (".bin", ".pt", ".pth") and limits.allow_pickle:
        data = _read_capped(path, limits, label)
        try:
            raw = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise AdapterFormatError(f"{label}: unreadable pickled weights ({type(exc).__name__}: {exc})") from exc
        if not isinstance(raw, Mapping):
            raise AdapterFormatError(f"{label}: pickled weights are not a state dict")
        return dict(raw), None, extra, hashlib.sha256(data).hexdigest()
    raise AdapterFormatError(
        f"{label}: only .safetensors adapters are accepted ({path.suffix or 'no extension'} given; "
        "pickled .bin files can run code and need the allow_pickle opt-in)"
    )


def _weight_file_in(directory: Path, limits: ReadLimits, label: str) -> str:
    from diffusers.loaders.lora_base import _best_guess_weight_name

    if (directory / "adapter_model.safetensors").is_file():
        return "adapter_model.safetensors"
    name = _best_guess_weight_name(str(directory), file_extension=".safetensors")
    if name is None and limits.allow_pickle:
        name = _best_guess_weight_name(str(directory), file_extension=".bin")
    if name is None:
        raise AdapterNotFound(f"adapter directory {label} holds no .safetensors weights")
    return name


def _read_capped(path: Path, limits: ReadLimits, label: str) -> bytes:
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise AdapterFormatError(f"{label}: {size} bytes exceeds the {limits.max_bytes}-byte adapter size cap")
    return path.read_bytes()


def _check_safetensors_header(data: bytes, limits: ReadLimits, label: str) -> None:
    """The 8-byte header length is checked before safetensors parses anything."""
    if len(data) < 8:
        raise AdapterFormatError(f"{label}: truncated safetensors file ({len(data)} bytes)")
    header = int.from_bytes(data[:8], "little")
    if header > limits.max_header_bytes:
        raise AdapterFormatError(f"{label}: safetensors header of {header} bytes exceeds the {limits.max_header_bytes}-byte cap")
    if 8 + header > len(data):
        raise AdapterFormatError(f"{label}: truncated safetensors file (header says {header} bytes, file has {len(data) - 8})")


def _header_base_model(data: bytes) -> str | None:
    """``base_model`` from the safetensors ``__metadata__`` (the header is JSON behind 8 length bytes)."""
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    except ValueError:
        return None
    meta = header.get("__metadata__") or {}
    return meta.get("base_model") or meta.get("base_model_name_or_path")


def _model_card_base_model(readme: Path) -> str | None:
    if not readme.is_file():
        return None
    from huggingface_hub.repocard import metadata_load

    try:
        base = (metadata_load(readme) or {}).get("base_model")
    except Exception:  # a malformed card is not a reason to refuse the weights
        return None
    if isinstance(base, list):
        base = base[0] if base else None
    return str(base) if base else None


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


def _canonicalize(raw, file_metadata, extra, family: Family, label, digest, denoiser_config) -> Adapter:
    from diffusers.utils.peft_utils import _create_lora_config
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
    from peft.utils.other import get_pattern_key

    bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise AdapterFormatError(f"{label}: entries that are not tensors: {', '.join(sorted(bad)[:5])}")
    layout = detect_layout(raw)
    peft_config = extra.get("peft_config")
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
    unsupported = sorted(k for k in ours if ".lora_A." not in k and ".lora_B.weight" not in k)
    orphans = sorted(k.split(".lora_B.")[0] for k in ours if ".lora_B.weight" in k and k.replace("lora_B", "lora_A") not in ours)
    if unpaired or unsupported or orphans:
        shown = sorted(set(unpaired + orphans)) + unsupported
        raise AdapterFormatError(f"{label}: unsupported or unpaired LoRA keys: {', '.join(shown[:8])}")

    return Adapter(
        name=label,
        family=family.name,
        layout=layout,
        modules=modules,
        sha256=digest,
        base_model=_declared_base_model(file_metadata, peft_config, extra.get("header_base_model") or extra.get("model_card")),
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


def _declared_base_model(file_metadata, peft_config, fallback) -> str | None:
    """``adapter_config.json``, then diffusers' LoRA metadata, then the file header or the model card."""
    if peft_config and peft_config.get("base_model_name_or_path"):
        return peft_config["base_model_name_or_path"]
    if file_metadata:
        for key, value in file_metadata.items():
            if key.endswith("base_model") or key.endswith("base_model_name_or_path"):
                return str(value)
    return fallback
