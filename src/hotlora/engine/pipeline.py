"""Build the warm pipeline: load through ``from_pretrained``, pick device and dtype, compile."""

from __future__ import annotations

import logging
import os

import torch

from hotlora.adapters.families import Family, family_of_pipeline
from hotlora.errors import HotloraError

log = logging.getLogger(__name__)


class ModelLoadError(HotloraError):
    """The model could not be loaded (start-up fault: neither a request nor a warm-engine error)."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    # bf16 is what production Flux/SDXL run in on GPUs; CPUs are for tests, where exactness matters.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_pipeline(model: str | os.PathLike, *, dtype: torch.dtype, device: str):
    """Load a Flux or SDXL pipeline from a local directory or a hub id (``from_pretrained``)."""
    from diffusers import DiffusionPipeline

    model = str(model)
    local = os.path.isdir(model)
    log.info("loading %s (%s) as %s on %s", model, "local directory" if local else "hub id", dtype, device)
    try:
        pipeline = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype, local_files_only=local or None)
    except Exception as exc:  # diffusers and huggingface_hub raise many types; the message is what matters
        raise ModelLoadError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc
    family = family_of_pipeline(pipeline)
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, family


def compile_denoiser(denoiser: torch.nn.Module, family: Family, fullgraph: bool = True) -> str:
    """Regional compilation where the model declares repeated blocks, whole-model otherwise."""
    if getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(fullgraph=fullgraph)
        return f"regional ({', '.join(denoiser._repeated_blocks)})"
    denoiser.compile(fullgraph=fullgraph)
    return "whole model"


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process (``counters['recompiles']`` is never written in torch 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
