"""What a run gives back: one ``GenerationResult`` per request, made by ``build_result`` (the one
result builder), for the warm model's output kind (``IMAGES``: a batch of images on dim 0;
``FRAMES``: a batch of videos on dim 0, each a sequence of frames), the family's ``output_kind``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch

from hotlora.engine import guard
from hotlora.engine.request import Bindings, PreparedRequest, Timings
from hotlora.engine.writers import SwapReport

if TYPE_CHECKING:
    from hotlora.engine.warm import WarmModel


@dataclass(kw_only=True)
class GenerationResult:
    # list[PIL.Image] for "pil" (a video family: one list of frames per video), else one array or
    # tensor with the pack on dim 0
    images: Any
    seeds: list[int]
    timings: Timings
    swap: SwapReport
    adapters: dict[str, dict | None] = field(default_factory=dict)  # slot -> what was served
    recompiles: int = 0
    size: str = ""  # the size served, WIDTHxHEIGHT
    snapped_from: str | None = None  # the size asked for when the policy snapped it to ``size``
    # The inference defaults the request ran at because its adapters declared them:
    # parameter -> {"value": v, "slots": [...]} (``PreparedRequest.adapter_defaults``).
    adapter_defaults: dict = field(default_factory=dict)
    # A video model's sound track (LTX-2 makes one with every video): the pipeline's ``.audio`` for the
    # pack on dim 0 (float32 waveforms (videos, channels, samples) at ``audio_rate`` Hz, whatever the
    # model's dtype; its audio latents for "latent"); None where the model makes none.
    audio: Any = None
    audio_rate: int | None = None


class OutputKind(Protocol):
    """What a pipeline gives back, as the runner asks for it, joins its chunks and finishes it."""

    name: str
    attribute: str  # of the pipeline's output: ``.images``, ``.frames``
    per_prompt: str  # the pipeline's argument for samples per prompt

    def pipeline_output_type(self, output_type: str) -> str:
        """The ``output_type`` the pipeline is called with for a request's ``output_type``."""

    def join(self, pieces: Sequence) -> Any:
        """One request's chunks (the pipeline's outputs, sliced to its samples), in order, as one."""

    def finish(self, pipeline, output, output_type: str) -> Any:
        """What the request gets, after its output was checked finite."""


class Images:
    """A batch of images on dim 0. "pil" is asked of the pipeline as tensors (checked for NaN
    before anything is encoded) and made PIL last. "uint8" (what an engine process sends for
    "pil"): the same pixels as one (B, H, W, C) uint8 tensor, made PIL on the other side."""

    name, attribute, per_prompt = "images", "images", "num_images_per_prompt"

    def pipeline_output_type(self, output_type: str) -> str:
        return "pt" if output_type in ("pil", "uint8") else output_type

    def join(self, pieces: Sequence) -> Any:
        if isinstance(pieces[0], torch.Tensor):
            return torch.cat(list(pieces))
        if isinstance(pieces[0], list):
            return [image for piece in pieces for image in piece]
        import numpy as np

        return np.concatenate(pieces)

    def finish(self, pipeline, output, output_type: str) -> Any:
        if output_type == "pil":
            output = pipeline.image_processor.numpy_to_pil(pipeline.image_processor.pt_to_numpy(output))
        elif output_type == "uint8":
            # numpy_to_pil's own rounding, stopped before PIL: ``pil_images`` finishes it elsewhere.
            output = torch.from_numpy((pipeline.image_processor.pt_to_numpy(output) * 255).round().astype("uint8"))
        return output


