"""The engine: the public face of one warm model; ``prepare`` a request once, ``run`` it once.

    Engine.check(r)      parameters, slots and scales checked, no I/O -> CheckedRequest
    Engine.prepare(r)    on the request's thread: adapters validated (the server's service hands
                         over what it fetched; the Python API's are loaded here) and prepared for
                         the writers -> PreparedRequest
    Engine.run(p | [p])  on the serving thread: the runner binds the writer per chunk, denoises,
                         checks the output -> GenerationResult (one per request)

Behind it: ``warm.WarmModel`` (the pipeline loaded, quantized, its writers installed, compiled,
warmed up; the guards around every run) and ``runner.Runner`` (a list of requests in chunks: a
pack and a mixed batch are one path, with one result builder).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from hotlora.adapters.format.convert import Adapter
from hotlora.adapters.resolver import AdapterResolver
from hotlora.settings import EngineConfig, StoreConfig, read_model_defaults
from hotlora.engine.device import probe_cpu_isa_ahead
from hotlora.engine.front import EngineFront
from hotlora.engine.request import (
    Bindings, CallParams, CheckedRequest, GenerationRequest, PreparedRequest, RequestRules,
)
from hotlora.engine.results import GenerationResult
from hotlora.engine.runner import Runner
from hotlora.engine.shift import static_shift_key
from hotlora.engine.warm import WarmModel, load_model
from hotlora.engine.writers import AdapterWriter, TextWriter
from hotlora.families import ModelFamily


class Engine:
    """A warm, compiled pipeline of a registered family whose adapter writer is rewritten per request."""

    def __init__(self, pipeline, family: ModelFamily, config: EngineConfig | None = None, *, model: str | None = None,
                 defaults: Mapping | None = None, store=None, **options):
        self.config = config = (config or EngineConfig()).replace(**options)
        self.warm = warm = WarmModel(pipeline, family, config, model=model, defaults=defaults)
        self.pipeline, self.family, self.model = warm.pipeline, family, model  # the text-to-image one
        self.denoiser, self.defaults, self.limits = warm.denoiser, warm.defaults, config.limits
        self.height, self.width = warm.sizes[0]  # the default size
        self.resolver = AdapterResolver(warm.writer.slot_names, warm.writer.ceiling, family, store,
                                        denoiser_config=family.converter_config(self.denoiser),
                                        max_scale=self.limits.max_scale, serving_dtype=self.denoiser.dtype,
                                        text_problems=warm.text.checks.problems)
        # A compiled engine serves only the sizes it warmed up at; an eager one any multiple, or its sizes.
        rules = RequestRules(family, self.defaults, self.limits, warm.sizes, warm.size_multiple,
                             sizes_only=config.compile or bool(config.sizes), size_policy=config.size_policy,
                             tasks=warm.tasks, max_reference_images=config.max_reference_images,
                             strengths={task: family.default_strength(task) for task in warm.tasks},
                             frames=warm.frames, input_frames=warm.input_frames, experts=len(warm.experts),
                             shift_key=static_shift_key(warm.pipeline.scheduler),
                             scheduler=type(warm.pipeline.scheduler).__name__, schedule_steps=warm.schedule_steps,
                             fewest_steps=family.fewest_steps(warm.pipeline))
        self.runner = Runner(warm)
        self.front = EngineFront(family, rules, self.resolver, warm.text.checks)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, config: EngineConfig | None = None, *, store=None,
                        **options) -> "Engine":
        """Load ``model`` (a local directory or a hub id) and make it warm: writer, compile, warm-up.
        ``options`` are ``EngineConfig`` fields. ``store``: for the Python API, where adapters named by
        reference (and catalog default scales) come from when ``prepare`` is given none fetched: an
        AdapterStore, or a StoreConfig to build one. The server passes none: its service owns the
        store and hands each request's fetched adapters to ``prepare``."""
        config = (config or EngineConfig()).replace(**options)
        if config.compile:
            probe_cpu_isa_ahead()  # beside the load
        pipeline, family = load_model(model, config)
        if isinstance(store, StoreConfig):
            from hotlora.adapters.store import AdapterStore

            store = AdapterStore(store, family, denoiser_config=family.converter_config(getattr(pipeline, family.denoiser)))
        return cls(pipeline, family, config, model=str(model), defaults=read_model_defaults(model), store=store)

    # ------------------------------------------------------------------ the warm model's state

    @property
    def writer(self) -> AdapterWriter:
        return self.warm.writer

    @property
    def text(self) -> TextWriter:
        return self.warm.text

    @property
    def ceiling(self):
        return self.warm.writer.ceiling

    @property
    def recompiles(self) -> int:
        """New dynamo graphs compiled by this engine's requests since warm-up. Must stay 0."""
        return self.warm.recompiles

    @property
    def served_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) pairs a request may ask for without compiling (the warm-up's)."""
        return self.rules.sizes

    @property
    def batch_size(self) -> int:
        """Compiled for batches up to this; packs run in chunks of ``chunk_for``."""
        return self.warm.batch_size

    @property
    def chunks(self) -> dict[str, dict]:
        """batch_size="auto": the measured chunk size per size and CFG mode."""
        return self.warm.chunks

    @property
    def device(self) -> torch.device:
        return self.warm.device

    @property
    def compile_mode(self) -> str | None:
        return self.warm.compile_mode

    @property
    def dynamic_sizes(self) -> bool | None:
        return self.warm.dynamic_sizes

    @property
    def warmup_s(self) -> float:
        return self.warm.warmup_s

    @property
    def compile_artifacts_loaded(self) -> bool:
        return self.warm.compile_artifacts_loaded

    @property
    def attention_backend(self) -> str:
        return self.warm.attention_backend

    @property
    def step_cache(self):
        return self.warm.step_cache

    @property
    def quantization(self) -> str | None:
        return self.warm.quantization

    @property
    def denoiser_bytes(self) -> int:
        return self.warm.denoiser_bytes

    @property
    def active_adapters(self) -> int:
        """Distinct adapters bound by the last forward batch (a gauge for metrics)."""
        return self.warm.active_adapters

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether this guidance runs as a doubled [uncond, cond] batch (the family's CFG style)."""
        return self.warm.uses_cfg(guidance_scale)

    def chunk_for(self, params: CallParams) -> int:
        """The chunk size a pack of this size and CFG mode runs in."""
        return self.warm.chunk_for(params)

    def describe(self) -> dict:
        writer = self.writer.describe()
        return {
            "model": self.model, "family": self.family.name, "slots": list(self.writer.slot_names),
            "target_rank": self.ceiling.target_rank, "ceiling_modules": self.ceiling.layer_count,
            "batch_size": self.batch_size, "chunks": self.chunks, "height": self.height, "width": self.width,
            "defaults": {k: self.defaults[k] for k in ("num_inference_steps", "guidance_scale")},
            "request_options": list(self.rules.options()), "cfg": self.family.cfg,
            "tasks": list(self.rules.tasks), "max_reference_images": self.rules.max_reference_images,
            "default_strengths": dict(self.rules.strengths),  # task -> the strength a request without one runs at
            "size_policy": self.rules.size_policy, "dynamic_sizes": self.dynamic_sizes,
            "compile": self.compile_mode, "warmup_s": round(self.warmup_s, 2), "recompiles": self.recompiles,
            "mixed": self.writer.mixes_requests, "attention_backend": self.attention_backend,
            "step_cache": self.step_cache.backend if self.step_cache else None,
            "base_quantization": self.quantization or "none", "denoiser_bytes": self.denoiser_bytes,
            "slot_bytes": writer["slot_bytes"], "rank_buckets": writer.get("rank_buckets", []),
            "writer": writer["writer"], "sizes": list(self.rules.size_names()),  # WIDTHxHEIGHT, default first
            "lora_biases": self.writer.ceiling.biases,  # whether adapters' LoRA biases (lightx2v's .diff_b) are served
            "frames": list(self.rules.frames),  # a video family's frame counts served, default first
            "input_frames": list(self.rules.input_frames),  # image-to-video's input images: 1 first, 2 first and last
            "output": self.family.output_kind, "fps": self.family.fps,  # "images" | "frames"; a video's frame rate
            # a model of several experts (Wan 2.2 A14B): the models with slots, the denoiser first
            **({"experts": list(writer["experts"])} if "experts" in writer else {}),
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

    @property
    def rules(self) -> RequestRules:
        """What requests are checked against (held by the front, the one place that checks them)."""
        return self.front.rules

    @property
    def denoiser_config(self) -> Mapping | None:
        return self.front.denoiser_config

    @property
    def image_budget(self):
        """What an input image given as file bytes may be (``hotlora.images.ImageBudget``)."""
        return self.front.image_budget

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
        return self.front.check(request, default_scale=default_scale)

    def prepare(self, request: str | GenerationRequest | CheckedRequest, *,
                fetched: Mapping[str, Adapter] | None = None, **options) -> PreparedRequest:
        """Everything that can fail because of the request, on the caller's thread; nothing here
        touches the model. ``request``: a prompt with ``options`` (GenerationRequest's fields:
        adapters, num_images, num_inference_steps, guidance_scale, height, width, seed, output_type,
        negative_prompt, progress), a GenerationRequest, or what ``check`` made of one.
        ``progress(done, total)`` is called after each denoising step. ``fetched``: slot -> the
        adapter already fetched for it (the server's service fetches every slot); other slots are
        loaded here (through the engine's ``store`` if it was given one). Validated by the front,
        then staged."""
        prepared = self.front.prepare(request, fetched=fetched, **options)
        began = time.perf_counter()
        self.stage(prepared)
        prepared.timings.resolve_ms += (time.perf_counter() - began) * 1000
        return prepared

    def stage(self, prepared: PreparedRequest) -> None:
        """The writers' per-request layout of a validated request (packed copies, text-encoder
        factors on the device): work the swap should not pay. Nothing is checked here."""
        self.text.stage(prepared.adapters)
        self.writer.prepare(prepared.adapters)

    def run(self, work: PreparedRequest | Sequence[PreparedRequest]):
        """One prepared request (its pack in chunks of the compiled batch size) -> GenerationResult;
        or several sharing their denoising parameters in ONE forward batch (writers that mix
        requests) -> one GenerationResult, or the request's own NonFiniteOutput, per request."""
        if isinstance(work, PreparedRequest):
            (result,) = self.runner.run([work])
            if isinstance(result, BaseException):  # the request's own adapters overflowed it
                raise result
            return result
        return self.runner.run(list(work), mixed=True)

    def corrupt_a_weight(self) -> None:
        """Test hook (the server's ``/admin/fault``): one base weight of the denoiser set to NaN, as
        after a memory fault; the next run finds it and is an engine fault."""
        weight = next(p for n, p in self.denoiser.named_parameters() if "lora_" not in n and p.ndim == 2)
        with torch.no_grad():
            weight.fill_(float("nan"))

    def generate(self, prompt: str, **kwargs) -> GenerationResult:
        """``prepare`` then ``run``: one pack (see ``prepare`` for the arguments)."""
        return self.run(self.prepare(prompt, **kwargs))
