"""Reading an adapter's files safely: size and header caps before parsing, diffusers' metadata
reader, the PEFT config and model card beside the weights, the content hash, and the base model a
file declares (null, "None" and the like mean "not declared").

Nothing here converts: ``formats`` turns what is read into the canonical form.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from hotlora.adapters.defaults import read_declared
from hotlora.adapters.format.embeddings import embeddings_file_in, is_embeddings_file
from hotlora.adapters.store.references import UnsafeReference, check_plain_file, inside
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterFormatError, AdapterNotFound
from hotlora.families import REGISTERED

log = logging.getLogger(__name__)

PEFT_CONFIG = "adapter_config.json"
MAX_BASE_MODEL_CHARS = 1024
MAX_JSON_BYTES = 1 << 20  # adapter_config.json: a few hundred bytes in practice


@dataclass(frozen=True)
class ReadLimits:
    """What a file must respect before its contents are parsed."""

    max_bytes: int = StoreConfig.default("max_adapter_bytes")
    max_header_bytes: int = StoreConfig.default("max_header_bytes")
    allow_pickle: bool = StoreConfig.default("allow_pickle")  # .bin/.pt, read with torch.load(weights_only=True)
    # Every file read must lie inside one of these once symlinks are followed (the store passes
    # the source's: local roots, the download folder, the Hub repository folder). Empty: a path
    # the caller chose itself (the library API, the operator's CLI), read as given.
    roots: tuple = ()

    @classmethod
    def of(cls, config: StoreConfig) -> "ReadLimits":
        return cls(config.max_adapter_bytes, config.max_header_bytes, config.allow_pickle)


def read_files(path: Path, limits: ReadLimits, label: str):
    """The weights, diffusers' LoRA metadata, PEFT config / model card (``extra``) and sha256."""
    if not path.exists():
        raise AdapterNotFound(f"adapter not found: {label} does not exist")
    extra: dict = {}
    directory = path if path.is_dir() else path.parent
    if (directory / PEFT_CONFIG).is_file() and (path.is_dir() or path.name == "adapter_model.safetensors"):
        extra["peft_config"] = _read_json(_confined(directory / PEFT_CONFIG, limits, label), label)
    if path.is_dir():
        extra["model_card"] = _model_card_base_model(_confined(path / "README.md", limits, label))
        embeddings = embeddings_file_in(path, label)
        if embeddings is not None:  # pivotal-tuning vectors travel with the LoRA of their folder
            extra["embeddings"] = read_embeddings_file(embeddings, limits, label)
        path = path / _weight_file_in(path, limits, label)
    path = _confined(path, limits, label)
    if path.suffix == ".safetensors":
        raw, data = _read_safetensors(path, limits, label)
        meta = _header_metadata(data)
        extra["header_base_model"] = _header_base_model(meta)
        extra["declared"] = read_declared(meta, label)  # the inference defaults it was trained for
        return raw, _lora_adapter_metadata(path, label), extra, hashlib.sha256(data).hexdigest()
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


def read_embeddings_file(path: Path, limits: ReadLimits, label: str) -> tuple[dict[str, torch.Tensor], list | None]:
    """A pivotal-tuning embeddings file, under the same caps and confinement as the weights: its
    tensors, and the token names its header lists (``tokens``, JSON; hotlora's export writes
    them), else None."""
    tensors, data = _read_safetensors(_confined(path, limits, label), limits, label)
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        tokens = json.loads(header.get("__metadata__", {}).get("tokens", "null"))
    except (ValueError, RecursionError, AttributeError, TypeError):
        tokens = None
    return tensors, tokens


def _read_safetensors(path: Path, limits: ReadLimits, label: str) -> tuple[dict[str, torch.Tensor], bytes]:
    data = _read_capped(path, limits, label)
    _check_safetensors_header(data, limits, label)
    try:
        from safetensors.torch import load as load_safetensors

        return load_safetensors(data), data
    except Exception as exc:  # safetensors raises its own error type and plain ones for bad headers
        # Its message can quote the header's bytes (serde names the value it choked on), and a
        # file may be anything a remote sent: the detail stays in the log.
        log.info("%s: safetensors refused the file: %s", label, exc)
        raise AdapterFormatError(f"{label}: not a readable safetensors file") from None


def _confined(path: Path, limits: ReadLimits, label: str) -> Path:
    """``path`` if it stays inside ``limits.roots`` with symlinks followed (or no roots are set)."""
    if limits.roots and not any(inside(os.path.realpath(path), os.path.realpath(root)) for root in limits.roots):
        raise UnsafeReference(f"{label}: not allowed (a file links outside the allowed directories)")
    return path


def _weight_file_in(directory: Path, limits: ReadLimits, label: str) -> str:
    from diffusers.loaders.lora_base import _best_guess_weight_name

    if (directory / "adapter_model.safetensors").is_file():
        return "adapter_model.safetensors"
    files = [p.name for p in directory.glob("*.safetensors")]
    weights = [name for name in files if not is_embeddings_file(name)]
    if len(weights) == 1 < len(files):  # the embeddings beside a LoRA are not a second weights file
        return weights[0]
    name = _best_guess_weight_name(str(directory), file_extension=".safetensors")
    if name is not None and is_embeddings_file(name):
        name = None
    if name is None and limits.allow_pickle:
        name = _best_guess_weight_name(str(directory), file_extension=".bin")
    if name is None:
        raise AdapterNotFound(f"adapter directory {label} holds no .safetensors weights")
    return name


