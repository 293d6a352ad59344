"""Activation memory of a pack: a per-token, per-layer model with coefficients measured on the CPU.

Inference runs without autograd, so a block's activations are freed when the next block starts:
the denoiser's peak is the peak inside ONE layer (block), whatever the depth, and it grows with
the tokens of the forward batch times the layer's width. The model is therefore

    denoiser peak = k x batch x tokens x width x bytes per element + c
    VAE decode peak = k x images x height x width x first-level channels x bytes + c

with ``(k, c)`` per family, dtype and writer (the VAE: per dtype, for one image and for batches).
``c`` is what the kernels allocate whatever the size: on the CPU, oneDNN reorders a convolution's
weights on every call, and SDXL's largest (the up blocks' 2560 -> 1280 3x3) is 112.5 MiB in float32;
Flux's transformer (Linear layers only) has none. It is kept on every device (a GPU's kernels do
not reorder weights this way): a small margin, not a claim.

- batch: the images of a chunk, doubled for classifier-free guidance where the pipeline runs the
  unconditional half in the same batch (SDXL with guidance > 1; Flux-dev has no CFG batch).
- tokens: Flux: image tokens (height/16 x width/16) + the T5 text tokens (512, FluxPipeline's
  ``max_sequence_length``). width: attention heads x head dim (3072).
  SDXL: latent pixels (height/8 x width/8); width: the U-Net's first ``block_out_channels`` (320).
  The U-Net's other levels (640 and 1280 channels at 1/4 and 1/16 of the pixels) and the skip
  connections it holds scale with the same product, so one coefficient covers the architecture
  (calibrated on SDXL's real widths with one transformer layer per level: the layers of a level
  run one after the other, and only one is alive at a time).
- The other image families (Z-Image, Qwen-Image and 2.1, FLUX.2 dev and klein, SD3, Chroma): each
  family's own ``plan_tokens`` (image tokens plus its text tokens, one sequence or two streams),
  measured through the family's pipeline with its denoiser at the published widths
  (``pipeline_denoiser_peak``); SD1.5's U-Net as SDXL's. Qwen-Image's VAEs decode an image as one
  frame of a causal video VAE: each has a fit of its own (``f`` = 0), as a video family's VAE has.
- The VAE coefficients are measured on Flux's VAE; SDXL's decoder is the same architecture
  (128/256/512/512 channels) but for its 4 latent channels.
- writer: ``slots`` / ``banks`` (LoRA branches add their temporaries) or ``none`` (fused mode, no
  LoRA layers in the model). Banks use the slots' coefficient (not calibrated separately).
- The VAE has two coefficients, measured: one image decodes with more memory per pixel than a
  batch does (on the CPU 7.6 vs 6.0 widths per pixel in float32, 9.5 vs 6.0 in bfloat16).
- A family with a VAE of its own (Wan's causal video VAE) has ``vae_decode`` coefficients
  ``(k, c, f)``: it decodes one latent frame at a time, so its peak is one frame's activations
  (``k`` x videos x pixels x base_dim x bytes, fitted over sizes at one frame count) plus the
  decoded video, which grows with the frames (``f`` x videos x frames x pixels x 3 x bytes, fitted
  over frame counts at one size), measured on Wan 2.1's VAE at its real width (base_dim 96). The
  plan decodes the family's default frame count (81 for Wan). Wan 2.2's VAE (TI2V-5B's:
  ``is_residual``, a 2 x 2 patch, 16x spatial, decoder_base_dim 256) is another architecture with
  the same form and its own ``residual_vae_decode`` fit (``vae_part``), measured at its real widths
  (Wan 2.1's fit scaled by its 256 channels would be 3x its measured per-pixel peak: its widest
  stage runs at half the pixels, before the patch is undone). LTX-Video's VAE has the same form,
  fitted the same way on its real widths; its decoder is not causal (every frame at once), so
  there ``f`` carries the whole decoder's activations per decoded frame and ``k`` what does not grow
  with the frames (161 frames planned).

The coefficients live in ``coefficients.py`` beside this file, written by
``python bench/plan_calibrate.py``, which measures ``peak_allocated`` below on real-width,
reduced-depth models built from the published configurations at small sizes and fits ``k`` by
least squares; ``tests/unit/test_plan_activations.py`` checks the prediction against new
measurements at other sizes. What is measured: the peak of the bytes the torch CPU allocator holds
above what it held when the forward began (every allocation and free, from the profiler's memory
events), the same quantity ``torch.cuda.max_memory_allocated`` reports on a GPU. Not measured
here: the CUDA context and the caching allocator's fragmentation (outside the allocator's count),
and what compiled graphs save or add over eager mode (inductor fuses elementwise temporaries away:
the eager peak is the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotlora.families import ModelFamily

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "bfloat16"}


@dataclass(frozen=True)
class Workload:
    """One forward of the denoiser and one VAE decode, as the activation model sees them."""

    batch: int  # denoiser batch (CFG-doubled where the pipeline does it)
    tokens: int  # per sample
    width: int  # the layer width the peak scales with
    images: int  # VAE decode batch
    pixels: int  # per image
    vae_channels: int
    frames: int = 1  # decoded frames per video (1: an image)
    vae_part: str = "vae_decode"  # a family's own video-VAE fit to use (``vae_part``)


def vae_scale_factor(vae_config: dict) -> int:
    """Pixels per latent pixel, each way: AutoencoderKL-style VAEs halve at every block but the
    last; the Wan-style ones (Qwen-Image's) at every ``temperal_downsample`` stage, or say it
    (``scale_factor_spatial``, Qwen-Image-2.1's); LTX-Video's patchify, then halve at every
    ``spatio_temporal_scaling`` stage (32); Sana's DC-AE at every encoder stage but the first (32),
    as their pipelines compute it."""
    if "encoder_block_out_channels" in vae_config:  # AutoencoderDC
        return 2 ** (len(vae_config["encoder_block_out_channels"]) - 1)
    if "spatio_temporal_scaling" in vae_config:  # LTX-Video's: a patch, then the scaling stages
        return vae_config.get("patch_size", 1) * 2 ** sum(vae_config["spatio_temporal_scaling"])
    if "block_out_channels" in vae_config:
        return 2 ** (len(vae_config["block_out_channels"]) - 1)
    if vae_config.get("scale_factor_spatial"):
        return int(vae_config["scale_factor_spatial"])
    return 2 ** len(vae_config["temperal_downsample"])


def vae_width(vae_config: dict) -> int:
    """The channels of the VAE's first (widest-resolution) stage, what its decode peak scales with."""
    if "block_out_channels" in vae_config:
        return vae_config["block_out_channels"][0]
    if "decoder_block_out_channels" in vae_config:  # AutoencoderDC
        return vae_config["decoder_block_out_channels"][0]
    return vae_config.get("decoder_base_dim") or vae_config["base_dim"]


def vae_part(vae_config: dict) -> str:
    """Which of a family's own video-VAE fits a VAE's decode uses: Wan 2.2's residual VAE
    (``is_residual``: residual up blocks over a 2 x 2 patch) has its own, the others ``vae_decode``.
    Sana's DC-AE (``dc_ae_decode``) is another architecture (EfficientViT blocks, linear attention,
    32x) with a fit of its own, ``f`` = 0 (measured at its real widths; never the AutoencoderKL fit)."""
    if "decoder_block_types" in vae_config:
        return "dc_ae_decode"
    return "residual_vae_decode" if vae_config.get("is_residual") else "vae_decode"


def workload(family: ModelFamily, configs: dict, height: int, width: int, images: int, cfg: bool) -> Workload:
    """The tokens, widths and batches of one chunk of ``images`` at ``height`` x ``width``."""
    vae = configs["vae"]
    factor = vae_scale_factor(vae)
    tokens, layer_width = family.plan_tokens(configs, (height // factor) * (width // factor))
    return Workload(batch=images * (2 if cfg else 1), tokens=tokens, width=layer_width, images=images,
                    pixels=height * width, vae_channels=vae_width(vae), frames=family.default_frames or 1,
                    vae_part=vae_part(vae))


def coefficient(table: dict, family: str, part: str, dtype: torch.dtype, writer: str | None = None):
    """A fitted ``(k, c)`` (``coefficients.py``), or None when that family and part were not calibrated."""
    by_dtype = table.get(family, {}).get(part, {}).get(DTYPE_NAMES.get(dtype, "float32"))
    if by_dtype is None:
        return None
    return by_dtype.get(writer) if writer is not None else by_dtype


def predict(table: dict, family: str, work: Workload, dtype: torch.dtype, writer: str) -> dict[str, int | None]:
    """Peak activation bytes of the denoiser forward and of the VAE decode (None: not calibrated)."""
    element = torch.empty((), dtype=dtype).element_size()
    # LoRA layers add temporaries and never remove any: slots are at least the bare model's peak
    # (in bfloat16 their fit comes out a few % under it: where the peak sits, no LoRA layer runs).
    writers = ("none",) if writer == "fused" else ("none", "slots")
    fits = [k for k in (coefficient(table, family, "denoiser", dtype, w) for w in writers) if k is not None]
    denoiser = max((round(k * work.batch * work.tokens * work.width * element + c) for k, c in fits), default=None)
    own = coefficient(table, family, work.vae_part, dtype)  # a family's own VAE: Wan's causal video VAE
    if own is None and work.vae_part != "vae_decode":  # an uncalibrated VAE of the family's: not the image fit
        return {"denoiser": denoiser, "vae_decode": None}
    if own is not None:
        k, c, f = own
        vae = round(k * work.images * work.pixels * work.vae_channels * element
                    + f * work.images * work.frames * work.pixels * 3 * element + c)
        return {"denoiser": denoiser, "vae_decode": vae}
    k_vae = coefficient(table, "vae", "decode", dtype, "one" if work.images == 1 else "batch")
    vae = None if k_vae is None else round(k_vae[0] * work.images * work.pixels * work.vae_channels * element
                                           + k_vae[1])
    return {"denoiser": denoiser, "vae_decode": vae}


# ---------------------------------------------------------------------------- measuring (calibration, tests)


def peak_allocated(run) -> int:
    """Bytes: the highest the torch CPU allocator's live bytes rose above their level when ``run()``
    began, from the profiler's allocation and free events (``profile_memory=True``) in time order.

    Written here because torch offers no CPU counterpart of ``torch.cuda.max_memory_allocated``;
    the profiler's per-operator figures are net of what an operator frees before it returns, so
    the raw events are summed instead."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def empty_model(build, dtype: torch.dtype) -> torch.nn.Module:
    """A model with real shapes and zeroed weights: built on the meta device, then given CPU storage
    (activation memory does not depend on weight values; random init of a real-width model costs
    seconds that zeros do not)."""
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.zero_()
    return model.eval()


def flux_blocks(config: dict, double: int = 1, single: int = 1, dtype: torch.dtype = torch.float32):
    """The Flux transformer of ``config`` at its real width with ``double`` + ``single`` blocks."""
    from diffusers import FluxTransformer2DModel

    reduced = {k: v for k, v in config.items() if not k.startswith("_")}
    reduced.update(num_layers=double, num_single_layers=single)
    model = empty_model(lambda: FluxTransformer2DModel.from_config(reduced), dtype)
    return model


def flux_forward_peak(model, batch: int, image_tokens_side: int, text_tokens: int) -> int:
    """Peak of one Flux transformer forward over ``batch`` samples of side^2 image tokens + text tokens."""
    config = model.config
    dtype = next(model.parameters()).dtype
    image_tokens = image_tokens_side * image_tokens_side
    inputs = dict(
        hidden_states=torch.zeros(batch, image_tokens, config.in_channels, dtype=dtype),
        encoder_hidden_states=torch.zeros(batch, text_tokens, config.joint_attention_dim, dtype=dtype),
        pooled_projections=torch.zeros(batch, config.pooled_projection_dim, dtype=dtype),
        timestep=torch.ones(batch, dtype=dtype), guidance=torch.ones(batch, dtype=dtype) if config.guidance_embeds
        else None,
        img_ids=_flux_image_ids(image_tokens_side), txt_ids=torch.zeros(text_tokens, 3),
        return_dict=False,
    )
    with torch.no_grad():
        return peak_allocated(lambda: model(**inputs))


def sana_blocks(config: dict, layers: int = 1, dtype: torch.dtype = torch.float32):
    """Sana's transformer of ``config`` at its real width with ``layers`` blocks, zero weights."""
    from diffusers import SanaTransformer2DModel

    reduced = {k: v for k, v in config.items() if not k.startswith("_")}
    reduced.update(num_layers=layers)
    return empty_model(lambda: SanaTransformer2DModel.from_config(reduced), dtype)


def sana_forward_peak(model, batch: int, latent_side: int, text_tokens: int = 300) -> int:
    """Peak of one Sana transformer forward over ``batch`` samples (CFG-doubled) of a square latent
    (patch 1: side^2 image tokens) against ``text_tokens`` caption tokens (SanaPipeline's 300)."""
    config = model.config
    dtype = next(model.parameters()).dtype
    inputs = dict(
        hidden_states=torch.zeros(batch, config.in_channels, latent_side, latent_side, dtype=dtype),
        encoder_hidden_states=torch.zeros(batch, text_tokens, config.caption_channels, dtype=dtype),
        encoder_attention_mask=torch.ones(batch, text_tokens, dtype=dtype),
        timestep=torch.ones(batch, dtype=dtype), return_dict=False,
    )
    with torch.no_grad():
        return peak_allocated(lambda: model(**inputs))


def pipeline_denoiser_peak(pipeline, family: ModelFamily, images: int, height: int, width: int,
                           prompt: str, **options) -> tuple[int, int]:
    """One denoising step of ``pipeline`` (a family's pipeline whose denoiser is built at its real
    widths) for ``images`` images: (the largest batch x tokens one of the denoiser's repeated blocks
    was given, the peak of its largest forward). The tokens are what ``plan_tokens`` counts: every
    stream entering the block at the layer width (image and text streams of a double-stream block
    summed; a single stream as it is), and the batch as the block runs it (doubled by batch CFG).

    Why through the pipeline: each family's denoiser takes inputs of its own (packed latents, position
    ids, caption lists, masks, image shapes); the pipeline builds them, so one measurement serves
    every family that follows the conventions. ``options``: more of the pipeline's arguments."""
    denoiser = getattr(pipeline, family.denoiser)
    layer_width = family.plan_tokens({family.denoiser: dict(denoiser.config)}, 0)[1]
    block_classes = set(getattr(denoiser, "_repeated_blocks", None) or family.repeated_blocks)
    widest = [0]

    def count(_module, args, kwargs):
        # The streams by name where the block takes them so (a modulation tensor can have the layer's
        # width too: Chroma's), else its first two positional arguments.
        named = [kwargs[n] for n in ("hidden_states", "encoder_hidden_states") if n in kwargs]
        streams = [t for t in (named or args[:2])
                   if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == layer_width]
        if streams:
            widest[0] = max(widest[0], streams[0].shape[0] * sum(t.shape[1] for t in streams))

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in denoiser.modules()
             if type(m).__name__ in block_classes]
    peaks = []
    forward = denoiser.forward

    def measured(*args, **kwargs):
        out = []
        peaks.append(peak_allocated(lambda: out.append(forward(*args, **kwargs))))
        return out[0]

    negative = family.default_negative_prompt(family.default_guidance)
    denoiser.forward = measured
    try:
        pipeline(prompt=[prompt] * images, **({} if negative is None else {"negative_prompt": [negative] * images}),
                 height=height, width=width, num_inference_steps=1, output_type="latent",
                 **family.call_arguments(family.default_guidance), **options)
    finally:
        del denoiser.forward
        for hook in hooks:
            hook.remove()
    if not peaks or not widest[0]:
        raise RuntimeError(f"{family.name}: no denoiser forward or no repeated block at width {layer_width} was seen")
    return widest[0], max(peaks)


def _flux_image_ids(side: int) -> torch.Tensor:
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def unet_forward_peak(unet, batch: int, latent_height: int, latent_width: int, text_tokens: int = 77) -> int:
    """Peak of one U-Net forward over ``batch`` samples (already doubled for CFG): SDXL's, with its
    added conditions, or SD1.5's, without."""
    config = unet.config
    dtype = next(unet.parameters()).dtype
    inputs = dict(
        sample=torch.zeros(batch, config.in_channels, latent_height, latent_width, dtype=dtype),
        timestep=torch.tensor(1.0), encoder_hidden_states=torch.zeros(batch, text_tokens, config.cross_attention_dim,
                                                                      dtype=dtype),
        return_dict=False,
    )
    if config.addition_embed_type == "text_time":
        # SDXL's added conditions: the pooled CLIP-G embedding and six size/crop ids, per sample.
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": torch.zeros(batch, pooled, dtype=dtype),
                                       "time_ids": torch.zeros(batch, 6, dtype=dtype)}
    with torch.no_grad():
        return peak_allocated(lambda: unet(**inputs))


def vae_decode_peak(vae, images: int, height: int, width: int) -> int:
    factor = vae_scale_factor(vae.config)
    dtype = next(vae.parameters()).dtype
    latents = torch.zeros(images, vae.config.latent_channels, height // factor, width // factor, dtype=dtype)
    with torch.no_grad():
        return peak_allocated(lambda: vae.decode(latents, return_dict=False))


def video_vae_decode_peak(vae, videos: int, latent_frames: int, height: int, width: int) -> int:
    """Peak of one decode of ``videos`` videos of ``latent_frames`` latent frames at ``height`` x
    ``width`` pixels by a causal video VAE (AutoencoderKLWan: it decodes one latent frame at a time
    and caches a few of each conv's input frames, so its peak is one frame's activations plus the
    decoded video, which grows with the frames)."""
    factor = vae_scale_factor(vae.config)
    dtype = next(vae.parameters()).dtype
    channels = getattr(vae.config, "z_dim", None) or vae.config.latent_channels  # Wan's / LTX-Video's
    latents = torch.zeros(videos, channels, latent_frames, height // factor, width // factor, dtype=dtype)
    with torch.no_grad():
        return peak_allocated(lambda: vae.decode(latents, return_dict=False))


def fit(points: list[tuple[float, int]]) -> tuple[float, float]:
    """Least-squares ``(k, c)`` of ``measured = k x units + c``; through the origin (c = 0) when
    the intercept comes out negative (no kernel allocates negative memory)."""
    n = len(points)
    mean_u = sum(u for u, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    spread = sum((u - mean_u) ** 2 for u, _ in points)
    if n >= 2 and spread > 0:
        k = sum((u - mean_u) * (m - mean_m) for u, m in points) / spread
        c = mean_m - k * mean_u
        if c >= 0:
            return k, c
    return sum(u * m for u, m in points) / sum(u * u for u, _ in points), 0.0


__all__ = ["Workload", "coefficient", "empty_model", "fit", "flux_blocks", "flux_forward_peak",
           "peak_allocated", "pipeline_denoiser_peak", "predict", "sana_blocks", "sana_forward_peak", "unet_forward_peak", "vae_decode_peak",
           "vae_part", "video_vae_decode_peak",
           "workload"]
