"""What hotlora knows of one diffusers model family, in one place.

A ``ModelFamily`` reads what diffusers already says (the pipeline's LoRA mixin: which component is
the denoiser, which text encoders take LoRA) and declares what it does not: default steps,
guidance and size, how guidance runs (the CFG style), whether negative prompts exist, the size
multiple, how a group of prompts is encoded, checks on a raw LoRA before diffusers' converters
see it, the memory plan's workload, and the tiny offline model the tests build. Every place that
would otherwise branch on a family's name asks its family instead; a new family is a subclass in a
module of its own, registered in ``hotlora.families``.

Nothing here imports torch or diffusers at import time: the Ray ingress, which runs without
torch, imports modules that name families.
"""

from __future__ import annotations

import inspect
from functools import cached_property
from typing import Any, ClassVar, Literal, Mapping

# How a pipeline runs guidance, read from its ``__call__``:
#   none   guidance-distilled (Flux.1-dev: a guidance embedding, one pass, no negative prompt)
#   batch  classifier-free guidance as one doubled batch [uncond..., cond...] (SDXL, SD3, SD1.5)
#   true   a second forward pass per step (Qwen-Image's ``true_cfg_scale``, Chroma, Wan)
CfgStyle = Literal["none", "batch", "true"]
# Tasks whose input images are the pipeline's for every prompt of its call, none noised away (no
# strength): an edit's references, image-to-video's first frame (one image; ``ModelFamily.task_arguments``).
REFERENCE_TASKS = ("edit", "image-to-video")
# PEFT's prefix on a saved adapter's keys (``base_model.model.``): the adapters package strips it;
# a family whose trainers write their own names under it (ai-toolkit's Krea 2) tells them apart.
PEFT_PREFIX = "base_model.model."


def lora_mixin_of(pipeline_type: type) -> type | None:
    """A pipeline class's LoRA loader mixin: the class in its MRO that declares the loadable modules."""
    for cls in pipeline_type.__mro__:
        if cls.__name__.endswith("LoraLoaderMixin") and "_lora_loadable_modules" in vars(cls):
            return cls
    return None


def denoiser_of(mixin: type) -> str | None:
    """The pipeline attribute a LoRA mixin loads the denoiser's LoRA into (``transformer``, ``unet``)."""
    loadable = mixin._lora_loadable_modules
    for attribute in ("transformer_name", "unet_name"):
        name = getattr(mixin, attribute, None)
        if name in loadable:
            return name
    return None


