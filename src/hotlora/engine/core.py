"""The warm engine: one compiled pipeline, adapter slots, one pack per ``generate`` call."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from hotlora.adapters.families import Family
from hotlora.adapters.formats import Adapter
from hotlora.adapters.resolver import AdapterResolver
from hotlora.engine.pipeline import (
    compile_artifacts_path,
    compile_denoiser,
    default_device,
    default_dtype,
    graph_count,
    load_compile_artifacts,
    load_pipeline,
    save_compile_artifacts,
    set_attention_backend,
)
from hotlora.engine.bank import AdapterBank
from hotlora.engine.runner import Timings, image_generators, run_pack, step_callback, synchronize
from hotlora.engine.slots import SlotBank, SwapReport
from hotlora.engine.stepcache import StepCache, apply_step_cache
from hotlora.config import RequestLimits
from hotlora.errors import EngineError, HotloraError, InvalidRequest, RequestTooLarge

log = logging.getLogger(__name__)

# A model directory may carry this file to suggest serving defaults (the tiny models do: their
# pipelines' own defaults would be far too large an image for them).
DEFAULTS_FILE = "hotlora.json"
FAMILY_DEFAULTS = {
    "flux": {"num_inference_steps": 28, "guidance_scale": 3.5},
    "sdxl": {"num_inference_steps": 30, "guidance_scale": 5.0},
}
OUTPUT_TYPES = ("pil", "latent", "pt", "np")
MAX_IMAGES = RequestLimits.max_images
MAX_STEPS = RequestLimits.max_steps
MAX_PROMPT_CHARS = 10_000  # prompts are truncated to the text encoders' length anyway


class UnservedShape(InvalidRequest):
    """A request the warm engine has no compiled graph for: serving it would start a compile
    (tens of seconds on a GPU, the queue waiting), so it is refused instead."""


class NonFiniteOutput(InvalidRequest):
    """The pack came out NaN/inf with this request's adapters while every base weight is finite:
    the adapters (or their scales) overflowed it. The caller's fault; the engine stays warm."""


@dataclass
class PackRequest:
    """One request's part of a mixed batch."""

    prompt: str
    adapters: Mapping[str, Any] | None = None
    num_images: int = 1
    seed: int = 0
    negative_prompt: str | None = None


@dataclass
class GenerationResult:
    images: Any  # list[PIL.Image] for "pil", else one array/tensor with the pack on dim 0
    seeds: list[int]
    timings: Timings
    swap: SwapReport
    adapters: dict[str, dict | None] = field(default_factory=dict)  # slot -> what was served
    recompiles: int = 0


