"""The warm engine's settings: ``EngineConfig`` and the two groups it nests (``RequestLimits``,
``StepCache``). Every engine option is declared here once; ``ServerConfig`` forwards them
(settings/server.py) and the compile-cache fingerprint is derived from them."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

from pydantic import field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from hotlora.settings.base import Group, Settings
from hotlora.settings.fields import setting
from hotlora.settings.store import MiB

SIZE_POLICIES = ("refuse", "nearest")
ANIMATION_POLICIES = ("refuse", "first_frame")  # what hotlora.images does with an animated input image
ADAPTER_MODES = ("slots", "fused", "auto")
FUSED_RESTORE = ("auto", "device", "host")
STEP_CACHE_BACKENDS = ("dbcache", "taylorseer", "fbcache")  # engine.stepcache checks the name again
BASE_QUANTIZATIONS = ("none", "int8_weight_only", "float8")  # engine/quantize.py applies them
# What a request may ask one warm denoiser for; each task beyond text-to-image runs through the
# family's variant pipeline made with ``from_pipe`` (families/base.py ``task_pipelines``).
TASKS = ("text-to-image", "image-to-image", "inpaint", "edit", "image-to-video")


def _tasks(value):
    """``"text-to-image,inpaint"`` (a flag, a variable) as a tuple; text-to-image always first."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        value = tuple(dict.fromkeys(("text-to-image", *value)))
    return value