class ModelFamily:
    """One family's facts. Subclasses set the class attributes; instances are registered once."""

    name: ClassVar[str]
    pipeline_class: ClassVar[str]  # the text-to-image pipeline; its LoRA mixin owns the converters
    denoiser_class: ClassVar[str]  # the denoiser's diffusers class (a model_index.json names it)
    # Loadable modules of the LoRA mixin that are further denoisers, not text encoders (Wan 2.2's
    # low-noise expert ``transformer_2``): the mixin does not say which of its modules is which.
    other_denoisers: ClassVar[tuple[str, ...]] = ()
    default_steps: ClassVar[int]
    default_guidance: ClassVar[float]
    default_size: ClassVar[tuple[int, int]] = (1024, 1024)  # (height, width) of the published models
    cfg: ClassVar[CfgStyle] = "none"
    negative_prompts: ClassVar[bool] = False
    # False for a pipeline that ignores ``guidance_scale`` (distilled Flux.2 klein): a request that
    # sets one is refused rather than silently given the same image.
    takes_guidance: ClassVar[bool] = True
    # Block classes regional compilation repeats, for denoisers that declare no ``_repeated_blocks``
    # (SD3's transformer): the family names them.
    repeated_blocks: ClassVar[tuple[str, ...]] = ()
    # Repeated block classes whose outputs are views of a larger tensor (Flux's single-stream block
    # returns slices of its joined text and image sequence): every instance after the first would
    # receive other strides than the first and compile graphs of its own. Compiled, their outputs are
    # made contiguous inside their graph.
    contiguous_block_outputs: ClassVar[tuple[str, ...]] = ()
    # Whether some calls of the compiled repeated blocks run eagerly (``eager_block_call`` says which):
    # a code path whose Python ints change with every request (Qwen-Image 2.1's cache-filling first
    # step passes the prompt's length in a slice and a list) would otherwise compile per request.
    eager_block_paths: ClassVar[bool] = False
    # Height and width in latent pixels are multiples of this (the pixel multiple is this times
    # the VAE's factor).
    latent_multiple: ClassVar[int] = 1
    # How several served sizes share compiled graphs: True turns the token / spatial dimensions
    # dynamic at warm-up (bench/sizes.py measures both ways), False compiles one graph per size.
    dynamic_sizes: ClassVar[bool] = True
    # Module names distinctive of this family's denoiser, as diffusers and its trainers name them (a
    # regex searched in LoRA keys), and lowercase words trainers write for its base model in a file's
    # metadata: both only word the refusal of another family's LoRA (``families.recognize``).
    lora_key_pattern: ClassVar[str] = ""
    base_model_markers: ClassVar[tuple[str, ...]] = ()
    # True: every dimension dynamic from the first compile (torch.compile's dynamic=True), for
    # denoisers that see each prompt's own length: one graph per code path instead of static ones
    # first. None: dims turn dynamic when they first change (dynamo's automatic dynamic shapes).
    compile_dynamic: ClassVar[bool | None] = None
    # Graphs one writer state may compile (dynamo's recompile limit is raised to cover them all).
    graphs_per_state: ClassVar[int] = 8
    # Pivotal-tuning embedding file keys -> the text encoder they extend.
    embedding_keys: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Each text encoder's tokenizer and the pipeline argument its prompt comes in.
    tokenizer_of: ClassVar[Mapping[str, str]] = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
    prompt_argument_of: ClassVar[Mapping[str, str]] = {"text_encoder": "prompt", "text_encoder_2": "prompt_2"}
    # Built-in plan names -> the module of ``hotlora.fullsize`` holding the published configuration.
    full_size_models: ClassVar[Mapping[str, str]] = {}
    tiny_size: ClassVar[int]  # image side in pixels the tiny offline model is built for
    # Pipeline config values (``register_to_config`` arguments, saved in model_index.json) that
    # tell this family from another on the same pipeline class: Flux.2 klein's ``is_distilled``.
    pipeline_config: ClassVar[Mapping[str, Any]] = {}
    # Made from a pipeline's facts (``families.generic``) rather than a module of its own: found only
    # when no explicit family matches.
    generic: ClassVar[bool] = False
    # Whether the banks writer (``mixed=True``: several requests' adapters in one forward batch) can
    # serve it: that needs the batch layout of its forward passes and ``encode_prompts``.
    mixed_batches: ClassVar[bool] = True
    # Linear layers (name prefixes in the denoiser) whose input holds the batch's samples packed
    # into one token sequence, no batch dimension (Z-Image's embedders): the banks writer binds
    # their per-sample adapters by the token counts ``packed_segments`` reads off each call.
    packed_linears: ClassVar[tuple[str, ...]] = ()
    # What requests must share, beyond their denoising parameters, to share a mixed batch
    # (``mixed_batch_texts``), in words for the refusal; "" where nothing more.
    mixed_batch_shares: ClassVar[str] = ""
    # Linear layers (name prefixes) with a row every sample of a forward batch shares (Qwen-Image
    # 2.1's t = 0 timestep row, which modulates every sample's prompt tokens): no per-sample
    # adapter can apply there, so the banks leave them out and refuse adapters that touch them.
    mixed_batch_shared_rows: ClassVar[tuple[str, ...]] = ()
    # Linear layers (a regex of their full names) whose input is sequence-first ([tokens, batch, ...]:
    # ERNIE-Image's MLPs and final layer): the banks find each sample on the second axis.
    sequence_first_linears: ClassVar[str] = ""
    # Whether the slots hold LoRA biases (PEFT's ``lora_B.bias``; lightx2v's ``.diff_b`` on Wan): each
    # LoRA layer then adds a bias every step, zeros for adapters without one, so only where the
    # family's popular adapters carry them. Slots and banks; fused mode merges LoRA biases for every
    # family (into the layers' own biases: nothing per step).
    lora_biases: ClassVar[bool] = False
    # 1x1 Conv2d layers (a regex of their full names) the slots and banks hold LoRA on, beside the
    # Linears: a pointwise conv is a Linear over the channels, so its LoRA factors ([r, in, 1, 1],
    # [out, r, 1, 1]) are a Linear's with two unit axes. For the layers the family's trainers wrap by
    # default (SD1.x's attention ``proj_in`` / ``proj_out``); "" where none.
    pointwise_convs: ClassVar[str] = ""
    # What the pipeline makes: "images" (``.images``, ``num_images_per_prompt``) or "frames" (a
    # video family: ``.frames``, ``num_videos_per_prompt``); the engine's output kind of that name
    # (``engine.results.output_kind``) joins, finishes and names them.
    output_kind: ClassVar[str] = "images"
    # Video families: the frames a video has when a request and the model say nothing, and the
    # VAE's temporal factor t (a count must be t*k + 1: the first frame is kept, the rest compressed
    # t to 1). None / 0 for image families, whose requests take no ``num_frames``.
    default_frames: ClassVar[int | None] = None
    frame_multiple: ClassVar[int] = 0
    # A video family's frame rate: what its videos are timed at when encoded (the model card's)
    # and how OpenAI's videos API's ``seconds`` becomes a frame count (server/routes_videos.py).
    fps: ClassVar[int | None] = None
    # The fewest denoising steps the pipeline runs right (LTX's scheduler divides by zero on a
    # one-step schedule: a video of NaN), and why; a request for fewer is refused.
    min_steps: ClassVar[int] = 1
    min_steps_reason: ClassVar[str] = ""
    # False where the pipelines sharing the family's mixin and denoiser class are other checkpoints
    # (Wan's and LTX's image-to-video: an image-conditioned transformer), not variants it serves.
    serves_variants: ClassVar[bool] = True
    # Pipeline classes of this family's checkpoints that make nothing from text alone, each with the
    # one task such a checkpoint serves (Wan's image-to-video checkpoints: a transformer that takes the
    # input image's latents beside the noise). A model directory of one serves that task only.
    conditioned_checkpoints: ClassVar[Mapping[str, str]] = {}
    # Step-cache backends refused on this family, each with the reason said at start-up.
    unserved_step_caches: ClassVar[Mapping[str, str]] = {}

    def __repr__(self) -> str:
        return f"<ModelFamily {self.name}>"

    # ------------------------------------------------------------------ read from diffusers

    @cached_property
    def pipeline_type(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    @cached_property
    def lora_mixin(self) -> type:
        """The LoRA loader mixin of the pipeline: the class in its MRO that declares the loadable modules."""
        mixin = lora_mixin_of(self.pipeline_type)
        if mixin is None:
            raise TypeError(f"{self.pipeline_class} has no LoRA loader mixin")
        return mixin

    @cached_property
    def denoiser(self) -> str:
        """The pipeline attribute (and LoRA key prefix) of the model that gets the slots."""
        name = denoiser_of(self.lora_mixin)
        if name is None:
            raise TypeError(f"{self.lora_mixin.__name__} names no denoiser among {self.lora_mixin._lora_loadable_modules}")
        return name

    @cached_property
    def lora_text_encoders(self) -> tuple[str, ...]:
        """Text encoders diffusers loads LoRA into: the mixin's loadable modules less the denoisers
        (``denoiser`` and ``other_denoisers``)."""
        return tuple(m for m in self.lora_mixin._lora_loadable_modules
                     if m != self.denoiser and m not in self.other_denoisers)

    # Modules beside the denoisers that the mixin loads LoRA into with the model's own
    # ``load_lora_adapter`` (LTX-2's connectors) rather than as a text encoder: their part of a file is
    # converted as the denoiser's is; the engine applies it as a text encoder's (unfused, per request).
    model_lora_parts: ClassVar[tuple[str, ...]] = ()

    def experts(self, pipeline) -> dict[str, Any]:
        """The models a loaded pipeline denoises with, the denoiser first (pipeline attribute ->
        model): each gets slots and a compile. One, unless the family's pipeline switches between
        experts (Wan 2.2 A14B)."""
        return {self.denoiser: getattr(pipeline, self.denoiser)}

    def warmup_steps(self, pipeline, steps: int) -> int:
        """Denoising steps a warm-up pass runs, at least ``steps``: more where so few would leave a
        model of ``experts`` uncalled (and uncompiled), or than ``fewest_steps``."""
        return max(steps, self.fewest_steps(pipeline)[0])

    def fewest_steps(self, pipeline) -> tuple[int, str]:
        """The fewest denoising steps a loaded pipeline runs right, and why where more than one: the
        family's ``min_steps``, and two wherever the scheduler's config sets ``shift_terminal``
        (FlowMatchEulerDiscreteScheduler stretches the schedule by its last sigma, a division by zero on
        one step: Qwen-Image's and Qwen-Image 2.1's published schedulers, 0.02, gave a NaN image)."""
        config = getattr(getattr(pipeline, "scheduler", None), "config", None) or {}
        if self.min_steps < 2 and config.get("shift_terminal"):
            return 2, (f"its scheduler's shift_terminal ({config['shift_terminal']}) stretches the schedule by its "
                       f"last step's sigma, which divides by zero on a one-step schedule and makes an image of NaN")
        return self.min_steps, self.min_steps_reason

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """Every text encoder an adapter can change (LoRA or embeddings), in pipeline order."""
        return tuple(sorted({*self.lora_text_encoders, *(te for _, te in self.embedding_keys)}))

    def matches(self, pipeline_type: type, denoiser_class: str | None = None) -> int:
        """How well a pipeline class is this family's: 2 when it is (or subclasses) the family's
        pipeline; 1 for a variant that shares the LoRA mixin and the denoiser class (img2img,
        inpaint, ... do not subclass the text-to-image pipeline); 0 otherwise. A family sharing a
        mixin with another (Chroma uses Flux's) is told apart by its denoiser class."""
        names = {cls.__name__ for cls in pipeline_type.__mro__}
        if self.pipeline_class in names:
            return 2
        if names & set(self.conditioned_checkpoints):
            return 1
        if not self.serves_variants:
            return 0
        if denoiser_class is None:  # the constructor's annotation of what its own mixin loads LoRA into
            mixin = lora_mixin_of(pipeline_type)
            annotation = inspect.signature(pipeline_type.__init__).parameters.get(denoiser_of(mixin) if mixin else None)
            denoiser_class = getattr(getattr(annotation, "annotation", None), "__name__", None)
        # The denoiser class first: the mixin's check imports this family's pipeline (and its models),
        # which recognising another family's model has no need of.
        return int(denoiser_class == self.denoiser_class and self.lora_mixin.__name__ in names)

    def fits_config(self, config: Mapping[str, Any] | None) -> bool:
        """Whether a pipeline with this config (its model_index.json; None: unknown, the pipeline's
        defaults) is this family's: every ``pipeline_config`` value matches, a missing one taking
        the pipeline constructor's default."""
        parameters = inspect.signature(self.pipeline_type.__init__).parameters
        config = config or {}
        return all(config.get(key, getattr(parameters.get(key), "default", None)) == value
                   for key, value in self.pipeline_config.items())

    def describe(self) -> dict[str, Any]:
        return {"family": self.name, "pipeline": self.pipeline_class, "denoiser": f"{self.denoiser} ({self.denoiser_class})",
                "cfg": self.cfg, "request_options": list(self.request_options()),
                "text_encoder_lora": list(self.lora_text_encoders), "embeddings": sorted({k for k, _ in self.embedding_keys}),
                "lora_biases": "slots, mixed batches and fused" if self.lora_biases else "fused mode only",
                # Conv LoRA: fused mode merges it on any Conv2d; these 1x1 convs every mode holds.
                "slot_convs": self.pointwise_convs or None,
                # Tasks (``--tasks``) and the checkpoints that serve one task alone (Wan's image-to-video).
                "tasks": list(self.served_tasks()), "single_task_checkpoints": dict(self.conditioned_checkpoints),
                "defaults": {**self.defaults, "height": self.default_size[0], "width": self.default_size[1]},
                "plans": list(self.full_size_models),
                # Mixed batches (mixed=True): served, and what requests must share to share one.
                "mixed": self.mixed_batches,
                **({"mixed_batches_share": self.mixed_batch_shares} if self.mixed_batches and self.mixed_batch_shares
                   else {})}

    def checkpoint_defaults(self, pipeline) -> dict[str, Any]:
        """Request defaults a loaded checkpoint's own config implies over the family's (Krea 2's
        distilled checkpoint: 8 steps without guidance); a model's hotlora.json still wins."""
        return {}

    def schedule_steps(self, pipeline) -> int | None:
        """The denoising steps a loaded pipeline always runs, whatever ``num_inference_steps`` says (a
        checkpoint that fixes its own sigma schedule: Qwen-Image-2.1-Turbo's ``sample_sigmas``); None
        where a request's steps are run. Such a model's default is that count, and another is refused."""
        return None

    def pipeline_default_size(self, pipeline) -> tuple[int, int]:
        """(height, width) a loaded pipeline of this family generates when none is configured."""
        sample = getattr(pipeline, "default_sample_size", None)  # ZImagePipeline has none: its __call__ says 1024
        if not sample:
            return self.default_size
        side = int(sample * pipeline.vae_scale_factor)
        return side, side

    def check_engine_config(self, config) -> None:
        """Raise (UnservedModel) at start-up for an engine option this family cannot serve."""
        if config.mixed and not self.mixed_batches:
            from hotlora.families import UnservedModel

            raise UnservedModel(f"{self.pipeline_class} is served by hotlora's {self.name!r} family, which does not serve "
                                f"mixed batches (mixed=True): {self.mixed_batches_refused}; serve it with mixed=False")

    # ------------------------------------------------------------------ declared: tasks beyond text-to-image

    # Task -> the diffusers pipeline class that runs it on this family's components (made from the
    # warm pipeline with ``from_pipe``: every weight, LoRA slot and compiled block shared).
    task_pipelines: ClassVar[Mapping[str, str]] = {}
    # Task -> why it is not served although diffusers has a pipeline for it (the pipeline cannot run
    # on this family's models): said by the engine that is asked for it.
    refused_tasks: ClassVar[Mapping[str, str]] = {}
    # The reference images the edit pipeline takes with one prompt (Kontext: one; Flux.2: several).
    max_edit_references: ClassVar[int] = 1
    # Whether the edit pipeline takes one reference per batch position: an ``image`` list as long as
    # the batch gives each position its own (Kontext's ``prepare_latents`` repeats a reference only
    # when there are fewer; its VAE encodes each with its own generator). Edits of one reference with
    # different images then share a forward batch of a mixed engine, as image-to-image requests do.
    # Not Flux.2 (a list is several references of EVERY prompt) nor Qwen-Image-Edit (one prompt a call).
    edit_references_per_image: ClassVar[bool] = False

    def served_tasks(self) -> tuple[str, ...]:
        return ("text-to-image", *self.task_pipelines)

    def task_pipeline_type(self, task: str) -> type:
        import diffusers

        return getattr(diffusers, self.task_pipelines[task])

    def checkpoint_task(self, loaded) -> str | None:
        """The one task a checkpoint that makes nothing from text alone serves
        (``conditioned_checkpoints``, by the loaded pipeline's class); None for any other."""
        names = [cls.__name__ for cls in type(loaded).__mro__]
        return next((self.conditioned_checkpoints[n] for n in names if n in self.conditioned_checkpoints), None)

    def text_to_image_pipeline(self, loaded):
        """The pipeline text-to-image runs on, from the one a model directory loads as (its
        model_index.json's class): itself, unless that pipeline cannot make an image from text
        alone (a Qwen-Image-Edit checkpoint's edit pipeline needs a reference image). A checkpoint
        of another pipeline that only shares the family's LoRA mixin and denoiser class (a Fill,
        ControlNet, PAG, refiner or KV-cache checkpoint: ``family_of_class`` names its family) is
        refused here, at start-up: its weights or its ``__call__`` are another's, and called as the
        family's pipeline it failed at warm-up with a TypeError (Flux.2 klein's KV pipeline) or
        would serve what it was not made for."""
        if isinstance(loaded, self.pipeline_type):
            return loaded
        from hotlora.families import UnservedModel

        kind = type(loaded).__name__
        tasks = ", ".join(self.task_pipelines)
        raise UnservedModel(f"{kind} checkpoints are not served: the {self.name} family serves {self.pipeline_class} "
                            f"checkpoints (text-to-image{', and ' + tasks + ' made from them' if tasks else ''}); "
                            f"{kind} shares its LoRA mixin and denoiser class, but its weights or its __call__ are "
                            f"another pipeline's (the model's model_index.json names {kind})")

    def task_pipeline(self, task: str, loaded, share):
        """``task``'s pipeline on the loaded pipeline's components: ``share(cls, loaded)``, the
        engine's ``from_pipe`` that shares every module and keeps every dtype (``warm.shared_pipeline``);
        a conditioned checkpoint's own task (``checkpoint_task``) runs on the loaded pipeline itself."""
        if task == self.checkpoint_task(loaded):
            return loaded
        return share(self.task_pipeline_type(task), loaded)

    def default_strength(self, task: str) -> float | None:
        """The strength a request of ``task`` runs with when it sets none: the task pipeline's own
        default (diffusers': 0.6 for Flux img2img, 0.3 for SDXL's); None where it takes no strength."""
        if task not in self.task_pipelines:
            return None
        parameter = inspect.signature(self.task_pipeline_type(task).__call__).parameters.get("strength")
        return None if parameter is None else float(parameter.default)

    # How the image-to-image and inpaint pipelines turn a strength into steps (``get_timesteps``):
    # the flow-matching ones keep ``steps x strength`` a float, the Stable Diffusion U-Net ones floor it.
    strength_floors_steps: ClassVar[bool] = False

    def denoising_steps(self, steps: int, strength: float) -> int:
        """The steps a task pipeline runs of ``steps`` at ``strength``, as its ``get_timesteps`` counts
        them (``t_start = int(steps - min(steps x strength, steps))``); 0 raises in diffusers."""
        kept = min(int(steps * strength) if self.strength_floors_steps else steps * strength, steps)
        return steps - int(max(steps - kept, 0))

    def task_arguments(self, task: str, images: list, masks: list | None, strength: float | None,
                       references: int) -> dict[str, Any]:
        """The task pipeline's image arguments for one forward batch. Image-to-image and inpaint:
        ``images`` and ``masks`` one per image of the batch (the pipelines then draw each image's
        VAE sample from that image's own generator, so an image is the same whatever chunk it runs
        in; given one image for several, diffusers' Flux img2img samples it from the first
        generator of the call). Edit: its ``references`` images, the same for every prompt (the
        edit pipelines encode them with the VAE's mean: no generator is drawn); image-to-video its one
        first frame, the same way (Wan's encodes it with the VAE's mode); where the family takes
        a reference per batch position (``edit_references_per_image``), a batch of several requests'
        edits gives one image per image of the batch, as ``references`` of them."""
        arguments: dict[str, Any] = {}
        if task in REFERENCE_TASKS:
            arguments["image"] = images if references > 1 else images[0]
            return arguments
        arguments["image"] = list(images)
        if masks is not None:
            arguments["mask_image"] = list(masks)
        if strength is not None:
            arguments["strength"] = strength
        return arguments

    def call_prompts(self, task: str, texts: Mapping[str, str], count: int, per_prompt: str) -> dict:
        """One call's prompt arguments for ``count`` images of one prompt (``texts``: prompt and
        negative prompt arguments): the prompt once, ``per_prompt`` (``num_images_per_prompt``) ``count``."""
        return {per_prompt: count, **texts}

    def input_frame_counts(self, pipeline) -> tuple[int, ...]:
        """The input images an image-to-video request may give ``pipeline`` (its image-to-video
        pipeline), the one warm-up runs first: 1, the first frame; 2, the first and the last."""
        return (1,)

    def input_frames_hint(self, counts: tuple[int, ...], given: int) -> str:
        """What to say after refusing ``given`` input images where ``counts`` are served (Wan: the
        checkpoints that take a last frame)."""
        return ""

    # Image-to-video pipelines that encode the first frame once per video, its latents sampled with
    # that video's generator (LTX's ``image[i]``): given the image once per video of the batch. Wan's
    # take it once a call.
    first_frame_per_video: ClassVar[bool] = False

    # Why mixed batches are not served, where ``mixed_batches`` is False.
    mixed_batches_refused: ClassVar[str] = ""

    def mixed_batch_texts(self, prompt: str, negative: str | None, text_state: tuple) -> tuple:
        """The part of a request's batch key its texts make (``PreparedRequest.shared_texts``):
        requests share a mixed batch only where these are equal. ``text_state``: what the text
        encoders hold for its adapters. Nothing by default: prompts are encoded group by group
        (``encode_prompts``) and padding is masked."""
        return ()

    def packed_segments(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, list[int]]:
        """Per ``packed_linears`` prefix, each sample's token count in that layer's packed input,
        read off one denoiser call's arguments (the banks writer's hook calls it before the
        denoiser runs). Only families that declare ``packed_linears`` are asked."""
        raise NotImplementedError(f"the {self.name} family declares no packed Linear layers")

    # Pipelines of this family's LoRA mixin that it does not serve, and why (read from their ``__call__``):
    # the start-up refusal says this instead of the generic family's convention check.
    unserved_pipelines: ClassVar[Mapping[str, str]] = {}

    # ------------------------------------------------------------------ declared: requests and guidance

    @property
    def defaults(self) -> dict[str, Any]:
        return {"num_inference_steps": self.default_steps, "guidance_scale": self.default_guidance,
                **({"num_frames": self.default_frames} if self.video else {})}

    @property
    def video(self) -> bool:
        """Whether requests take ``num_frames`` (the pipeline makes videos)."""
        return self.default_frames is not None

    def frame_problems(self, num_frames) -> list[str]:
        """What is wrong with a frame count for this family's pipeline (its VAE's 4k + 1 rule), as
        problems for one InvalidRequest; the pipeline itself would round it silently."""
        if not (isinstance(num_frames, int) and not isinstance(num_frames, bool) and num_frames >= 1):
            return ["num_frames must be a positive integer"]
        t = self.frame_multiple
        if t and (num_frames - 1) % t:
            lower = (num_frames - 1) // t * t + 1
            return [f"num_frames must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...) for the {self.name} family's "
                    f"video VAE, got {num_frames} (nearest: {lower} or {lower + t})"]
        return []

    def audio_rate(self, pipeline) -> int | None:
        """Samples a second of the sound track the pipeline makes with each video (its output's
        ``.audio``), or None: a model that makes no sound (every family but LTX-2)."""
        return None

    def vae_scale_factor(self, pipeline) -> int:
        """Pixels per latent pixel, spatially (``pipeline.vae_scale_factor`` where the pipeline has one)."""
        return pipeline.vae_scale_factor

    def size_multiple(self, vae_scale_factor: int) -> int:
        """Height and width in pixels must be multiples of this."""
        return vae_scale_factor * self.latent_multiple

    def doubles_batch(self, guidance_scale: float) -> bool:
        """Whether a request at this guidance runs as a doubled [uncond, cond] batch (and encodes
        its negative prompt)."""
        return self.cfg == "batch" and guidance_scale > 1

    def batch_factor(self, guidance_scale: float) -> int:
        return 2 if self.doubles_batch(guidance_scale) else 1

    def warmup_guidance_scales(self, default: float) -> list[float]:
        """Guidance values whose batch shapes differ, each warmed up: under batch CFG a request
        at guidance 1 runs a batch half as big."""
        return [default, *([1.0] if self.cfg == "batch" and default != 1.0 else [])]

    def second_guidance_problems(self, guidance_scale: float, guidance_scale_2: float) -> list[str]:
        """What is wrong with a second expert's guidance beside ``guidance_scale``, as the family's
        pipeline reads the pair (both already numbers in range; only a model of two experts asks)."""
        return []

    def call_arguments(self, guidance_scale: float) -> dict[str, Any]:
        """The pipeline's keyword arguments for hotlora's one ``guidance_scale`` (plus any option the
        family fixes): Qwen-Image takes it as ``true_cfg_scale``, most as ``guidance_scale``. The
        warm-up, every request and the tests' plain-diffusers reference call the pipeline with these."""
        return {"guidance_scale": guidance_scale}

    def eager_block_call(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether a repeated block called with these keyword arguments runs eagerly (only
        where ``eager_block_paths``)."""
        return False

    def default_negative_prompt(self, guidance_scale: float) -> str | None:
        """The negative prompt a request without one runs with (None: the pipeline's own default).
        Qwen-Image runs true CFG only when it is given one."""
        return None

    def warmup_prompts(self, pipeline=None) -> tuple[str | tuple[str, ...], ...]:
        """Prompts warm-up runs, so that every text-shape steady state sees is compiled: one for a
        pipeline that pads its prompts to a fixed length, more where lengths reach the denoiser.
        A tuple is one prompt per image of the batch, cycled (a mixed batch's unequal prompts)."""
        return ("warm-up",)

    def request_options(self) -> tuple[str, ...]:
        """What a request of this family may set (the 422 for an option it does not take lists them)."""
        return ("prompt", *(("negative_prompt",) if self.negative_prompts else ()), "num_images",
                "num_inference_steps", *(("guidance_scale",) if self.takes_guidance else ()), "height", "width",
                *(("num_frames",) if self.video else ()), "seed", "output_type")

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """The pipeline's own ``encode_prompt`` on one group of prompts (one text-encoder state):
        the embedding arguments its ``__call__`` takes instead of prompts."""
        raise NotImplementedError(f"{self.name}: encoding prompts per group is not declared")

    def join_encoded(self, rows: list[Mapping[str, Any]]) -> dict:
        """One batch's prompt arguments from rows ``encode_prompts`` made for groups encoded apart
        (each row one image's slice): tensors concatenated, lists (per-prompt tensors) joined. A
        pipeline padding a batch to its longest prompt pads here too (Qwen-Image)."""
        import torch

        return {name: ([item for row in rows for item in row[name]] if isinstance(rows[0][name], list)
                       else torch.cat([row[name] for row in rows])) for name in rows[0]}

    # ------------------------------------------------------------------ declared: adapters

    def converter_config(self, denoiser) -> Mapping | None:
        """What diffusers' converters need of the served denoiser (SDXL's kohya mapping reads the
        U-Net's config); None when they need nothing."""
        return None

    def lora_state_dict_kwargs(self, denoiser_config: Mapping | None) -> dict:
        """Arguments for the mixin's ``lora_state_dict`` beyond ``return_lora_metadata``."""
        return {}

    def prepare_raw_lora(self, raw: Mapping[str, Any], label: str) -> dict:
        """``raw`` as this family's diffusers converter should get it: a trainer's layout the
        converter mishandles rewritten into one it reads right, or refused (AdapterFormatError)
        where serving it would silently differ from the file. Runs after ``check_raw_lora``;
        by default ``raw`` unchanged."""
        return dict(raw)

    def converter_reads_peft_prefix(self, keys) -> bool:
        """Whether the LoRA ``keys`` under PEFT's ``base_model.model.`` prefix are a trainer's own
        layout that diffusers' converter for this family reads as they are (ai-toolkit's Krea 2
        files: the original model's names); False (the default): a PEFT save over the denoiser's
        own module names, which hotlora reads with its adapter_config.json."""
        return False

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        """Refuse, with AdapterFormatError, a file diffusers' converter for this family would hang
        or crash on; runs before the converter."""

    # ------------------------------------------------------------------ declared: the memory plan

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """(tokens, layer width) the denoiser's activation peak scales with for one image of
        ``latent_pixels``; ``configs``: component -> its config.json."""
        raise NotImplementedError(f"{self.name}: no activation workload declared for the memory plan")

    # ------------------------------------------------------------------ declared: the tiny offline model

    def build_tiny(self, seed: int = 0):
        """A real diffusers pipeline of this family from small configs, seeded random weights and
        tokenizers made in memory (nothing downloaded)."""
        raise NotImplementedError(f"{self.name}: no tiny offline model")

    # Further tiny models of this family the tests build (another layout of its checkpoints: Wan 2.2's
    # two experts), by name, for ``build_tiny_variant``.
    tiny_variants: ClassVar[tuple[str, ...]] = ()

    def build_tiny_variant(self, variant: str, seed: int = 0):
        """The tiny model of one of ``tiny_variants``."""
        raise ValueError(f"{self.name}: no tiny variant {variant!r} (variants: {', '.join(self.tiny_variants) or 'none'})")

    def tiny_defaults(self) -> dict[str, Any]:
        """The tiny model's ``hotlora.json`` defaults beyond its size and steps (a video family's
        frame count)."""
        return {}

    def build_tiny_edit(self, seed: int = 0):
        """The tiny model of this family's edit checkpoints where they are another pipeline than the
        text-to-image one (Qwen-Image-Edit); None: ``build_tiny`` serves every declared task."""
        return None

    def trainer_lora(self, path, linears, sd, rank: int, seed: int):
        """``sd`` (a random PEFT-form LoRA over ``linears``) rewritten at ``path`` in the layout of
        this family's most used trainer, as that trainer writes it (what it covers may differ:
        see each family); None when the family declares no such layout."""
        return None

    def write_trainer_samples(self, pipeline, linears, out, rank: int, attention_only) -> dict:
        """Sample adapters in the layouts this family's trainers write (beyond diffusers and PEFT),
        name -> path; the tiny model's ``adapters/`` hold them."""
        return {}
