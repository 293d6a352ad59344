"""The warm model: one diffusion pipeline made ready to serve, and the guards around every run.

    load_model(model, config)  the pipeline and its family, on the configured device and dtype
    WarmModel(...)             the denoiser quantized, the adapter writers installed (before any
                               compile), the denoiser compiled and warmed up at every shape steady
                               state will see, the chunk sizes measured (``batch_size="auto"``)
    WarmModel.section()        one run at a time; no run ever compiles; the writers intact; a
                               foreign error named an engine fault

It knows nothing of requests: ``Engine`` checks and prepares them, the runner runs them here.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Mapping

import torch

from hotlora.settings import EngineConfig, format_size
from hotlora.engine.device import default_device
from hotlora.engine.pipeline import (
    CompileArtifacts, compile_artifacts_path, compile_denoiser, fold_linear_inputs, graph_count, keep_compiler_headers,
    load_pipeline, resolve_dtype, restore_compiler_headers, set_attention_backend, sweep_compile_cache,
)
from hotlora.engine.quantize import check_quantization, quantize_denoiser, weight_bytes
from hotlora.engine.request import CallParams, UnservedShape
from hotlora.engine.results import OutputKind, output_kind
from hotlora.engine.stepcache import apply_step_cache
from hotlora.engine.warmup import (
    chunk_key, idle_passes, measured_chunks, passes_key, passes_path, save_idle_passes, warm_up,
)
from hotlora.engine.writers import AdapterWriter, TextWriter, install_expert_writers, install_text_writer
from hotlora.errors import EngineError, HotloraError
from hotlora.families import ModelFamily

log = logging.getLogger(__name__)

_GRAPHS_ALLOTTED = [0]  # graphs the compiled engines of this process were allowed


def load_model(model: str | os.PathLike, config: EngineConfig) -> tuple[object, ModelFamily]:
    """``model`` (a local directory or a hub id) loaded through ``from_pretrained`` on the configured
    device (default: CUDA when there is one) and dtype (default: the device's)."""
    device = config.device or default_device()
    check_quantization(config.base_quantization, device)  # before loading: float8 needs CUDA
    dtype = resolve_dtype(config.dtype, device)
    return load_pipeline(model, dtype=dtype, device=device)


def shared_pipeline(cls, pipeline, dtype: torch.dtype):
    """``cls.from_pipe(pipeline)`` with every module's tensors left in the dtype they are in.

    ``from_pipe`` ends with ``.to(dtype)`` on the new pipeline, i.e. on the SHARED modules, float32
    unless told: the first task pipeline of a bfloat16 engine would turn its denoiser, slots and
    encoders into float32 (twice the memory, another precision than warm-up compiled). Told the
    denoiser's dtype it casts nothing in that dtype; a tensor kept in another one (transformers'
    ``_keep_in_fp32_modules`` under float16) gets its own storage back (no copy is made)."""
    modules = [m for m in pipeline.components.values() if isinstance(m, torch.nn.Module)]
    kept = [(module, name, tensor, tensor.data if is_parameter else tensor)
            for component in modules for module in component.modules()
            for is_parameter, tensors in ((True, module._parameters), (False, module._buffers))
            for name, tensor in tensors.items()
            if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype]
    made = cls.from_pipe(pipeline, dtype=dtype)
    for module, name, tensor, original in kept:
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = original  # nn.Module.to swapped the parameter's data (or the parameter)
            module._parameters[name] = tensor
        else:
            module._buffers[name] = original
    return made


def check_expert_config(config: EngineConfig, experts: Mapping) -> None:
    """UnservedModel, at start-up, for what a model of several experts is not served with: only
    their slots are built (``install_expert_writers``)."""
    from hotlora.engine.writers import expert_writer_problem
    from hotlora.families import UnservedModel

    problem = expert_writer_problem(config)
    if problem:
        raise UnservedModel(f"{problem} is not served on a model of several experts ({', '.join(experts)}): "
                            "their slots are (adapter_mode='slots', mixed=False)")


class WarmModel:
    """A pipeline of a registered family, warm: see the module docstring. ``defaults``: the saved
    model's own defaults (its ``hotlora.json``) over the family's."""

    def __init__(self, pipeline, family: ModelFamily, config: EngineConfig, *, model: str | None = None,
                 defaults: Mapping | None = None):
        # A checkpoint that makes nothing from text alone (Wan's image-to-video ones) serves its one task
        # on the pipeline it loads as; any other serves text-to-image and the tasks made from it.
        loaded, self.checkpoint_task = pipeline, family.checkpoint_task(pipeline)
        pipeline = loaded if self.checkpoint_task else family.text_to_image_pipeline(loaded)
        self.config, self.pipeline, self.family, self.model = config, pipeline, family, model
        family.check_engine_config(config)  # before anything is installed or compiled
        self.batch_size = config.batch_limit  # compiled for batches up to this; packs chunk by ``chunk_for``
        self.chunks: dict[str, dict] = {}  # batch_size="auto": the measured choice per size and CFG mode
        self.denoiser = getattr(pipeline, family.denoiser)
        # Every model that denoises (Wan 2.2 A14B: two experts, switched at boundary_ratio): each is
        # quantized, gets slots, an attention backend and its compile, as the denoiser does.
        self.experts = family.experts(pipeline)
        if len(self.experts) > 1:  # before anything is quantized or installed
            check_expert_config(config, self.experts)
        self.defaults = {**family.defaults, **family.checkpoint_defaults(pipeline), **(defaults or {})}
        self.schedule_steps = family.schedule_steps(pipeline)
        if self.schedule_steps is not None:  # what the pipeline runs, whatever a hotlora.json says
            self.defaults["num_inference_steps"] = self.schedule_steps
        self.size_multiple = family.size_multiple(family.vae_scale_factor(self.pipeline))
        self.sizes = self._served_sizes(config, self.size_multiple)
        self.frames = self._served_frames(config)
        served = [model, Path(model).name if model else None, self.defaults.get("model_id"),
                  *self.defaults.get("base_model_aliases", [])]
        self.quantization = None
        for expert in self.experts.values():  # before LoRA and compile
            self.quantization = quantize_denoiser(expert, config.base_quantization)
        self.denoiser_bytes = sum(weight_bytes(e) for e in self.experts.values())  # the base weights, as stored
        self.writer: AdapterWriter = install_expert_writers(config, self.experts, family.name, served)
        # The text encoders' side (LoRA merged in, embeddings in reserved rows), before any compile.
        self.text: TextWriter = install_text_writer(config, pipeline, family, self.writer.slot_names)
        self.tasks = self._served_tasks(config)
        # Each task's pipeline made from the warm one: the same module objects (every weight, LoRA
        # slot and compiled block shared; nothing copied), the task's own __call__.
        self.task_pipelines = {self.tasks[0]: pipeline, **{
            task: family.task_pipeline(task, loaded, share=lambda cls, source: shared_pipeline(
                cls, source, self.denoiser.dtype)) for task in self.tasks[1:]}}
        for each in self.task_pipelines.values():
            each.set_progress_bar_config(disable=True)
        # Image-to-video's input image counts (a first frame; first and last on Wan's FLF2V checkpoints).
        video = self.task_pipelines.get("image-to-video")
        self.input_frames = family.input_frame_counts(video) if video is not None else (1,)
        self.output: OutputKind = output_kind(family)
        self.audio_rate = family.audio_rate(self.pipeline)  # Hz of the sound track its videos come with, or None
        self._lock = threading.Lock()  # one run at a time: the writer's tensors are shared state
        self._recompiles, self.compile_mode = 0, None
        self.active_adapters = 0  # distinct adapters bound by the last forward batch (a gauge for metrics)
        self.warmup_s, self.compile_artifacts_loaded, self.warmup_skipped = 0.0, False, 0
        self.attention_backend = set_attention_backend(self.denoiser, config.attention_backend)
        for expert in list(self.experts.values())[1:]:
            set_attention_backend(expert, config.attention_backend)
        self.step_cache = config.step_cache
        # Several frame counts change the token count as several sizes do.
        self.dynamic_sizes = family.dynamic_sizes if len(self.sizes) * max(1, len(self.frames)) > 1 else None
        self._make_warm()

    def _served_tasks(self, config: EngineConfig) -> tuple[str, ...]:
        """The tasks warmed up, the one the pipeline loaded as first: ``config.tasks`` (text-to-image
        and those made from it), or a conditioned checkpoint's one task, which its config must name
        (the server sizes its bodies for input images from the config, before the model loads)."""
        only = self.checkpoint_task
        if only is not None:
            from hotlora.families import UnservedModel

            kind = type(self.pipeline).__name__
            others = [task for task in config.tasks if task not in ("text-to-image", only)]
            if only not in config.tasks or others:
                raise UnservedModel(f"this checkpoint ({kind}) makes nothing from text alone: it serves {only} only "
                                    f"(start it with tasks={only}; asked for: {', '.join(config.tasks)})")
            log.info("this checkpoint (%s) serves %s only: a request without an input image is refused", kind, only)
            return (only,)
        unserved = [task for task in config.tasks if task not in self.family.served_tasks()]
        if unserved:
            from hotlora.families import UnservedModel

            why = "; ".join(f"{task}: {self.family.refused_tasks.get(task, 'diffusers has no such pipeline for it that hotlora declares')}"
                            for task in unserved)
            raise UnservedModel(f"the {self.family.name} family does not serve {', '.join(unserved)} ({why}; served "
                                f"tasks: {', '.join(self.family.served_tasks())})")
        if "edit" in config.tasks and config.max_reference_images > self.family.max_edit_references:
            from hotlora.families import UnservedModel

            raise UnservedModel(f"max_reference_images={config.max_reference_images}: the {self.family.name} family's "
                                f"edit pipeline takes at most {self.family.max_edit_references} reference image(s)")
        return tuple(config.tasks)

    def _served_frames(self, config: EngineConfig) -> tuple[int, ...]:
        """A video family's frame counts served (each warmed up), the default first: ``frames``, else
        the model's default (its ``hotlora.json``, else the family's). Empty for an image family."""
        if not self.family.video:
            if config.frames:
                raise ValueError(f"frames={list(config.frames)}: the {self.family.name} family makes images")
            return ()
        frames = config.frames or (self.defaults["num_frames"],)
        wrong = [problem for count in frames for problem in self.family.frame_problems(count)]
        if wrong:
            raise ValueError(f"frames: {'; '.join(wrong)}")
        return tuple(frames)

    def _served_sizes(self, config: EngineConfig, multiple: int) -> tuple[tuple[int, int], ...]:
        """The (height, width) sizes served, the default first (see ``EngineConfig.sizes``)."""
        side = self.family.pipeline_default_size(self.pipeline)
        default = (config.height or self.defaults.get("height") or side[0],
                   config.width or self.defaults.get("width") or side[1])
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
            attention=self.attention_backend, dtype=str(self.denoiser.dtype),
            **({"frames": list(self.frames)} if self.frames else {}))  # an image family keeps its key
        if fingerprint is not None:  # what a killed predecessor was writing there
            sweep_compile_cache(config.compile_cache_dir)
        if config.compile and fingerprint is not None:
            artifacts = CompileArtifacts(compile_artifacts_path(config.compile_cache_dir, fingerprint))
            self.compile_artifacts_loaded = artifacts.load()
        states = len(self.writer.warmup_states())
        # Graphs per (state, size): one state's batch and CFG variants (dynamo's default limit, 8). Dynamic
        # sizes: the first size compiles static graphs, the second dynamic ones every later size reuses.
        sizes = len(self.served_sizes) * max(1, len(self.frames))  # shapes: every size at every frame count
        graph_sizes = min(sizes, 2) if self.dynamic_sizes else sizes
        # Every compiled engine of a process adds graphs to the blocks' shared code objects: cover them all.
        # Experts share their blocks' code objects (one class), so their graphs count together too.
        needed = _GRAPHS_ALLOTTED[0] = (_GRAPHS_ALLOTTED[0]
                                        + self.family.graphs_per_state * states * graph_sizes * len(self.experts))
        if config.compile and torch._dynamo.config.recompile_limit < needed:
            log.info("%d writer states x %d sizes: dynamo recompile_limit raised to %d", states, sizes, needed)
            torch._dynamo.config.recompile_limit = needed
        if self.step_cache is not None:  # installed before compile: the compiled blocks include it
            apply_step_cache(self.pipeline, self.experts, self.step_cache, self.family)
        if config.compile and config.keep_compiler_headers and config.compile_cache_dir is not None:
            restore_compiler_headers(config.compile_cache_dir)
        if config.compile:
            fullgraph = self.step_cache.fullgraph if self.step_cache else True
            for expert in self.experts.values():
                fold_linear_inputs(expert, self.family)
                self.compile_mode = compile_denoiser(
                    expert, self.family, fullgraph=fullgraph,
                    dynamic=False if self.dynamic_sizes is False else self.family.compile_dynamic)
        # Which passes compile nothing is known only for a process whose dynamo has compiled nothing yet:
        # a second engine in one process (a test session, an engine rebuilt in place) finds the first
        # one's graphs on the blocks' shared code objects. Such a process neither records nor skips.
        record, skip, fresh = None, frozenset(), graph_count() == 0
        if artifacts is not None and fresh:
            record_key = passes_key(self, fingerprint)
            record = passes_path(config.compile_cache_dir, record_key)
            # Only for a restart: beside the artifacts of the same key (warmup.py says why it is safe).
            skip = idle_passes(record, record_key) if self.compile_artifacts_loaded else frozenset()
        self.warmup_skipped = len(skip)
        after_state = None if artifacts is None else lambda: artifacts.save(final=False)
        compiled = warm_up(self, skip=skip, after_state=after_state)
        if record is not None and not skip:  # a warm-up that ran every pass, from a fresh dynamo
            save_idle_passes(record, record_key, compiled)
        if config.batch_size == "auto":  # the chunk size per size and CFG mode, measured (warmup.py)
            self.chunks = measured_chunks(self, fingerprint)
        if artifacts is not None:  # anything the measurement compiled (nothing, when warm-up covered it)
            artifacts.save()
        if config.compile and config.keep_compiler_headers and config.compile_cache_dir is not None:
            keep_compiler_headers(config.compile_cache_dir)

    # ------------------------------------------------------------------ what steady state runs

    @property
    def served_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) pairs warmed up, the default first."""
        return self.sizes

    @property
    def device(self) -> torch.device:
        return self.pipeline.device

    @property
    def recompiles(self) -> int:
        """New dynamo graphs compiled inside ``section`` since warm-up. Must stay 0."""
        return self._recompiles

    @property
    def path(self) -> str:
        """How adapters are applied when the writer does not say per request (auto mode's does)."""
        return "fused" if self.config.adapter_mode == "fused" else "slots"

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether this guidance runs as a doubled [uncond, cond] batch (the family's CFG style)."""
        return self.family.doubles_batch(guidance_scale)

    def batch_factor(self, params: CallParams) -> int:
        return self.family.batch_factor(params.guidance_scale)

    def chunk_for(self, params: CallParams) -> int:
        """The chunk size a pack of this size and CFG mode runs in: the measured choice with
        ``batch_size="auto"``, else the configured batch size."""
        chosen = self.chunks.get(chunk_key(params.height, params.width, self.uses_cfg(params.guidance_scale)))
        return chosen["chosen"] if chosen else self.batch_size

    # ------------------------------------------------------------------ the guards

    @contextmanager
    def section(self):
        """One run at a time on the writer's tensors; graphs compiled inside are counted; anything
        unexpected raised inside is an engine fault (EngineError: the worker rebuilds).

        A compiled model runs requests with dynamo's ``fail_on_recompile`` stance: whatever
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
                    names = tuple(format_size(h, w) for h, w in self.sizes)
                    raise UnservedShape("this request would compile a new graph on the warm engine; refused "
                                        f"(served sizes: {', '.join(names)})", names) from exc
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                raise EngineError(f"generation failed inside the engine: {type(exc).__name__}: {exc}") from exc
            finally:
                self._recompiles += graph_count() - graphs_before
