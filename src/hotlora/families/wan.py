"""Wan (WanPipeline): text-to-video. A 3-D transformer over (1, 2, 2) latent patches of every frame,
a UMT5 text encoder, a causal video VAE (8x spatial, 4x temporal; TI2V-5B's Wan 2.2 VAE 16x
spatial); diffusers loads LoRA into the transformer only (``WanLoraLoaderMixin``).

Guidance, read from ``WanPipeline.__call__``: classifier-free guidance for ``guidance_scale > 1``
as a SECOND forward pass on the negative prompt's embeddings (true CFG: the batch stays single).
A missing negative prompt is encoded as "". Prompts are padded to ``max_sequence_length`` (512)
with zeros after the text encoder: one text shape whatever the prompt.

Frames: the VAE compresses time by 4 keeping the first frame, so a video has 4k + 1 frames; the
pipeline silently rounds any other count (with a log warning). A request is refused instead
(``frame_problems``): a rounded count would be a video the client did not ask for, and a shape the
warm-up never compiled.

Wan 2.2 A14B adds ``transformer_2`` (the low-noise expert, called for timesteps below
``boundary_ratio`` x 1000): the mixin names both transformers loadable, neither of them a text
encoder (``lora_text_encoders``). Both get slots and a compile (``experts``;
``engine/writers/experts.py``); an adapter carries the low-noise expert's LoRA under
``transformer_2.`` keys beside the high-noise expert's ``transformer.`` ones (``format.convert``).
Wan 2.1 and Wan 2.2 TI2V-5B have one transformer.

Image-to-video (``WanImageToVideoPipeline``), the task ``image-to-video``: the input image is the
first frame. Its checkpoints (Wan2.1-I2V-14B: a transformer taking the image's latents and a mask
beside the noise, 36 channels in, and a CLIP image encoder whose features its cross-attention reads
through ``add_k_proj`` / ``add_v_proj``; Wan2.2-I2V-A14B: the same without the image encoder, two
experts) make nothing from text alone: a model directory of one serves image-to-video only
(``conditioned_checkpoints``). Wan 2.2 TI2V-5B runs both on one transformer (``expand_timesteps``:
the first frame's latent kept at timestep 0): its text-to-video model serves image-to-video through
``from_pipe``. The pipeline takes one image a call (its latents and CLIP features repeated over the
batch): an image-to-video request runs in a forward batch of its own.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

from hotlora.errors import AdapterFormatError
from hotlora.families.base import ModelFamily

log = logging.getLogger(__name__)

TEXT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length: every prompt is padded to it
MUSUBI_ARCHITECTURE = "wan"  # what musubi-tuner writes as ss_base_model_version for Wan LoRAs

# musubi-tuner's names of the blocks' Linears (``lora_unet_`` + the original Wan name, dots made
# underscores), which diffusers' ComfyUI-name converter reads once the dots are back. (Modules outside
# the blocks, which musubi's ``include_patterns`` can add, are left to diffusers' musubi converter:
# the ComfyUI-name one has no ``.alpha`` for them either.)
MUSUBI_NAME = re.compile(r"lora_unet_blocks_(?P<block>\d+)_(?P<module>(?:self_attn|cross_attn)_(?:q|k|v|o|k_img|v_img)|ffn_[02])"
                         r"\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)")
# lightx2v's whole-tensor patches (``tools/extract/lora_extractor.py: _generate_lora_diff_key``).
PATCH_SUFFIXES = (".diff", ".diff_b", ".diff_m")


class Wan(ModelFamily):
    name = "wan"
    pipeline_class = "WanPipeline"
    denoiser_class = "WanTransformer3DModel"
    # The mixin's loadable modules are the two experts, no text encoder: Wan 2.2's low-noise one is
    # the second (``load_lora_weights(..., load_into_transformer_2=True)``).
    other_denoisers = ("transformer_2",)
    # Wan's other pipelines sharing its mixin and denoiser class (video-to-video, VACE, Animate) are
    # not served; image-to-video is, on its own checkpoints or TI2V-5B's (``task_pipeline``).
    serves_variants = False
    conditioned_checkpoints = {"WanImageToVideoPipeline": "image-to-video"}
    task_pipelines = {"image-to-video": "WanImageToVideoPipeline"}
    # lightx2v's step/CFG-distill LoRAs (the most used Wan LoRAs) carry every Linear's bias difference.
    lora_biases = True
    lora_key_pattern = r"(?<!transformer_)blocks[._]\d+[._](attn1|attn2|ffn)|condition_embedder"  # not LTX's transformer_blocks
    base_model_markers = ("wan2", "wan-2", "wan_2", "wan 2")
    # The Wan 2.1 T2V model card: 50 steps, guidance 5.0, 480 x 832 (the 1.3B model's size), 81 frames at 16 fps.
    default_steps, default_guidance = 50, 5.0
    default_size = (480, 832)
    default_frames = 81
    fps = 16
    output_kind = "frames"
    frame_multiple = 4  # AutoencoderKLWan's scale_factor_temporal: frames are 4k + 1
    cfg = "true"
    negative_prompts = True
    latent_multiple = 2  # patch_size (1, 2, 2)
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    # Measured on the tiny Wan 2.1 model, compiled: a request after warm-up recompiled WanTransformerBlock
    # (FirstBlockCache's per-context state under true CFG's two passes); cache-dit's DBCache did not.
    unserved_step_caches = {"fbcache": "a request recompiles the compiled blocks under true CFG's two passes; "
                                       "use dbcache (cache-dit, which caches each pass and each expert apart)"}
    tiny_size = 16
    tiny_frames = 5
    full_size_models = {"wan2.1-t2v-1.3b": "wan21_t2v_1_3b", "wan2.1-t2v-14b": "wan21_t2v_14b",
                        "wan2.2-t2v-a14b": "wan22_t2v_a14b", "wan2.1-i2v-14b-480p": "wan21_i2v_14b_480p",
                        "wan2.2-i2v-a14b": "wan22_i2v_a14b", "wan2.2-ti2v-5b": "wan22_ti2v_5b",
                        "wan2.1-flf2v-14b-720p": "wan21_flf2v_14b_720p"}

    def experts(self, pipeline) -> dict[str, Any]:
        """Both experts where the pipeline switches between them (``boundary_ratio`` set: Wan 2.2
        A14B); a ``transformer_2`` without a boundary is never called by ``__call__``."""
        second = getattr(pipeline, "transformer_2", None)
        if second is None or pipeline.config.boundary_ratio is None:
            return {"transformer": pipeline.transformer}
        return {"transformer": pipeline.transformer, "transformer_2": second}

    def task_pipeline(self, task: str, loaded, share):
        """Image-to-video on an image-to-video checkpoint (the loaded pipeline) or on TI2V-5B's
        text-to-video one (``expand_timesteps``: the same transformer takes the first frame);
        refused on Wan 2.1's and 2.2 A14B's text-to-video transformers, which take no image."""
        if task == "image-to-video" and self.checkpoint_task(loaded) is None and not loaded.config.get("expand_timesteps"):
            from hotlora.families import UnservedModel

            channels = loaded.transformer.config.in_channels
            raise UnservedModel(f"image-to-video needs a Wan image-to-video checkpoint (model_index.json naming "
                                f"WanImageToVideoPipeline: Wan2.1-I2V-14B, Wan2.2-I2V-A14B) or Wan 2.2 TI2V-5B "
                                f"(expand_timesteps); this text-to-video model's transformer takes no image "
                                f"({channels} latent channels in, the noise's alone)")
        return super().task_pipeline(task, loaded, share)

    def call_prompts(self, task: str, texts: Mapping[str, str], count: int, per_prompt: str) -> dict:
        """Image-to-video: the prompt ``count`` times, one video each. ``WanImageToVideoPipeline``
        repeats the CLIP image features by the prompt count alone (``image_embeds.repeat(batch_size,
        1, 1)``), so Wan2.1-I2V fails at ``num_videos_per_prompt`` above 1 (its transformer joins them
        to the prompt's embeddings); the videos are the same either way (one generator each)."""
        if task != "image-to-video":
            return super().call_prompts(task, texts, count, per_prompt)
        return {per_prompt: 1, **{name: [text] * count for name, text in texts.items()}}

    def input_frame_counts(self, pipeline) -> tuple[int, ...]:
        """Read from ``WanImageToVideoPipeline``: a last frame (``last_image``) is encoded into the
        condition latents beside the first, and with an image encoder its CLIP features too, which
        only Wan2.1-FLF2V's transformer takes (``pos_embed_seq_len``: the two images' features as one
        sequence; without a second image it cannot run). Wan2.1-I2V's transformer takes one image's
        features (two would be a second batch row: the call fails); Wan2.2-I2V-A14B has no image
        encoder and takes one frame or two; TI2V-5B (``expand_timesteps``) encodes the first frame
        alone and would drop a last one without a word."""
        if pipeline.config.get("expand_timesteps"):
            return (1,)
        if getattr(pipeline, "image_encoder", None) is None:
            return (1, 2)
        return (2,) if pipeline.transformer.config.get("pos_embed_seq_len") else (1,)

    def input_frames_hint(self, counts: tuple[int, ...], given: int) -> str:
        if counts == (2,):
            return " (a first-last-frame checkpoint, Wan2.1-FLF2V: its image features take both frames)"
        if given == 2:
            return " (a last frame is taken by Wan2.1-FLF2V-14B and Wan2.2-I2V-A14B checkpoints)"
        return ""

    def task_arguments(self, task: str, images: list, masks: list | None, strength: float | None,
                       references: int) -> dict[str, Any]:
        """Image-to-video: the first frame, and the last one where given (``last_image``)."""
        if task == "image-to-video":
            return {"image": images[0], **({"last_image": images[1]} if len(images) > 1 else {})}
        return super().task_arguments(task, images, masks, strength, references)

    def warmup_steps(self, pipeline, steps: int) -> int:
        """The fewest steps, from ``steps``, whose timesteps fall on both sides of the boundary
        (``__call__``: ``transformer`` for ``t >= boundary_ratio x num_train_timesteps``, else
        ``transformer_2``), asked of a copy of the pipeline's scheduler: with a strong shift two steps
        can both be high-noise ones, and the low-noise expert would be compiled by a request."""
        if len(self.experts(pipeline)) == 1:
            return steps
        import copy

        scheduler = copy.deepcopy(pipeline.scheduler)
        boundary = pipeline.config.boundary_ratio * scheduler.config.num_train_timesteps
        for count in range(steps, steps + 64):
            scheduler.set_timesteps(count)
            sides = {bool(t >= boundary) for t in scheduler.timesteps}
            if len(sides) == 2:
                return count
        raise ValueError(f"no warm-up of {steps} to {steps + 63} steps reaches both experts "
                         f"(boundary_ratio={pipeline.config.boundary_ratio})")

    def second_guidance_problems(self, guidance_scale: float, guidance_scale_2: float) -> list[str]:
        """``WanPipeline.do_classifier_free_guidance`` reads ``guidance_scale`` alone: at 1 or below
        neither expert runs the unconditional pass, so a low-noise guidance above 1 would be ignored
        without a word."""
        if guidance_scale_2 > 1 and guidance_scale <= 1:
            return [f"guidance_scale_2 {guidance_scale_2:g} needs guidance_scale above 1 (got {guidance_scale:g}): "
                    "the pipeline runs classifier-free guidance for either expert only when guidance_scale > 1"]
        return []

    def vae_scale_factor(self, pipeline) -> int:
        """WanPipeline has no ``vae_scale_factor``: its spatial factor (the temporal one is 4)."""
        return pipeline.vae_scale_factor_spatial

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """Both sides, always: true CFG keeps the batch single (``cfg`` is never True here) and the
        pipeline reads the negative embeddings only when it guides. The pipeline's own
        ``max_sequence_length`` (512; ``encode_prompt`` alone defaults to 226)."""
        embeds, negative = pipeline.encode_prompt(
            prompt=list(prompts["prompt"]), negative_prompt=prompts.get("negative_prompt") or [""] * len(prompts["prompt"]),
            do_classifier_free_guidance=True, num_videos_per_prompt=1, max_sequence_length=TEXT_TOKENS,
            device=pipeline.device)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """Every latent frame's patches (the default frame count's) in one sequence."""
        denoiser = configs["transformer"]
        _, ph, pw = denoiser.get("patch_size", (1, 2, 2))
        latent_frames = (self.default_frames - 1) // self.frame_multiple + 1
        heads, head_dim = denoiser.get("num_attention_heads", 40), denoiser.get("attention_head_dim", 128)
        return latent_frames * latent_pixels // (ph * pw), heads * head_dim

    def build_tiny(self, seed: int = 0):
        """As diffusers' own tests/pipelines/wan/test_wan.py builds it (its transformer and VAE
        configs), with a UMT5 encoder and a T5 tokenizer made here instead of downloaded."""
        import torch
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        from hotlora.families._tiny import t5_tokenizer

        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )
        tokenizer = t5_tokenizer()
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )).eval()
        return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), transformer=transformer)

    tiny_variants = ("two-experts", "i2v", "i2v-first-last", "i2v-two-experts", "ti2v")

    def build_tiny_variant(self, variant: str, seed: int = 0):
        """"two-experts": Wan 2.2 A14B's layout as diffusers' own tests/pipelines/wan/test_wan_22.py
        builds it: ``build_tiny``'s components, a second transformer of the same config (its own
        seeded weights) as the low-noise expert, ``boundary_ratio`` 0.875.

        "i2v": Wan2.1-I2V's layout as diffusers' tests/pipelines/wan/test_wan_image_to_video.py builds
        it: a transformer taking 36 channels (the noise, the first frame's latents and their mask)
        with ``image_dim`` and, as the published config has, ``added_kv_proj_dim`` (``add_k_proj`` /
        ``add_v_proj`` in its cross-attention, which that test leaves out), a tiny CLIP
        vision encoder and its image processor. "i2v-first-last": Wan2.1-FLF2V-14B's (the "i2v"
        layout whose image embedder adds a position embedding over both frames' CLIP features,
        ``pos_embed_seq_len``, as diffusers' convert script configures it). "i2v-two-experts": Wan2.2-I2V-A14B's (two such
        experts, no image encoder, as test_wan_22_image_to_video.py builds it). "ti2v": Wan 2.2
        TI2V-5B's, as that file's ``Wan225BImageToVideoPipelineFastTests`` builds it (the Wan 2.2 VAE:
        48 latent channels, 16x spatial; ``expand_timesteps``) as a text-to-video pipeline: 32 pixels
        is its smallest size."""
        import torch
        from diffusers import WanPipeline, WanTransformer3DModel

        if variant not in self.tiny_variants:
            return super().build_tiny_variant(variant, seed)
        one = self.build_tiny(seed)
        if variant == "two-experts":
            torch.manual_seed(seed + 1)
            second = WanTransformer3DModel.from_config(one.transformer.config)
            return WanPipeline(**{**one.components, "transformer_2": second}, boundary_ratio=0.875)
        # The constructor's arguments alone: diffusers' ``_use_default_values`` would reset any given here.
        config = {key: value for key, value in one.transformer.config.items() if not key.startswith("_")}
        return _tiny_ti2v(one, config, seed) if variant == "ti2v" else _tiny_i2v(one, config, variant, seed)

    def tiny_defaults(self) -> dict[str, Any]:
        return {"num_frames": self.tiny_frames}

    def prepare_raw_lora(self, raw: Mapping[str, Any], label: str) -> dict:
        """Two trainers' files, made right before diffusers' converters see them.

        musubi-tuner (``lora_unet_blocks_0_self_attn_q``): diffusers' own musubi converter
        (``_convert_musubi_wan_lora_to_diffusers``) counts the distinct block numbers and then reads
        blocks ``0 .. count - 1``, each with every one of its ten Linears and an ``.alpha``, popped
        without a default: a LoRA of some blocks, of the attention alone (musubi's
        ``exclude_patterns``), or without alphas fails with a KeyError, and one with modules outside
        the blocks (``include_patterns``) with a ValueError. The same tensors renamed to the original
        Wan names under ComfyUI's ``diffusion_model.`` prefix (dots back) go through diffusers'
        ``_convert_non_diffusers_wan_lora_to_diffusers``, which takes any subset and alpha = rank
        where a file has none, with the same ``alpha / rank`` split: the rename is all this does,
        and only where every key is one it knows (anything else is left to diffusers' converter).

        lightx2v (the distill LoRAs): whole-tensor differences beside the LoRA factors, ``.diff``
        (a norm's weight, or any small weight), ``.diff_b`` (a bias), ``.diff_m`` (a block's
        modulation). diffusers reads a Linear's ``.diff_b`` as a PEFT ``lora_B.bias`` (scaled with
        the LoRA), which the slots hold (``lora_biases``), and drops the norm and modulation ones (a
        debug / info log line), and a bias whose layer has no LoRA factors (the time projection's).
        Patches that are all zero change nothing and are dropped here; any other that diffusers would
        drop is refused with its keys, rather than served as a model other than the one trained."""
        raw = dict(raw)
        patches = [k for k in raw if k.endswith(PATCH_SUFFIXES)]
        if patches:
            import torch

            def factored(key: str) -> bool:  # a Linear's bias beside its own LoRA factors: a lora_B.bias
                module = key.removesuffix(".diff_b")
                return (key.endswith(".diff_b") and "norm" not in module
                        and any(f"{module}.{part}.weight" in raw for part in ("lora_down", "lora_A")))

            live = sorted(k for k in patches if not isinstance(raw[k], torch.Tensor) or bool(raw[k].ne(0).any()))
            dropped = [k for k in live if not factored(k)]
            if dropped:
                raise AdapterFormatError(
                    f"{label}: {len(dropped)} whole-tensor patches (lightx2v's .diff / .diff_m, or a .diff_b of a "
                    f"norm or of a layer without LoRA factors: a weight, bias or modulation replaced, not a low-rank "
                    f"update), which diffusers drops and a LoRA slot cannot hold: {', '.join(dropped[:6])}"
                    + (" ..." if len(dropped) > 6 else "") + " (a Linear's .diff_b beside its LoRA is served)")
            zero = [k for k in patches if k not in live]
            if zero:
                log.info("%s: dropping %d all-zero .diff patches (they change nothing)", label, len(zero))
            raw = {k: v for k, v in raw.items() if k not in zero}
        if raw and all(k.startswith("lora_unet_") for k in raw):
            matches = {k: MUSUBI_NAME.fullmatch(k) for k in raw}
            if all(matches.values()):
                raw = {_comfy_name(m): v for m, v in zip(matches.values(), raw.values())}
        return raw

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        """diffusers' Wan converters split ``alpha / rank`` between down and up in a loop
        (``get_alpha_scales``: ``while scale_down * 2 < scale_up``) that never ends for a negative
        alpha, as the kohya Flux one does: refused before it runs."""
        def below_zero(value) -> bool:
            try:
                return value.numel() > 0 and bool((value.detach().double() < 0).any())
            except (AttributeError, RuntimeError, TypeError):  # not a number tensor: the converter fails by itself
                return False

        negative = sorted(k for k, v in raw.items() if k.endswith(".alpha") and below_zero(v))
        if negative:
            raise AdapterFormatError(f"{label}: negative alpha in {', '.join(negative[:8])} "
                                     "(diffusers' Wan converters never finish on it)")

    def write_trainer_samples(self, pipeline, linears, out, rank: int, attention_only) -> dict:
        """The trainers' Wan layouts (``hotlora.trainer_layouts``, each writer citing the source it
        mirrors): musubi-tuner's ``lora_unet_`` kohya names (alpha rank / 2), ai-toolkit's ComfyUI
        ``diffusion_model.`` names with ``lora_A`` / ``lora_B``, lightx2v's ``diffusion_model.``
        names with ``lora_down`` / ``lora_up``, a ``.diff_b`` of every Linear's bias (served as a
        LoRA bias) and its whole-tensor ``.diff`` patches of the norms, here all zero (what diffusers'
        converter says the published distill LoRAs carry; it drops them). With two experts (Wan 2.2 A14B), musubi-tuner's pair too: a high-noise and a
        low-noise file, what users ship for it."""
        import torch
        from safetensors.torch import save_file

        from hotlora.families._tiny import random_lora
        from hotlora.trainer_layouts import (
            ai_toolkit_wan_lora, lightx2v_wan_lora, musubi_wan_lora, wan_block_linear, wan_original_name,
        )

        def save(name, tensors, meta=None):
            save_file(tensors, str(out / f"{name}.safetensors"), metadata=meta)
            return out / f"{name}.safetensors"

        blocks = sorted({m.split(".")[1] for m in linears if m.startswith("blocks.")}, key=int)
        zero_norms = {f"blocks.{b}.{norm}.diff": torch.zeros(pipeline.transformer.config.num_attention_heads
                                                             * pipeline.transformer.config.attention_head_dim)
                      for b in blocks for norm in ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q",
                                                   "cross_attn.norm_k", "norm3")}
        generator = torch.Generator().manual_seed(7)
        bias_patches = {f"{wan_original_name(m)}.diff_b": 0.1 * torch.randn(out, generator=generator)
                        for m, (_, out) in linears.items() if wan_block_linear(m)}
        samples = {
            "style-musubi": save("style-musubi", *musubi_wan_lora(random_lora(linears, rank, seed=4), rank / 2, rank,
                                                                  MUSUBI_ARCHITECTURE)),
            "style-ai-toolkit": save("style-ai-toolkit", *ai_toolkit_wan_lora(random_lora(linears, rank, seed=5))),
            "style-lightx2v": save("style-lightx2v", lightx2v_wan_lora(random_lora(linears, rank, seed=6),
                                                                       {**zero_norms, **bias_patches})),
        }
        experts = list(self.experts(pipeline))
        if len(experts) == 2:
            # Wan 2.2 A14B's experts share one config: the low-noise one has the same Linears as ``linears``.
            for which, seed, alpha in (("high", 13, rank / 2), ("low", 14, 2 * rank)):
                sd = random_lora(linears, rank, seed=seed)
                samples[f"experts-musubi-{which}"] = save(f"experts-musubi-{which}",
                                                          *musubi_wan_lora(sd, alpha, rank, MUSUBI_ARCHITECTURE))
        return samples