def _read_capped(path: Path, limits: ReadLimits, label: str) -> bytes:
    return _read_regular(path, limits.max_bytes, label, "adapter size cap")


def _read_regular(path: Path, max_bytes: int, label: str, cap: str) -> bytes:
    """A regular file's bytes, at most ``max_bytes``. Opened without blocking and checked on the
    open file (no window to swap it): a FIFO would block the open or the read for ever, a device
    (``/dev/zero``) never ends, and ``st_size`` says nothing about either."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            check_plain_file(path, info.st_mode)  # a pipe, socket or device: refused with its reason
            raise AdapterFormatError(f"{label}: {path.name} is a directory, not a file")
        size = info.st_size
        data = b"" if size > max_bytes else file.read(max_bytes + 1)  # capped even if it grows meanwhile
    size = max(size, len(data))
    if size > max_bytes:
        raise AdapterFormatError(f"{label}: {size} bytes exceeds the {max_bytes}-byte {cap}")
    return data


def _check_safetensors_header(data: bytes, limits: ReadLimits, label: str) -> None:
    """The 8-byte header length is checked before safetensors parses anything. The messages name
    the limit, never the value read: those 8 bytes may be the start of anything (an error page a
    redirect led to), and echoing them as a number would echo the bytes."""
    if len(data) < 8:
        raise AdapterFormatError(f"{label}: truncated safetensors file")
    header = int.from_bytes(data[:8], "little")
    if header > limits.max_header_bytes:
        raise AdapterFormatError(f"{label}: safetensors header exceeds the {limits.max_header_bytes}-byte cap")
    if 8 + header > len(data):
        raise AdapterFormatError(f"{label}: truncated safetensors file (shorter than its header says)")


def _lora_adapter_metadata(path: Path, label: str) -> dict | None:
    """diffusers' ``lora_adapter_metadata`` header entry (``LoraConfig`` fields, prefixed by component),
    read by diffusers' own reader. It is JSON inside a string: a value diffusers cannot read
    is refused here with the reason, not passed on as an odd type."""
    from diffusers.loaders.lora_base import _load_sft_state_dict_metadata

    try:
        metadata = _load_sft_state_dict_metadata(str(path))
    except Exception as exc:  # json's ValueError, RecursionError for deep nesting, safetensors' own
        raise AdapterFormatError(
            f"{label}: unreadable lora_adapter_metadata in the header ({type(exc).__name__}: {exc})"
        ) from exc
    if metadata is not None and not isinstance(metadata, dict):
        kind = type(metadata).__name__
        raise AdapterFormatError(f"{label}: lora_adapter_metadata in the header is a JSON {kind}, not an object")
    return metadata


def _header_metadata(data: bytes) -> dict | None:
    """The safetensors ``__metadata__`` (the header is JSON behind 8 length bytes), or None."""
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    except (ValueError, RecursionError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else None


def _header_base_model(meta: dict | None) -> str | None:
    """``base_model`` from the safetensors ``__metadata__``."""
    if meta is None:
        return None
    return _declared(meta.get("base_model")) or _declared(meta.get("base_model_name_or_path"))


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
    return _declared(base)


def _read_json(path: Path, label: str) -> dict:
    # Named by the reference as the client wrote it, never by the path it resolved to.
    try:
        value = json.loads(_read_regular(path, MAX_JSON_BYTES, f"{label}: {path.name}", "cap"))
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterFormatError(f"{label}: unreadable {path.name} ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{label}: {path.name} holds a JSON {type(value).__name__}, not an object")
    return value


def hash_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key]
        digest.update(key.encode())
        if isinstance(tensor, torch.Tensor):
            digest.update(str(tensor.dtype).encode())
            digest.update(str(tuple(tensor.shape)).encode())
            # reshape: a 0-dim tensor (a kohya .alpha) cannot be viewed as bytes; same bytes otherwise.
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def declared_base_model(file_metadata, peft_config, fallback) -> str | None:
    """``adapter_config.json``, then diffusers' LoRA metadata, then the file header or the model card."""
    if peft_config and _declared(peft_config.get("base_model_name_or_path")):
        return _declared(peft_config["base_model_name_or_path"])
    for key, value in (file_metadata or {}).items():
        if key.endswith(("base_model", "base_model_name_or_path")) and _declared(value):
            return _declared(value)
    return fallback


def _declared(value) -> str | None:
    """A base model name, or None for "not declared". A ``LoraConfig`` saved by diffusers' training
    scripts has ``base_model_name_or_path: null``; tools that stringify their config write "None"
    or "null". Neither names a model, and neither does a non-string or a string no model id is as long as."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    if value.lower() in ("", "none", "null") or len(value) > MAX_BASE_MODEL_CHARS:
        return None
    return _model_named_by(value)


@functools.cache
def _denoiser_dirs() -> frozenset[str]:
    """The pipeline subfolders of the registered families' denoisers (read from diffusers once)."""
    return frozenset(family.denoiser for family in REGISTERED)


def _model_named_by(value: str) -> str:
    """The model a declared path stands for. PEFT's ``save_pretrained`` on a diffusers denoiser puts
    the denoiser's own directory in the model card: ``<pipeline dir>/transformer``, or inside the hub
    cache ``.../models--org--name/snapshots/<hash>/transformer``. Those name the pipeline (the
    directory) or the hub id ``org/name``, not a model called "transformer"."""
    parts = [part for part in value.replace("\\", "/").split("/") if part]
    for part in parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    if len(parts) > 1 and parts[-1] in _denoiser_dirs():
        return value.replace("\\", "/").rstrip("/").rsplit("/", 1)[0] or "/"
    return value
