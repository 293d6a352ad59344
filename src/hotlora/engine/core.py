"""The warm engine: one compiled pipeline, one adapter writer; ``prepare`` a request once, ``run`` it once.

    Engine.check(r)      parameters, slots and scales checked, no I/O -> CheckedRequest
    Engine.prepare(r)    on the request's thread: adapters validated (the server's service hands
                         over what it fetched; the Python API's are loaded here) and prepared for
                         the writers -> PreparedRequest
    Engine.run(p | [p])  on the serving thread: writer.bind per chunk, denoise, check the output
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from hotlora.families import ModelFamily
from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.resolver import AdapterResolver
from hotlora.settings import EngineConfig, StoreConfig, format_size, read_model_defaults
from hotlora.engine import guard
from hotlora.engine.guard import NonFiniteOutput
from hotlora.engine.device import default_device, synchronize
from hotlora.engine.pipeline import (
    compile_artifacts_path, compile_denoiser, resolve_dtype, graph_count, load_compile_artifacts,
    load_pipeline, save_compile_artifacts, set_attention_backend,
)
from hotlora.engine.request import (
    Bindings, CallParams, CheckedRequest, GenerationRequest, PreparedRequest, RequestRules, Timings, UnservedShape,
)
from hotlora.engine.results import GenerationResult, finish_images, served_adapters as _served
from hotlora.engine.runner import DenoiseClock, fan_out, image_generators, run_pack, split_chunk
from hotlora.engine.stepcache import apply_step_cache
from hotlora.engine.warmup import chunk_key, measured_chunks, warm_up
from hotlora.engine.prompts import batch_prompts
from hotlora.engine.quantize import check_quantization, quantize_denoiser, weight_bytes
from hotlora.engine.writers import AdapterWriter, SwapReport, TextWriter, install_text_writer, install_writer
from hotlora.errors import EngineError, HotloraError, InvalidRequest
from hotlora.tracing import together

log = logging.getLogger(__name__)

RECOMPILES_PER_STATE = 8  # dynamo's default recompile limit covers the batch and CFG variants of one state
_GRAPHS_ALLOTTED = [0]  # graphs the compiled engines of this process were allowed


class Engine:
    """A warm, compiled pipeline of a registered family whose adapter writer is rewritten per request."""

    def __init__(self, pipeline, family: ModelFamily, config: EngineConfig | None = None, *, model: str | None = None,
                 defaults: Mapping | None = None, store=None, **options):
        self.config = config = (config or EngineConfig()).replace(**options)
        self.pipeline, self.family, self.model = pipeline, family, model
        self.batch_size = config.batch_limit  # compiled for batches up to this; packs chunk by ``chunk_for``
        self.chunks: dict[str, dict] = {}  # batch_size="auto": the measured choice per size and CFG mode
        self.limits = config.limits
        self.denoiser = getattr(pipeline, family.denoiser)
        self.defaults = {**family.defaults, **(defaults or {})}
        size_multiple = family.size_multiple(self.pipeline.vae_scale_factor)
        sizes = self._served_sizes(config, size_multiple)
        self.height, self.width = sizes[0]  # the default size
        served = [model, Path(model).name if model else None, self.defaults.get("model_id"),
                  *self.defaults.get("base_model_aliases", [])]
        self.quantization = quantize_denoiser(self.denoiser, config.base_quantization)  # before LoRA and compile
        self.denoiser_bytes = weight_bytes(self.denoiser)  # the base weights, as stored
        self.writer: AdapterWriter = install_writer(config, self.denoiser, family.name, served)
        # The text encoders' side (LoRA merged in, embeddings in reserved rows), before any compile.
        self.text: TextWriter = install_text_writer(config, pipeline, family, self.writer.slot_names)
        self.resolver = AdapterResolver(self.writer.slot_names, self.writer.ceiling, family, store,
                                        denoiser_config=family.converter_config(self.denoiser), max_scale=self.limits.max_scale,
                                        serving_dtype=self.denoiser.dtype, text_problems=self.text.problems)
        self._lock = threading.Lock()  # one pack at a time: the writer's tensors are shared state
        self._recompiles, self.compile_mode = 0, None
        self.active_adapters = 0  # distinct adapters bound by the last forward batch (a gauge for metrics)
        self.warmup_s, self.compile_artifacts_loaded = 0.0, False
        self.attention_backend = set_attention_backend(self.denoiser, config.attention_backend)
        self.step_cache = config.step_cache
        # A compiled engine serves only the sizes it warmed up at; an eager one any multiple, or its sizes.
        self.rules = RequestRules(family, self.defaults, self.limits, sizes, size_multiple,
                                  sizes_only=config.compile or bool(config.sizes), size_policy=config.size_policy)
        self.dynamic_sizes = family.dynamic_sizes if len(sizes) > 1 else None
        self._make_warm()

    def _served_sizes(self, config: EngineConfig, multiple: int) -> tuple[tuple[int, int], ...]:
        """The (height, width) sizes served, the default first (see ``EngineConfig.sizes``)."""
        default = (config.height or self.defaults.get("height") or self._pipeline_default_size(),
                   config.width or self.defaults.get("width") or self._pipeline_default_size())
        sizes = config.sizes or (default,)
        if config.sizes and (config.height or config.width):
            if default not in sizes:
                raise ValueError(f"the default size {format_size(*default)} (height, width) is not one of the "
                                 f"sizes {', '.join(format_size(*s) for s in sizes)}")
            sizes = (default, *(s for s in sizes if s != default))
        wrong = [format_size(*s) for s in sizes if s[0] % multiple or s[1] % multiple]
        if wrong:
            raise ValueError(f"sizes {', '.join(wrong)}: height and width must be multiples of {multiple} "
                             f"for this model (VAE factor x patch size)")
        return tuple(sizes)

    def _make_warm(self) -> None:
        config, artifacts = self.config, None
        fingerprint = None if config.compile_cache_dir is None else config.fingerprint(  # artifacts, chunk sizes
            self.model, self.family.name, sizes=self.served_sizes, dynamic_sizes=self.dynamic_sizes,
            attention=self.attention_backend, dtype=str(self.denoiser.dtype))
        if config.compile and fingerprint is not None:
            artifacts = compile_artifacts_path(config.compile_cache_dir, fingerprint)
            self.compile_artifacts_loaded = load_compile_artifacts(artifacts)
        states = len(self.writer.warmup_states())
        # Graphs per (state, size): one state's batch and CFG variants (dynamo's default limit, 8). Dynamic
        # sizes: the first size compiles static graphs, the second dynamic ones every later size reuses.
        sizes = len(self.served_sizes)
        graph_sizes = min(sizes, 2) if self.dynamic_sizes else sizes
        # Every compiled engine of a process adds graphs to the blocks' shared code objects: cover them all.
        needed = _GRAPHS_ALLOTTED[0] = _GRAPHS_ALLOTTED[0] + RECOMPILES_PER_STATE * states * graph_sizes
        if config.compile and torch._dynamo.config.recompile_limit < needed:
            log.info("%d writer states x %d sizes: dynamo recompile_limit raised to %d", states, sizes, needed)
            torch._dynamo.config.recompile_limit = needed
        if self.step_cache is not None:  # installed before compile: the compiled blocks include it
            apply_step_cache(self.pipeline, self.denoiser, self.step_cache)
        if config.compile:
            fullgraph = self.step_cache.fullgraph if self.step_cache else True
            self.compile_mode = compile_denoiser(self.denoiser, self.family, fullgraph=fullgraph,
                                                 dynamic=False if self.dynamic_sizes is False else None)
        warm_up(self)
        if config.batch_size == "auto":  # the chunk size per size and CFG mode, measured (warmup.py)
            self.chunks = measured_chunks(self, fingerprint)
        if artifacts is not None and not self.compile_artifacts_loaded:
            save_compile_artifacts(artifacts)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, config: EngineConfig | None = None, *, store=None,
                        **options) -> "Engine":
        """Load ``model`` (a local directory or a hub id) and make it warm: writer, compile, warm-up.
        ``options`` are ``EngineConfig`` fields. ``store``: for the Python API, where adapters named by
        reference (and catalog default scales) come from when ``prepare`` is given none fetched: an
        AdapterStore, or a StoreConfig to build one. The server passes none: its service owns the
        store and hands each request's fetched adapters to ``prepare``."""
        config = (config or EngineConfig()).replace(**options)
        device = config.device or default_device()
        check_quantization(config.base_quantization, device)  # before loading: float8 needs CUDA
        dtype = resolve_dtype(config.dtype, device)
        pipeline, family = load_pipeline(model, dtype=dtype, device=device)
        if isinstance(store, StoreConfig):
            from hotlora.adapters.store import AdapterStore

            store = AdapterStore(store, family, denoiser_config=family.converter_config(getattr(pipeline, family.denoiser)))
        return cls(pipeline, family, config, model=str(model), defaults=read_model_defaults(model), store=store)

    def _pipeline_default_size(self) -> int:
        return int(self.pipeline.default_sample_size * self.pipeline.vae_scale_factor)

    # ------------------------------------------------------------------ state

    @property
    def recompiles(self) -> int:
        """New dynamo graphs compiled by this engine's requests since warm-up. Must stay 0."""
        return self._recompiles

    @property
    def ceiling(self):
        return self.writer.ceiling

    @property
    def served_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) pairs a request may ask for without compiling (the warm-up's)."""
        return self.rules.sizes

    def describe(self) -> dict:
        writer = self.writer.describe()
        return {
            "model": self.model, "family": self.family.name, "slots": list(self.writer.slot_names),
            "target_rank": self.ceiling.target_rank, "ceiling_modules": len(self.ceiling.modules),
            "batch_size": self.batch_size, "chunks": self.chunks, "height": self.height, "width": self.width,
            "size_policy": self.rules.size_policy, "dynamic_sizes": self.dynamic_sizes,
            "compile": self.compile_mode, "warmup_s": round(self.warmup_s, 2), "recompiles": self.recompiles,
            "mixed": self.writer.mixes_requests, "attention_backend": self.attention_backend,
            "step_cache": self.step_cache.backend if self.step_cache else None,
            "base_quantization": self.quantization or "none", "denoiser_bytes": self.denoiser_bytes,
            "slot_bytes": writer["slot_bytes"], "rank_buckets": writer.get("rank_buckets", []),
            "writer": writer["writer"], "sizes": list(self.rules.size_names()),  # WIDTHxHEIGHT, default first
            # fused and auto mode: where the pristine weights live, their bytes, one adapter set per
            # forward batch; auto mode: its floor and the forward batches each path served
            **{k: writer[k] for k in ("restore", "pristine_bytes", "one_adapter_set_per_batch", "fused_min_kept",
                                      "batches") if k in writer},
            "text_encoders": self.text.describe(), "text_encoder_bytes": self.text.nbytes,
            "limits": self.limits.model_dump(),
        }

    def load_adapter(self, source, name: str | None = None) -> Adapter:
        """Read and convert an adapter for this engine's family (no validation against the writer)."""
        return self.resolver.load(source, name)

    def resolve(self, adapters: Mapping[str, Any] | None) -> Bindings:
        """A request's ``{slot: spec}`` as checked adapters; raises before touching any weight."""
        return self.resolver.resolve(adapters)

    # ------------------------------------------------------------------ prepare once, run once

    def check(self, request: GenerationRequest, *,
              default_scale: Callable[[str], float | None] | None = None) -> CheckedRequest:
        """Parameters, then slots, scales and token names, each checked once; no I/O (the server
        runs this before it fetches, so bad requests never wait for a download). ``default_scale``:
        a reference's default scale when its spec gives none (the serving store's catalog; None:
        the ``store`` this engine was given, if any)."""
        return CheckedRequest(request=request, params=self.rules.check_request(request),
                              specs=self.resolver.specs(request.adapters, default_scale))

    def prepare(self, request: str | GenerationRequest | CheckedRequest, *,
                fetched: Mapping[str, Adapter] | None = None, **options) -> PreparedRequest:
        """Everything that can fail because of the request, on the caller's thread; nothing here
        touches the model. ``request``: a prompt with ``options`` (GenerationRequest's fields:
        adapters, num_images, num_inference_steps, guidance_scale, height, width, seed, output_type,
        negative_prompt, progress), a GenerationRequest, or what ``check`` made of one.
        ``progress(done, total)`` is called after each denoising step. ``fetched``: slot -> the
        adapter already fetched for it (the server's service fetches every slot); other slots are
        loaded here (through the engine's ``store`` if it was given one)."""
        began = time.perf_counter()
        if isinstance(request, str):
            request = GenerationRequest(prompt=request, **{**options, "adapters": options.get("adapters") or {}})
        elif options:
            raise TypeError(f"options {', '.join(options)} go with a prompt, not with a request")
        checked = request if isinstance(request, CheckedRequest) else self.check(request)
        r = checked.request
        with r.trace.span("validate", adapters=len(checked.specs)):
            bindings = self.resolver.validate(checked.specs, fetched)
            self.text.prepare(bindings, r.prompt, r.negative_prompt)  # checks first: raises before any planning
            self.writer.prepare(bindings)
        timings = Timings(resolve_ms=(time.perf_counter() - began) * 1000)
        return PreparedRequest(prompt=r.prompt, params=checked.params, adapters=bindings, num_images=r.num_images,
                               seed=r.seed, output_type=r.output_type, negative_prompt=r.negative_prompt,
                               progress=r.progress, timings=timings, trace=r.trace)

    def run(self, work: PreparedRequest | Sequence[PreparedRequest]):
        """One prepared request (its pack in chunks of the compiled batch size) -> GenerationResult;
        or several sharing their denoising parameters in ONE forward batch (writers that mix
        requests) -> one GenerationResult, or the request's own NonFiniteOutput, per request."""
        if isinstance(work, PreparedRequest):
            return self._run_pack(work)
        return self._run_together(list(work))

    def generate(self, prompt: str, **kwargs) -> GenerationResult:
        """``prepare`` then ``run``: one pack (see ``prepare`` for the arguments)."""
        return self.run(self.prepare(prompt, **kwargs))

    def _run_pack(self, request: PreparedRequest) -> GenerationResult:
        began, timings, trace = time.perf_counter(), request.timings, request.trace
        repeat = self._batch_factor(request.params)
        swap = SwapReport()

        def bind(size: int) -> None:  # every chunk: the writer's samples are this request's
            with trace.span("swap", images=size):
                swap.add(self.writer.bind([request.adapters] * size, repeat))

        call = request.params.pipeline_kwargs()
        call.update(self.text.prompts(request.adapters, request.prompt, request.negative_prompt))
        prompt = call.pop("prompt")
        self.active_adapters = len({binding.adapter.sha256 for binding in request.adapters.values()})
        with self._engine_section():
            with trace.span("swap", target="text_encoders"):
                swap.text_ms += self.text.apply(request.adapters)
            images = run_pack(self.pipeline, prompt=prompt, num_images=request.num_images,
                              batch_size=self.chunk_for(request.params), seed=request.seed, call_kwargs=call,
                              timings=timings,
                              output_type="pt" if request.output_type == "pil" else request.output_type,
                              progress=request.progress, before_chunk=bind, trace=trace)
            guard.check_finite(images, request.adapters, self.pipeline)
        timings.swap_ms = swap.ms + swap.text_ms  # the text encoders' part included
        images = finish_images(self.pipeline, images, request.output_type)
        timings.total_ms = timings.resolve_ms + (time.perf_counter() - began) * 1000
        served = _served(request.adapters, self.text.lora_encoders, swap.fused, self._path)
        return GenerationResult(images=images, seeds=request.seeds, timings=timings, swap=swap, adapters=served,
                                recompiles=self.recompiles, size=request.size, snapped_from=request.snapped_from)

    def _run_together(self, requests: list[PreparedRequest]) -> list:
        total = sum(r.num_images for r in requests)
        if not requests or total > self.batch_size:
            raise InvalidRequest(f"a mixed batch holds 1..{self.batch_size} images, got {total}")
        if len({r.batch_key() for r in requests}) > 1:
            raise InvalidRequest("requests in one batch must share steps, guidance, size and output type")
        began, first = time.perf_counter(), requests[0]
        samples = [r.adapters for r in requests for _ in range(r.num_images)]
        call = first.params.pipeline_kwargs()
        steps = call["num_inference_steps"]
        clock = DenoiseClock(self.pipeline.device, steps, fan_out([r.progress for r in requests]), 0, steps)
        trace, batch = together([r.trace for r in requests]), Timings()
        bounds = [sum(r.num_images for r in requests[:i]) for i in range(len(requests) + 1)]
        self.active_adapters = len({b.adapter.sha256 for r in requests for b in r.adapters.values()})
        with self._engine_section():
            with trace.span("swap", images=total, requests=len(requests)):
                swap = self.writer.bind(samples, repeat=self._batch_factor(first.params))
                call.update(batch_prompts(self.text, self.pipeline, self.family, requests,
                                          self.uses_cfg(first.params.guidance_scale), swap))
            step_began = time.perf_counter()
            images = self.pipeline(num_images_per_prompt=1,
                                   generator=[g for r in requests for g in image_generators(r.seed, 0, r.num_images)],
                                   output_type="pt" if first.output_type == "pil" else first.output_type,
                                   callback_on_step_end=clock, **call).images
            synchronize(self.pipeline.device)
            split_chunk(batch, trace, step_began, time.perf_counter(), clock, total)
            # Samples are independent: a request whose adapters overflowed fails alone.
            refused = {}
            for i, request in enumerate(requests):
                try:
                    guard.check_finite(images[bounds[i]:bounds[i + 1]], request.adapters, self.pipeline)
                except NonFiniteOutput as exc:
                    refused[i] = exc
        results = []
        for i, request in enumerate(requests):
            if i in refused:
                results.append(refused[i])
                continue
            timings = replace(request.timings, swap_ms=swap.ms + swap.text_ms, generate_ms=batch.generate_ms,
                              decode_ms=batch.decode_ms, chunks=batch.chunks)
            timings.total_ms = timings.resolve_ms + (time.perf_counter() - began) * 1000
            served = _served(request.adapters, self.text.lora_encoders, swap.fused, self._path)
            own = finish_images(self.pipeline, images[bounds[i]:bounds[i + 1]], first.output_type)
            results.append(GenerationResult(images=own, seeds=request.seeds, timings=timings, swap=swap,
                                            adapters=served, recompiles=self.recompiles, size=request.size,
                                            snapped_from=request.snapped_from))
        return results

    @property
    def _path(self) -> str:
        """How this engine applies adapters when its writer does not say per request (auto mode's does)."""
        return "fused" if self.config.adapter_mode == "fused" else "slots"

    def _batch_factor(self, params: CallParams) -> int:
        return self.family.batch_factor(params.guidance_scale)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether this guidance runs as a doubled [uncond, cond] batch (the family's CFG style)."""
        return self.family.doubles_batch(guidance_scale)

    @property
    def device(self) -> torch.device:
        return self.pipeline.device

    def chunk_for(self, params: CallParams) -> int:
        """The chunk size a pack of this size and CFG mode runs in: the measured choice with
        ``batch_size="auto"``, else the configured batch size."""
        chosen = self.chunks.get(chunk_key(params.height, params.width, self.uses_cfg(params.guidance_scale)))
        return chosen["chosen"] if chosen else self.batch_size

    # ------------------------------------------------------------------ the warm state's guards

    @contextmanager
    def _engine_section(self):
        """One pack at a time on the writer's tensors; graphs compiled inside are counted; anything
        unexpected raised inside is an engine fault (EngineError: the worker rebuilds).

        A compiled engine runs requests with dynamo's ``fail_on_recompile`` stance: whatever
        ``RequestRules`` did not foresee, no request ever starts a compile; it is refused."""
        stance = torch.compiler.set_stance("fail_on_recompile") if self.compile_mode else nullcontext()
        with self._lock:
            graphs_before = graph_count()
            try:
                self.writer.check_intact()
                self.text.check_intact()
                with stance:
                    yield
            except HotloraError:
                raise
            except RuntimeError as exc:
                if "Detected recompile" in str(exc):
                    raise UnservedShape("this request would compile a new graph on the warm engine; refused "
                                        f"(served sizes: {self.rules.sizes_text()})", self.rules.size_names()) from exc
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            finally:
                self._recompiles += graph_count() - graphs_before