def _comfy_name(match: re.Match) -> str:
    """A musubi-tuner key (``MUSUBI_NAME``'s match) under ComfyUI's prefix with the original Wan name:
    ``lora_unet_blocks_0_cross_attn_k_img.alpha`` -> ``diffusion_model.blocks.0.cross_attn.k_img.alpha``."""
    attn, _, proj = match["module"].partition("_attn_")
    module = f"{attn}_attn.{proj}" if proj else match["module"].replace("_", ".")
    return f"diffusion_model.blocks.{match['block']}.{module}.{match['part']}"


def _tiny_ti2v(one, config: dict, seed: int):
    """``Wan.build_tiny_variant("ti2v")``: ``one``'s text encoder, the Wan 2.2 VAE and a transformer of
    48 channels, ``expand_timesteps``, TI2V-5B's UniPC flow scheduler."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed + 5)
    vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel.from_config({**config, "in_channels": 48, "out_channels": 48})
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return WanPipeline(tokenizer=one.tokenizer, text_encoder=one.text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=True)


def _tiny_i2v(one, config: dict, variant: str, seed: int):
    """``Wan.build_tiny_variant("i2v" | "i2v-two-experts")``: ``one``'s text encoder and VAE, image-to-video
    transformers of 36 channels in; Wan2.1-I2V's with its image features and CLIP encoder."""
    import torch
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = {**config, "in_channels": 36}
    # Wan2.1-I2V's config: the CLIP features' width, and add_k_proj / add_v_proj as wide as the blocks.
    image = {"image_dim": 4, "added_kv_proj_dim": config["num_attention_heads"] * config["attention_head_dim"]}
    clip_side = 32
    if variant == "i2v-first-last":  # both frames' CLIP tokens (the class token and one per patch of 1 pixel)
        image["pos_embed_seq_len"] = 2 * (clip_side * clip_side + 1)
    experts = {}
    for index, name in enumerate(("transformer", "transformer_2") if variant == "i2v-two-experts" else ("transformer",)):
        torch.manual_seed(seed + 2 + index)
        experts[name] = WanTransformer3DModel.from_config({**config, **(image if variant != "i2v-two-experts" else {})})
    components = {name: part for name, part in one.components.items() if name not in ("transformer", "transformer_2")}
    if variant == "i2v-two-experts":
        return WanImageToVideoPipeline(**components, **experts, boundary_ratio=0.875)
    torch.manual_seed(seed + 4)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2,
                                               image_size=clip_side, intermediate_size=16, patch_size=1)).eval()
    return WanImageToVideoPipeline(**components, **experts, image_encoder=encoder,
                                   image_processor=CLIPImageProcessor(crop_size=clip_side, size=clip_side))