class Engine:
    """A warm, compiled Flux or SDXL pipeline whose adapter slots are rewritten per request."""

    def __init__(self, pipeline, family: Family, *, slots=("identity", "style"), target_rank: int = 16,
                 target_modules=None, batch_size: int = 6, compile: bool = True, height: int | None = None,
                 width: int | None = None, defaults: Mapping | None = None, model: str | None = None,
                 store=None, mixed: bool = False, bank_entries: int | None = None, attention_backend: str = "native",
                 compile_cache_dir: str | os.PathLike | None = None, step_cache: StepCache | None = None,
                 rank_buckets: Sequence[int] = (), limits: RequestLimits | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.pipeline = pipeline
        self.family = family
        self.model = model
        self.batch_size = batch_size
        self.compiled = compile
        self.limits = limits or RequestLimits()
        self.denoiser = getattr(pipeline, family.denoiser)
        self.defaults = {**FAMILY_DEFAULTS[family.name], **(defaults or {})}
        self.height = height or self.defaults.get("height") or self._pipeline_default_size()
        self.width = width or self.defaults.get("width") or self._pipeline_default_size()
        served = [model, Path(model).name if model else None, self.defaults.get("model_id"),
                  *self.defaults.get("base_model_aliases", [])]
        self.mixed = mixed
        if mixed and rank_buckets:
            raise ValueError("rank buckets apply to the slots of single-request packs, not to mixed batches")
        if mixed:  # per-sample adapters in one forward pass (see engine/bank.py)
            self.slots = AdapterBank(self.denoiser, family.name, slots, target_rank, target_modules, served,
                                     entries=bank_entries or 2 * batch_size + 1, max_batch=2 * batch_size)
        else:
            self.slots = SlotBank(self.denoiser, family.name, slots, target_rank, target_modules, served_models=served,
                                  rank_buckets=rank_buckets)
        config = self.denoiser.config if family.name == "sdxl" else None
        self.resolver = AdapterResolver(self.slots.slot_names, self.slots.ceiling, family, _make_store(store, family, config),
                                        denoiser_config=config, layout=getattr(self.slots, "layout", None),
                                        max_scale=self.limits.max_scale, serving_dtype=self.denoiser.dtype)
        self._lock = threading.Lock()  # one pack at a time: slots are shared state
        self._recompiles = 0
        self.compile_mode = None
        self.warmup_s = 0.0
        self.compile_artifacts_loaded = False
        self.attention_backend = set_attention_backend(self.denoiser, attention_backend)
        artifacts = None
        if compile and compile_cache_dir is not None:
            fingerprint = f"{model}|{family.name}|{slots}|{target_rank}|{target_modules}|{batch_size}|{mixed}|" \
                          f"{self.height}x{self.width}|{self.attention_backend}|{self.denoiser.dtype}|{step_cache}|" \
                          f"{self.rank_buckets}"
            artifacts = compile_artifacts_path(compile_cache_dir, fingerprint)
            self.compile_artifacts_loaded = load_compile_artifacts(artifacts)
        if len(self.rank_buckets) > 1:
            # Each bucket is another set of graphs for the same blocks; dynamo's default of 8 per
            # code object covers the batch and CFG variants of one.
            per_bucket = 8
            needed = per_bucket * len(self.rank_buckets)
            if torch._dynamo.config.recompile_limit < needed:
                log.info("rank buckets %s: dynamo recompile_limit raised to %d", self.rank_buckets, needed)
                torch._dynamo.config.recompile_limit = needed
        self.step_cache = step_cache
        if step_cache is not None:  # installed before compile: the compiled blocks include it
            apply_step_cache(pipeline, self.denoiser, step_cache)
        if compile:
            self.compile_mode = compile_denoiser(self.denoiser, family,
                                                 fullgraph=step_cache.fullgraph if step_cache else True)
        self._warm_up()
        if artifacts is not None and not self.compile_artifacts_loaded:
            save_compile_artifacts(artifacts)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, *, slots=("identity", "style"), target_rank: int = 16,
                        target_modules=None, batch_size: int = 6, compile: bool = True, dtype=None,
                        device: str | None = None, height: int | None = None, width: int | None = None,
                        store=None, mixed: bool = False, bank_entries: int | None = None,
                        attention_backend: str = "native", compile_cache_dir=None,
                        step_cache: StepCache | None = None, rank_buckets: Sequence[int] = (),
                        limits: RequestLimits | None = None) -> "Engine":
        """Load ``model`` (a local directory or a hub id) and make it warm: slots, compile, warm-up."""
        device = device or default_device()
        dtype = dtype or default_dtype(device)
        pipeline, family = load_pipeline(model, dtype=dtype, device=device)
        defaults = _read_defaults(model)
        return cls(pipeline, family, slots=slots, target_rank=target_rank, target_modules=target_modules,
                   batch_size=batch_size, compile=compile, height=height, width=width, defaults=defaults,
                   model=str(model), store=store, mixed=mixed, bank_entries=bank_entries,
                   attention_backend=attention_backend, compile_cache_dir=compile_cache_dir, step_cache=step_cache,
                   rank_buckets=rank_buckets, limits=limits)

    def _pipeline_default_size(self) -> int:
        return int(self.pipeline.default_sample_size * self.pipeline.vae_scale_factor)

    def _warm_up(self) -> None:
        """Run every batch shape steady state will see, so no request compiles.

        Batch 1 specializes differently from larger batches, and the second distinct size turns
        the batch dimension dynamic; the pack size and a size in between cover every last chunk.
        """
        sizes = sorted({1, self.batch_size, max(1, self.batch_size - 1)})
        guidance = [self.defaults["guidance_scale"]]
        if self.family.name == "sdxl":
            guidance.append(1.0)  # SDXL without CFG runs a batch half as big
        began = time.perf_counter()
        for bucket in reversed(self.rank_buckets):  # each rank bucket is its own set of shapes
            if bucket is not None:
                self.slots.use_bucket(bucket)
            for scale in guidance:
                for size in sizes:
                    log.info("warm-up: batch %d, guidance %.1f, rank bucket %s (%s)", size, scale, bucket,
                             self.compile_mode or "eager")
                    self.pipeline(prompt="warm-up", num_images_per_prompt=size, num_inference_steps=2,
                                  guidance_scale=scale, height=self.height, width=self.width,
                                  generator=[torch.Generator().manual_seed(i) for i in range(size)],
                                  output_type="latent")
        self.warmup_s = time.perf_counter() - began
        log.info("warm: %.1fs, %d graphs compiled, %s", self.warmup_s, graph_count(), self.compile_mode or "eager")

    # ------------------------------------------------------------------ state

    @property
    def recompiles(self) -> int:
        """New dynamo graphs compiled by this engine's requests since warm-up. Must stay 0."""
        return self._recompiles

    @property
    def ceiling(self):
        return self.slots.ceiling

    @property
    def rank_buckets(self) -> tuple:
        """The ranks compiled for (SlotBank.rank_buckets); (None,) for the mixed-batch bank."""
        return getattr(self.slots, "rank_buckets", (None,))

    def describe(self) -> dict:
        return {
            "model": self.model, "family": self.family.name, "slots": list(self.slots.slot_names),
            "target_rank": self.ceiling.target_rank, "ceiling_modules": len(self.ceiling.modules),
            "batch_size": self.batch_size, "height": self.height, "width": self.width,
            "compile": self.compile_mode, "warmup_s": round(self.warmup_s, 2), "recompiles": self.recompiles,
            "mixed": self.mixed, "attention_backend": self.attention_backend,
            "step_cache": self.step_cache.backend if self.step_cache else None,
            "slot_bytes": self.slots.nbytes, "rank_buckets": [b for b in self.rank_buckets if b is not None],
            "sizes": [f"{w}x{h}" for h, w in self.served_sizes], "limits": dict(self.limits.__dict__),
        }

    @property
    def served_sizes(self) -> list[tuple[int, int]]:
        """(height, width) pairs a request may ask for without compiling (the warm-up's)."""
        return [(self.height, self.width)]

    # ------------------------------------------------------------------ adapters

    @property
    def store(self):
        return self.resolver.store

    @store.setter
    def store(self, store) -> None:
        self.resolver.store = store

    def load_adapter(self, source, name: str | None = None) -> Adapter:
        """Read and convert an adapter for this engine's family (no validation against the slots)."""
        return self.resolver.load(source, name)

    def resolve(self, adapters: Mapping[str, Any] | None) -> dict[str, tuple[Adapter, float]]:
        """A request's ``{slot: spec}`` as checked adapters; raises before touching any weight."""
        return self.resolver.resolve(adapters)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: str, *, adapters: Mapping[str, Any] | None = None, num_images: int = 1,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 height: int | None = None, width: int | None = None, seed: int = 0, output_type: str = "pil",
                 negative_prompt: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> GenerationResult:
        """One pack. ``progress(done, total)`` is called after each denoising step (all chunks)."""
        began = time.perf_counter()
        timings = Timings()
        call_kwargs = self.check_request(prompt, num_images, num_inference_steps, guidance_scale, height, width,
                                         seed, output_type, negative_prompt)
        resolved = self.resolve(adapters)
        timings.resolve_ms = (time.perf_counter() - began) * 1000
        with self._engine_section():
            if self.mixed:  # every sample of every chunk selects this request's bank entries
                swap = SwapReport()

                def select(size: int) -> None:
                    report = self.slots.assign([resolved] * size, repeat=self._batch_factor(call_kwargs))
                    swap.ms += report.ms
                    swap.adapters = report.adapters
            else:
                swap, select = self.slots.swap(resolved), None
            images = run_pack(self.pipeline, prompt=prompt, num_images=num_images, batch_size=self.batch_size,
                              seed=seed, output_type="pt" if output_type == "pil" else output_type,
                              call_kwargs=call_kwargs, timings=timings, progress=progress,
                              before_chunk=select)
            timings.swap_ms = swap.ms
            self._check_finite(images, resolved)
        images = self._finish(images, output_type)
        timings.total_ms = (time.perf_counter() - began) * 1000
        return GenerationResult(images=images, seeds=[seed + i for i in range(num_images)], timings=timings,
                                swap=swap, adapters=_served(resolved), recompiles=self.recompiles)

    @contextmanager
    def _engine_section(self):
        """One pack at a time on the shared slots; graphs compiled inside are counted; anything
        unexpected raised inside is an engine fault (EngineError: the worker rebuilds).

        A compiled engine runs requests with dynamo's ``fail_on_recompile`` stance: whatever
        ``check_request`` did not foresee, no request ever starts a compile; it is refused."""
        stance = torch.compiler.set_stance("fail_on_recompile") if self.compile_mode else nullcontext()
        with self._lock:
            graphs_before = graph_count()
            try:
                self.slots.check_intact()
                with stance:
                    yield
            except HotloraError:
                raise
            except RuntimeError as exc:
                if "Detected recompile" in str(exc):
                    raise UnservedShape("this request would compile a new graph on the warm engine; refused "
                                        f"(served sizes: {self._sizes_text()})") from exc
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            finally:
                self._recompiles += graph_count() - graphs_before

    def _check_finite(self, images, resolved: Mapping[str, tuple[Adapter, float]]) -> None:
        """Non-finite output is the request's fault when it carried adapters and every base weight
        is still finite (its adapters or scales overflowed the pack: 422, the engine stays warm);
        otherwise the engine is corrupt (EngineError: rebuild). The weight scan runs on failures only."""
        if _all_finite(images):
            return
        if resolved and self._base_weights_finite():
            served = ", ".join(f"{slot}={a.name} at scale {scale:g}" for slot, (a, scale) in resolved.items())
            raise NonFiniteOutput(f"the images came out non-finite (NaN/inf) with {served}; the base model is "
                                  "intact: lower the scale or check the adapter's weights")
        raise EngineError("the denoiser produced non-finite values")

    def _base_weights_finite(self) -> bool:
        """Every weight of every model in the pipeline, the slots' own LoRA weights excluded."""
        for component in self.pipeline.components.values():
            if isinstance(component, torch.nn.Module):
                for name, tensor in [*component.named_parameters(), *component.named_buffers()]:
                    if "lora_" not in name and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        log.error("base weight %s is not finite", name)
                        return False
        return True

    def _sizes_text(self) -> str:
        return ", ".join(f"{w}x{h}" for h, w in self.served_sizes)

    def _finish(self, images, output_type: str):
        """Encode PIL (finiteness was checked inside the engine section)."""
        if output_type == "pil":
            images = self.pipeline.image_processor.numpy_to_pil(self.pipeline.image_processor.pt_to_numpy(images))
        return images

    def generate_batch(self, requests: Sequence[PackRequest], *, num_inference_steps: int | None = None,
                       guidance_scale: float | None = None, height: int | None = None, width: int | None = None,
                       output_type: str = "pil",
                       progress: Callable[[int, int], None] | None = None) -> list[GenerationResult | HotloraError]:
        """Several requests, each with its own adapters, in ONE forward batch (mixed engines only).

        The requests share the denoising parameters; their images together fit the compiled batch.
        Image j of request r is drawn from ``r.seed + j``, exactly as in a request of its own.
        A request whose own adapters overflowed its images gets its NonFiniteOutput in its place
        in the list; the others get their results.
        """
        if not self.mixed:
            raise InvalidRequest("generate_batch needs an engine built with mixed=True")
        began = time.perf_counter()
        total = sum(r.num_images for r in requests)
        if not requests or total > self.batch_size:
            raise InvalidRequest(f"a mixed batch holds 1..{self.batch_size} images, got {total}")
        call_kwargs = [self.check_request(r.prompt, r.num_images, num_inference_steps, guidance_scale, height, width,
                                          r.seed, output_type, r.negative_prompt) for r in requests]
        resolved = [self.resolve(r.adapters) for r in requests]
        resolve_ms = (time.perf_counter() - began) * 1000
        prompts = [r.prompt for r in requests for _ in range(r.num_images)]
        negatives = [r.negative_prompt for r in requests for _ in range(r.num_images)]
        generators = [g for r in requests for g in image_generators(r.seed, 0, r.num_images)]
        shared = dict(call_kwargs[0])
        shared.pop("negative_prompt", None)
        if any(n is not None for n in negatives):
            shared["negative_prompt"] = [n or "" for n in negatives]
        with self._engine_section():
            swap = self.slots.assign([resolved[i] for i, r in enumerate(requests) for _ in range(r.num_images)],
                                     repeat=self._batch_factor(shared))
            step_began = time.perf_counter()
            extra = {}
            if progress is not None:
                extra["callback_on_step_end"] = step_callback(progress, 0, shared["num_inference_steps"])
            images = self.pipeline(prompt=prompts, num_images_per_prompt=1, generator=generators,
                                   output_type="pt" if output_type == "pil" else output_type, **shared,
                                   **extra).images
            synchronize(self.pipeline.device)
            generate_ms = (time.perf_counter() - step_began) * 1000
            # Samples are independent: a request whose adapters overflowed fails alone.
            bounds = [sum(r.num_images for r in requests[:i]) for i in range(len(requests) + 1)]
            refused: dict[int, HotloraError] = {}
            for i, adapters in enumerate(resolved):
                try:
                    self._check_finite(images[bounds[i]:bounds[i + 1]], adapters)
                except NonFiniteOutput as exc:
                    refused[i] = exc
        results = []
        for i, (request, adapters) in enumerate(zip(requests, resolved)):
            if i in refused:
                results.append(refused[i])
                continue
            part = self._finish(images[bounds[i]:bounds[i + 1]], output_type)
            timings = Timings(resolve_ms=resolve_ms, swap_ms=swap.ms, generate_ms=[generate_ms],
                              total_ms=(time.perf_counter() - began) * 1000)
            results.append(GenerationResult(images=part, seeds=[request.seed + i for i in range(request.num_images)],
                                            timings=timings, swap=swap, adapters=_served(adapters),
                                            recompiles=self.recompiles))
        return results

    def _batch_factor(self, call_kwargs: Mapping) -> int:
        """SDXL runs classifier-free guidance as one doubled batch [uncond..., cond...]."""
        return 2 if self.family.name == "sdxl" and call_kwargs["guidance_scale"] > 1 else 1

    def check_request(self, prompt, num_images=1, steps=None, guidance=None, height=None, width=None, seed=0,
                      output_type="pil", negative_prompt=None) -> dict:
        """Check generation parameters (all problems at once); returns the pipeline call kwargs."""
        problems = []
        limits = self.limits
        for label, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
            if isinstance(text, str) and len(text) > MAX_PROMPT_CHARS:
                raise RequestTooLarge(f"{label} has {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
        if not isinstance(prompt, str) or not prompt.strip():
            problems.append("prompt must be a non-empty string")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            problems.append("negative_prompt must be a string")
        if not (isinstance(num_images, int) and 1 <= num_images <= limits.max_images):
            problems.append(f"num_images must be an integer in 1..{limits.max_images}")
        steps = self.defaults["num_inference_steps"] if steps is None else steps
        if not (isinstance(steps, int) and 1 <= steps <= limits.max_steps):
            problems.append(f"num_inference_steps must be an integer in 1..{limits.max_steps}")
        guidance = self.defaults["guidance_scale"] if guidance is None else guidance
        if not (isinstance(guidance, (int, float)) and math.isfinite(guidance) and 0 <= guidance <= 50):
            problems.append("guidance_scale must be a finite number in 0..50")
        height, width = height or self.height, width or self.width
        multiple = self.pipeline.vae_scale_factor * 2
        for label, value in (("height", height), ("width", width)):
            if not (isinstance(value, int) and 0 < value <= 4096 and value % multiple == 0):
                problems.append(f"{label} must be a positive multiple of {multiple} up to 4096")
        if not (isinstance(seed, int) and 0 <= seed < 2**63 - MAX_IMAGES):
            problems.append("seed must be a non-negative integer")
        if output_type not in OUTPUT_TYPES:
            problems.append(f"output_type must be one of {', '.join(OUTPUT_TYPES)}")
        if negative_prompt is not None and self.family.name != "sdxl":
            problems.append(f"negative_prompt is not supported by the {self.family.name} family")
        if problems:
            raise InvalidRequest("; ".join(problems))
        work = height * width * num_images * steps
        if work > limits.max_work:
            raise RequestTooLarge(
                f"the request asks for {work:,} pixel-steps (height x width x images x steps = {height} x {width} x "
                f"{num_images} x {steps}); the limit is {limits.max_work:,}")
        if self.compile_mode and (height, width) not in self.served_sizes:
            # Until the engine serves a size set, any other size would compile new graphs.
            raise UnservedShape(f"size {width}x{height} (width x height) is not served by this warm engine; "
                                f"served sizes: {self._sizes_text()}")
        kwargs = {"num_inference_steps": steps, "guidance_scale": float(guidance), "height": height, "width": width}
        if negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
        return kwargs


def _served(resolved: Mapping[str, tuple[Adapter, float]]) -> dict:
    """What a response reports about each slot's adapter."""
    return {slot: {"sha256": a.sha256, "layout": a.layout, "rank": a.rank, "scale": scale, "name": a.name,
                   "skipped": _skipped(a)}
            for slot, (a, scale) in resolved.items()}


def _skipped(adapter: Adapter) -> dict | None:
    """What of the adapter's file this engine does not apply (text-encoder keys, until text-encoder
    slots exist), so a caller sees it in the response, not only in the server's log."""
    if not adapter.skipped_keys:
        return None
    parts = sorted({key.split(".", 1)[0] for key in adapter.skipped_keys})
    return {"keys": len(adapter.skipped_keys), "parts": parts,
            "reason": "text-encoder LoRA weights are not applied by this engine (its slots are on the denoiser)"}


def _make_store(store, family: Family, denoiser_config):
    """``store``: an AdapterStore, a StoreConfig to build one from, or None (paths and state dicts only)."""
    from hotlora.adapters.store import AdapterStore
    from hotlora.config import StoreConfig

    if isinstance(store, StoreConfig):
        return AdapterStore(store, family, denoiser_config=denoiser_config)
    return store


def _all_finite(images) -> bool:
    if isinstance(images, torch.Tensor):
        return bool(torch.isfinite(images).all())
    import numpy as np

    return bool(np.isfinite(images).all())


def _read_defaults(model) -> dict:
    path = Path(str(model)) / DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise EngineError(f"{path}: unreadable serving defaults ({exc})") from exc