class Frames(Images):
    """A batch of videos on dim 0, as video pipelines return them (``.frames``). "pt": (B, T, C, H, W)
    in [0, 1] (diffusers' ``postprocess_video``), "np" (B, T, H, W, C), "latent" the latents; "pil" is
    asked as "pt" (checked for NaN first) and made one list of PIL frames per video; "uint8" (what an
    engine process sends for "pil"): the same pixels as one (B, T, H, W, C) uint8 tensor. Chunks join
    on dim 0 as images do."""

    name, attribute, per_prompt = "frames", "frames", "num_videos_per_prompt"

    def finish(self, pipeline, output, output_type: str) -> Any:
        if output_type not in ("pil", "uint8"):
            return output
        processor = pipeline.video_processor
        if output_type == "pil":
            return [processor.numpy_to_pil(processor.pt_to_numpy(video)) for video in output]
        return torch.stack([torch.from_numpy((processor.pt_to_numpy(video) * 255).round().astype("uint8"))
                            for video in output])


def pil_images(pixels) -> list:
    """A (B, H, W, C) uint8 batch as PIL images, as diffusers' ``numpy_to_pil`` makes them; a
    (B, T, H, W, C) batch of videos as one list of frames per video."""
    from PIL import Image

    array = pixels.numpy() if isinstance(pixels, torch.Tensor) else pixels
    if array.ndim == 5:
        return [pil_images(video) for video in array]
    if array.shape[-1] == 1:
        return [Image.fromarray(image.squeeze(), mode="L") for image in array]
    return [Image.fromarray(image) for image in array]


IMAGES = Images()
FRAMES = Frames()
OUTPUT_KINDS: dict[str, OutputKind] = {kind.name: kind for kind in (IMAGES, FRAMES)}


def output_kind(family) -> OutputKind:
    """The output kind a family's pipeline makes (``ModelFamily.output_kind``)."""
    return OUTPUT_KINDS[family.output_kind]


def build_result(warm: WarmModel, request: PreparedRequest, output, ran: Timings, swap: SwapReport,
                 began: float, audio=None) -> GenerationResult:
    """A request's result: its ``output`` (joined, checked) finished for its output type; its timings
    (``ran``: the chunks it ran in; swap time includes the text encoders'; total from ``began``
    plus its preparation); what each slot's adapter was served as."""
    images = warm.output.finish(warm.pipeline, output, request.output_type)
    timings = replace(request.timings, swap_ms=swap.ms + swap.text_ms, generate_ms=ran.generate_ms,
                      decode_ms=ran.decode_ms, chunks=ran.chunks)
    timings.total_ms = timings.resolve_ms + (time.perf_counter() - began) * 1000
    served = served_adapters(request.adapters, warm.text.lora_encoders, swap.fused, warm.path)
    return GenerationResult(images=images, seeds=request.seeds, timings=timings, swap=swap, adapters=served,
                            recompiles=warm.recompiles, size=request.size, snapped_from=request.snapped_from,
                            adapter_defaults=dict(request.adapter_defaults), audio=audio,
                            audio_rate=warm.audio_rate if audio is not None else None)


def served_adapters(bindings: Bindings, text_encoders=(), fused: Mapping[str, dict] | None = None,
                    path: str = "slots") -> dict:
    """What a response reports about each slot's adapter: ``mode``, the path that served it
    (``fused``: merged into the weights; ``slots``: unfused LoRA branches, slots or banks; auto
    mode's writer says which per request, else the engine's ``path``); in fused and auto mode also
    ``fused_kept``, the fraction of the request's weight delta the merge carries (``FusedWriter._kept``;
    auto mode, served through the slots: what it would have carried, the reason it was not fused)."""
    fused = fused or {}
    return {slot: {"sha256": a.sha256, "layout": a.layout, "rank": a.rank, "scale": scale, "name": a.name,
                   "text_encoders": sorted(te for te in a.text_modules if te in text_encoders),
                   "embedding_tokens": list(a.embeddings.tokens) if a.embeddings is not None else [],
                   "skipped": guard.skipped(a, text_encoders), "mode": fused.get(slot, {}).get("mode", path),
                   **({"fused_kept": fused[slot]["kept"]} if "kept" in fused.get(slot, {}) else {})}
            for slot, (a, scale) in bindings.items()}