def parse_size(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (the OpenAI images API's ``size``, e.g. ``"832x1216"``) -> (height, width)."""
    parts = str(text).strip().lower().split("x")
    try:
        width, height = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"a size is WIDTHxHEIGHT in pixels, like 1024x1024; got {text!r}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return height, width


def parse_frames(value) -> tuple[int, ...]:
    """``"81,49"`` or a sequence of ints -> (81, 49), duplicates dropped, order kept."""
    items = value.split(",") if isinstance(value, str) else list(value)
    frames = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        try:
            count = int(item)
        except (TypeError, ValueError):
            raise ValueError(f"frame count {item!r} is not an integer") from None
        if count < 1:
            raise ValueError(f"frame count {count} must be positive")
        if count not in frames:
            frames.append(count)
    return tuple(frames)


def parse_sizes(value) -> tuple[tuple[int, int], ...]:
    """Sizes as (height, width) pairs, in order, without repeats: from pairs, ``"WxH"`` strings, or
    one comma-separated string of them (a config file, an environment variable, a flag)."""
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    sizes = []
    for item in value or ():
        if isinstance(item, str):
            size = parse_size(item)
        else:
            height, width = item
            if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
                raise ValueError(f"a (height, width) size must be two positive integers, got {item!r}")
            size = (height, width)
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def format_size(height: int, width: int) -> str:
    """(height, width) -> ``"WIDTHxHEIGHT"``, as the OpenAI images API writes a size."""
    return f"{width}x{height}"


def default_rank_buckets(target_rank: int) -> tuple[int, ...]:
    """The buckets compiled when ``rank_buckets`` is unset: 0 (a request without adapters runs no
    LoRA branch: the base model's cost) and a quarter of the target rank (a rank-32 adapter in
    rank-128 slots runs rank 32, not 128). Each bucket is one more warm-up state; these two are
    where most requests land (docs/benchmarks.md, "Rank buckets by default")."""
    return tuple(sorted({0, target_rank // 4} - {target_rank}))


class RequestLimits(Group):
    """What one request may ask of the engine, checked before any weight is touched."""

    max_images: int = setting(64, "images one request may ask for (422 beyond)")
    max_steps: int = setting(200, "denoising steps one request may ask for (422 beyond)")
    # A huge scale would overflow the pack; real adapters are used at 0..~2.
    max_scale: float = setting(8.0, "|scale| allowed per adapter (422 beyond)")
    max_work: int = setting(16 * 1024 * 1536 * 50, "height x width x images x steps one request may ask "
                                                   "for: 16 images of 1024x1536 at 50 steps by default (413 beyond)")
    # An eager engine with no ``sizes`` takes any multiple, and max_work alone lets a 4096x4096
    # image through (16 Mpx: Flux's attention over 65,536 tokens). 4 Mpx is twice the side of
    # Flux's and SDXL's 1024. Configured sizes are served whatever their area.
    max_pixels: int = setting(2048 * 2048, "height x width of a size the engine was not configured with "
                                           "(an eager engine without sizes)")
    # Input images (img2img, masks, edit references), decoded by hotlora.images in prepare
    # (ImageBudget.of(limits)): every bound is checked before any pixel is decoded. 16 Mpx is far
    # below Pillow's own warning (~89 Mpx).
    input_image_max_bytes: int = setting(20 * MiB, "an input image's encoded size (413 beyond)")
    input_image_max_pixels: int = setting(4096 * 4096, "an input image's width x height, as its header declares "
                                                       "it (413 beyond)")
    input_image_max_side: int = setting(8192, "an input image's width or height (413 beyond)")
    input_image_animation: str = setting("first_frame", "an animated PNG or WebP input image: its first frame is "
                                                        "used (first_frame), or it is refused (refuse; 422)",
                                         choices=ANIMATION_POLICIES)
    input_image_background: tuple[int, ...] = setting((255, 255, 255), "the R,G,B colour an input image's "
                                                                       "transparent pixels are composited on")

    @field_validator("input_image_max_bytes", "input_image_max_pixels", "input_image_max_side")
    @classmethod
    def _positive(cls, value):
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("input_image_animation")
    @classmethod
    def _animation(cls, value):
        if value not in ANIMATION_POLICIES:
            raise ValueError(f"must be {' or '.join(ANIMATION_POLICIES)}, got {value!r}")
        return value

    @field_validator("input_image_background")
    @classmethod
    def _rgb(cls, value):
        if len(value) != 3 or not all(0 <= c <= 255 for c in value):
            raise ValueError(f"must be three integers 0-255 (R,G,B), got {value!r}")
        return value


class StepCache(Group):
    """Step-cache settings (applied by ``hotlora.engine.stepcache``)."""

    backend: str = setting("dbcache", "skip predictable denoiser steps: dbcache (cache-dit DBCache), taylorseer "
                                      "(DBCache + TaylorSeer) or fbcache (diffusers' FirstBlockCache); "
                                      "trades quality for speed", choices=STEP_CACHE_BACKENDS)
    threshold: float = setting(0.12, "how much change counts as predictable")  # the article ran 0.12
    warmup_steps: int = setting(4, "steps always computed before any may be skipped")
    compute_blocks: int = setting(1, "leading blocks always computed to measure the change (cache-dit Fn)")

    @property
    def fullgraph(self) -> bool:
        return self.backend != "fbcache"


def _batch_size(value):
    """``"3"`` (text from a flag, a variable or a file) is the integer 3; ``"auto"`` stays a word."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _tuple_of_list(value):
    return tuple(value) if isinstance(value, list) else value


class EngineConfig(Settings):
    """Every option of the warm engine, with its default, once. Frozen: ``replace(**changes)`` makes
    a changed copy (``Engine.from_pretrained(model, config, **changes)`` does)."""

    model_config = SettingsConfigDict(frozen=True)

    slots: tuple[str, ...] = setting(("identity", "style"), "slot names, comma-separated")
    target_rank: int = setting(16, "the slots' rank: adapters up to it are served, zero-padded")
    # The slots' and banks' ceiling only: fused mode ignores it (any Linear, and Conv2d on SDXL,
    # is fusable; its pristine copy covers all of them) and logs a warning when it is set.
    target_modules: Any = setting(None, "the LoRA ceiling: every Linear of the denoiser (default), "
                                        "names/suffixes (Python), or one regex (full match; flags, env, files)",
                                  parse=_tuple_of_list)
    batch_size: int | str = setting("auto", "auto: compiled for batches up to max_batch_size, each pack run in "
                                            "the chunk size measured fastest per image at warm-up; or an integer",
                                    parse=_batch_size)
    max_batch_size: int = setting(6, "the largest batch compiled for with batch_size auto")
    # engine/warmup.py: at full size on a CPU an unbounded measurement took ~640 s. Saved with the
    # compile artifacts (engine/warmup.py): only a start with a new key measures.
    chunk_budget_s: float = setting(300.0, "batch_size auto: the most seconds warm-up spends timing chunk sizes "
                                           "(candidates not timed by then are not chosen; 0: no bound); the "
                                           "result is saved in compile_cache_dir and reused by later starts")
    compile: bool = setting(True, "torch.compile the denoiser (--no-compile: eager)")
    dtype: Any = setting(None, "bf16 on CUDA, float32 on CPU by default; a torch dtype name "
                               "(bfloat16, float16, float32)")
    device: str | None = setting(None, "the torch device (default: CUDA when available)")
    height: int | None = setting(None, "the default height (default: hotlora.json's, else the pipeline's)")
    width: int | None = setting(None, "the default width")
    # Every size is warmed up at start-up and part of the compile fingerprint.
    sizes: tuple[tuple[int, int], ...] = setting((), "sizes served without compiling, WIDTHxHEIGHT, the default "
                                                     "first, e.g. 1024x1024,832x1216 (default: height x width)",
                                                 parse=parse_sizes)
    # Video families: every frame count is warmed up at every size and part of the compile fingerprint.
    frames: tuple[int, ...] = setting((), "video families: frame counts served without compiling, the default first, "
                                          "e.g. 81,49 (default: the model's; each 4k + 1)", parse=parse_frames)
    size_policy: str = setting("refuse", "a request at a size not served: refuse (422 listing the sizes) or "
                                         "nearest (snapped to the closest aspect ratio, and said so)",
                               choices=SIZE_POLICIES)
    # Each task is warmed up at every served size (and each reference count up to
    # max_reference_images), so no request of a served task compiles.
    tasks: tuple[str, ...] = setting(("text-to-image",), "tasks served besides text-to-image, comma-separated: "
                                                         "image-to-image, inpaint, edit, image-to-video (the "
                                                         "family's variant pipelines, sharing every weight through "
                                                         "from_pipe; an image-to-video checkpoint serves that alone)",
                                     parse=_tasks)
    max_reference_images: int = setting(1, "edit: the most reference images a request may give (each count "
                                           "is warmed up)")
    mixed: bool = setting(False, "adapter banks: several requests' adapters in one forward batch")
    bank_entries: int | None = setting(None, "adapter sets a bank holds (default 2 x batch size + 1)")
    attention_backend: str = setting("native", "native (SDPA), fa3, flash, or any diffusers dispatcher backend")
    # The server sets its own default (settings/server.py): a library user decides where to write.
    compile_cache_dir: str | os.PathLike | None = setting(None, "where compile artifacts are kept across "
                                                                "restarts (keyed by model and settings)")
    # engine/pipeline.py: KEPT_HEADERS. The image sets it (deploy/image/Containerfile); a host's /tmp persists.
    keep_compiler_headers: bool = setting(False, "keep inductor's precompiled C++ header (built in the temp dir, "
                                                 "6.6 s of g++ on 2 cores) in compile_cache_dir and copy it back "
                                                 "before compiling: for containers whose /tmp is new at each start")
    step_cache: StepCache | None = setting(None, "step cache settings (off by default)")
    # Unset: DEFAULT_RANK_BUCKETS (docs/benchmarks.md, "Rank buckets by default", says why those).
    rank_buckets: tuple[int, ...] | None = setting(None, "extra ranks to compile for besides target_rank, e.g. "
                                                         "0,4,8: a request runs the smallest that holds its adapters "
                                                         "(0: no adapter, no LoRA branch run at all). Default: 0 and "
                                                         "target_rank/4 in slots and auto mode; empty: target_rank only")
    # engine/writers/fused.py and auto.py; docs/benchmarks.md says why the default is slots.
    adapter_mode: str = setting("slots", "slots: LoRA layers in the compiled model, adapters copied in per "
                                         "request; fused: adapters merged into the weights, restored from a "
                                         "pristine copy (any rank, conv LoRA; one adapter set per batch); "
                                         "auto: both, each request fused when its merge keeps at least "
                                         "fused_min_kept of its delta, else through the slots",
                                choices=ADAPTER_MODES)
    # docs/benchmarks.md ("What fused mode keeps") has the figures behind the default.
    fused_min_kept: float = setting(0.98, "fused mode: the least fraction of a request's intended weight "
                                          "delta the merged weights must carry (a bf16 merge drops delta "
                                          "elements under half a step of their weight); below it the request "
                                          "is refused (fused) or served through the slots (auto). 0: never "
                                          "(the loss is still reported)")
    fused_restore: str = setting("auto", "where fused mode's pristine weights are kept: device, "
                                         "host (pinned when CUDA), or auto (the device when they fit)",
                                 choices=FUSED_RESTORE)
    # Changes the compiled graphs (quantized matmuls): part of the compile fingerprint.
    base_quantization: str = setting("none", "quantize the base denoiser's Linear weights once at start-up "
                                             "(torchao, the hotlora[quant] extra): int8_weight_only (CPU or "
                                             "CUDA) or float8 (row-wise FP8, CUDA only); the adapters stay "
                                             "unfused LoRA branches in the serving dtype. Slots and mixed "
                                             "batches; not fused mode",
                                     choices=BASE_QUANTIZATIONS)
    text_encoder_lora: bool = setting(True, "merge adapters' text-encoder LoRA per request (no: skipped, and "
                                            "responses say so)")
    embedding_rows: int = setting(4, "token rows reserved per slot for pivotal-tuning embeddings "
                                     "(0: such adapters are refused)")
    limits: RequestLimits = setting(help="request limits", factory=RequestLimits)

    @model_validator(mode="after")
    def _refuse_impossible(self) -> "EngineConfig":
        """Each option's own rules and the combinations no engine can serve, refused at start-up."""
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be 'auto' or an integer >= 1, got {self.batch_size!r}")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if not self.chunk_budget_s >= 0:
            raise ValueError(f"chunk_budget_s must be >= 0 seconds, got {self.chunk_budget_s!r}")
        if self.size_policy not in SIZE_POLICIES:
            raise ValueError(f"size_policy must be one of {', '.join(SIZE_POLICIES)}, got {self.size_policy!r}")
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown:
            raise ValueError(f"tasks {', '.join(map(repr, unknown))} unknown; tasks: {', '.join(TASKS)}")
        if not (isinstance(self.max_reference_images, int) and 1 <= self.max_reference_images <= 8):
            raise ValueError(f"max_reference_images must be an integer in 1..8, got {self.max_reference_images!r}")
        if self.step_cache is not None and len(self.tasks) > 1:
            raise ValueError("step_cache wraps the text-to-image pipeline only: serve other tasks without it")
        if self.mixed and self.rank_buckets:
            raise ValueError("rank buckets apply to the slots of single-request packs, not to mixed batches")
        if self.adapter_mode not in ADAPTER_MODES:
            raise ValueError(f"adapter_mode must be one of {', '.join(ADAPTER_MODES)}, got {self.adapter_mode!r}")
        if not 0.0 <= self.fused_min_kept <= 1.0:
            raise ValueError(f"fused_min_kept must be in 0..1, got {self.fused_min_kept!r}")
        if self.fused_restore not in FUSED_RESTORE:
            raise ValueError(f"fused_restore must be one of {', '.join(FUSED_RESTORE)}, got {self.fused_restore!r}")
        if not (isinstance(self.embedding_rows, int) and 0 <= self.embedding_rows <= 64):
            raise ValueError(f"embedding_rows must be an integer in 0..64, got {self.embedding_rows!r}")
        if self.base_quantization not in BASE_QUANTIZATIONS:
            raise ValueError(f"base_quantization must be one of {', '.join(BASE_QUANTIZATIONS)}, "
                             f"got {self.base_quantization!r}")
        if self.adapter_mode in ("fused", "auto") and self.base_quantization != "none":
            raise ValueError(f"{self.adapter_mode} mode merges adapters into the base weights, which base_quantization="
                             f"{self.base_quantization!r} stores quantized (a merge would requantize them on every "
                             "request and lose the adapter's delta): use adapter_mode='slots' with a quantized base")
        if self.adapter_mode == "fused" and (self.mixed or self.rank_buckets):
            raise ValueError("fused mode holds one adapter set per forward batch in the weights themselves: "
                             "it has no mixed batches and no rank buckets")
        if self.adapter_mode == "auto" and self.mixed:
            raise ValueError("auto mode holds one adapter set per forward batch (fused into the weights or in the "
                             "slots): it has no mixed batches (mixed=True serves them through adapter banks)")
        return self

    # What the compiled graphs depend on; request limits, the device and the cache folder do not.
    # The sizes enter resolved (``sizes=``, the default one resolved from the model), like the dtype.
    FINGERPRINT_EXCLUDES: ClassVar[frozenset] = frozenset({
        "limits", "compile_cache_dir", "keep_compiler_headers", "device", "dtype", "height", "width", "sizes", "frames", "size_policy",
        "attention_backend", "text_encoder_lora", "embedding_rows", "fused_min_kept",
        "chunk_budget_s", "tasks", "max_reference_images"})  # text encoders run eagerly; tasks: see fingerprint

    def fingerprint(self, model: str | None, family: str, **resolved) -> str:
        """The compile-cache key: the model, the family, every option the graphs depend on, and the
        values resolved at load time (``resolved``: sizes, attention backend, dtype)."""
        options = {n: getattr(self, n) for n in type(self).model_fields if n not in self.FINGERPRINT_EXCLUDES}
        options["rank_buckets"] = self.bucket_ranks  # as the writer compiles them
        if len(self.tasks) > 1:  # other tasks add graphs; a text-to-image engine keeps the key it always had
            options["tasks"] = list(self.tasks)
            if "edit" in self.tasks:
                options["max_reference_images"] = self.max_reference_images
        return json.dumps({"model": model, "family": family, **options, **resolved}, sort_keys=True, default=repr)

    @property
    def bucket_ranks(self) -> tuple[int, ...]:
        """The rank buckets the slots are compiled for besides ``target_rank``: ``rank_buckets`` when
        given, else the default, which only the slots of single-request packs have (auto mode's
        included: its fused requests run bucket 0, no slot compute)."""
        if self.rank_buckets is not None:
            return self.rank_buckets
        if self.mixed or self.adapter_mode not in ("slots", "auto"):
            return ()
        return default_rank_buckets(self.target_rank)

    @property
    def batch_limit(self) -> int:
        """The largest batch compiled for (and the bound of a mixed batch)."""
        return self.max_batch_size if self.batch_size == "auto" else self.batch_size


__all__ = ["ADAPTER_MODES", "BASE_QUANTIZATIONS", "FUSED_RESTORE", "SIZE_POLICIES", "STEP_CACHE_BACKENDS", "TASKS",
           "EngineConfig", "RequestLimits", "StepCache", "default_rank_buckets", "format_size", "parse_size", "parse_sizes"]
