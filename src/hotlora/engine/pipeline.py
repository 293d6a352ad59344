"""Build the warm pipeline: load through ``from_pretrained``, pick device and dtype, compile."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import torch

from hotlora.durable import TMP, read_verified, sweep_orphans, write_verified
from hotlora.engine.device import default_dtype
from hotlora.families import ModelFamily, family_of_pipeline
from hotlora.errors import HotloraError

log = logging.getLogger(__name__)


class ModelLoadError(HotloraError):
    """The model could not be loaded (start-up fault: neither a request nor a warm-engine error)."""


def resolve_dtype(dtype, device: str) -> torch.dtype:
    """The configured dtype (a torch dtype, or its name as settings text gives it: "bfloat16"),
    else the device's default."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype):
            raise ModelLoadError(f"dtype {dtype!r} is not a torch dtype name (bfloat16, float16, float32)")
        return named
    return dtype


def load_pipeline(model: str | os.PathLike, *, dtype: torch.dtype, device: str):
    """Load a Flux or SDXL pipeline from a local directory or a hub id (``from_pretrained``)."""
    from diffusers import DiffusionPipeline

    model = str(model)
    local = os.path.isdir(model)
    log.info("loading %s (%s) as %s on %s", model, "local directory" if local else "hub id", dtype, device)
    try:
        pipeline = DiffusionPipeline.from_pretrained(model, dtype=dtype, local_files_only=local or None)
    except Exception as exc:  # diffusers and huggingface_hub raise many types; the message is what matters
        raise ModelLoadError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc
    family = family_of_pipeline(pipeline)
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, family


def compile_denoiser(denoiser: torch.nn.Module, family: ModelFamily, fullgraph: bool = True,
                     dynamic: bool | None = None) -> str:
    """Regional compilation where the model declares repeated blocks, whole-model otherwise.
    ``dynamic``: torch.compile's (None: dims that change between calls turn dynamic on their second
    value; False: one static graph per shape)."""
    if not getattr(denoiser, "_repeated_blocks", None) and family.repeated_blocks:
        denoiser._repeated_blocks = list(family.repeated_blocks)  # what compile_repeated_blocks reads
    if getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(fullgraph=fullgraph, dynamic=dynamic)
        return f"regional ({', '.join(denoiser._repeated_blocks)})"
    denoiser.compile(fullgraph=fullgraph, dynamic=dynamic)
    return "whole model"


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process (``counters['recompiles']`` is never written in torch 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------- attention backends

# Friendly names for diffusers' attention dispatcher backends, in the order they are tried.
ATTENTION_ALIASES = {
    "native": ["native"],
    "sdpa": ["native"],
    "fa3": ["_flash_3_hub", "_flash_3"],  # FlashAttention 3 from the `kernels` package, then a local build
    "flash": ["flash_hub", "flash"],
}


def set_attention_backend(denoiser: torch.nn.Module, wanted: str) -> str:
    """Switch the denoiser's attention through diffusers' dispatcher; fall back to native SDPA,
    with a log line, when the backend cannot be had here (no kernels package, no Hopper GPU, ...)."""
    candidates = ATTENTION_ALIASES.get(wanted, [wanted])
    for backend in candidates:
        try:
            denoiser.set_attention_backend(backend)
            if backend != "native":
                log.info("attention backend: %s", backend)
            return backend
        except (RuntimeError, ValueError, ImportError, OSError) as exc:
            log.warning("attention backend %s unavailable (%s)", backend, str(exc).splitlines()[0][:200])
    denoiser.set_attention_backend("native")
    log.warning("attention backend %r could not be used: falling back to native SDPA", wanted)
    return "native"


# ---------------------------------------------------------------------------- compile cache artifacts


def compile_artifacts_path(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    import hashlib

    digest = hashlib.sha256(f"{torch.__version__}|{fingerprint}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"compile-artifacts-{digest}.bin"


def untrusted_because(path: Path) -> str | None:
    """Why ``path`` may hold something another user wrote, or None. Compile artifacts are pickles:
    loading one runs whatever its writer put there, so only this process's user (or root) may have
    been able to write the file or the folder that holds it."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes to check (Windows)
        return None
    for place in (path.parent, path):
        if not place.exists():
            continue
        info = place.stat()
        if info.st_uid not in (os.getuid(), 0):
            return f"{place} belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{place} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def sweep_compile_cache(cache_dir: str | os.PathLike) -> int:
    """Start-up: remove the temporary files of writers that were killed (``hotlora.durable``)."""
    return sweep_orphans(Path(cache_dir), TMP)


def read_private(path: Path, what: str) -> bytes | None:
    """What ``write_private`` wrote, or None (with a log line) where it is absent, where another
    user could have written it (``untrusted_because``), or where it is not whole (cut short by a
    kill, or its checksum missing or different: deleted, so the next start does not meet it)."""
    if not path.is_file():
        return None
    reason = untrusted_because(path)
    if reason:
        log.warning("not using %s (only this user may write them): %s", what, reason)
        return None
    try:
        return read_verified(path, what)
    except OSError as exc:
        log.warning("cannot read %s at %s: %s", what, path, exc)
        return None


def load_compile_artifacts(path: Path) -> bool:
    """Pre-load the compiler's caches saved by an earlier process (``torch.compiler.load_cache_artifacts``),
    only from a whole file (its sha256 checked) in a file and folder no other user can write (see
    ``untrusted_because``): they are pickles."""
    data = read_private(path, "compile artifacts")
    if data is None:
        log.info("no usable compile artifacts at %s: compiling from scratch", path)
        return False
    try:
        torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # a stale or foreign file must not stop start-up
        log.warning("ignoring unusable compile artifacts %s: %s", path, exc)
        return False
    log.info("loaded compile artifacts from %s", path)
    return True


def save_compile_artifacts(path: Path) -> bool:
    """Save what warm-up compiled, atomically, for the next process on this machine or volume."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return False
    data, _info = saved
    return write_private(path, data, "compile artifacts")


def write_private(path: Path, data: bytes, what: str) -> bool:
    """Write ``data`` atomically and durably, with its sha256 beside it (``hotlora.durable``), into a
    folder no other user can write (the next process trusts it: ``untrusted_because``); False, with
    a warning, where another user could replace it or the disk refuses the write."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = untrusted_because(path)
    if reason:
        log.warning("not saving %s where another user could replace them: %s", what, reason)
        return False
    try:
        write_verified(path, data)
    except OSError as exc:  # a full or read-only volume costs the next start a compile, not this one its warm-up
        log.warning("could not save %s to %s: %s", what, path, exc)
        return False
    log.info("saved %d bytes of %s to %s", len(data), what, path)
    return True
