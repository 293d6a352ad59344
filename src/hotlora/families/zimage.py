"""Z-Image (ZImagePipeline): a single-stream transformer over 2x2 latent patches and the caption's
tokens, a Qwen3 text encoder (its second-to-last hidden state); diffusers loads LoRA into the
transformer only. Z-Image-Turbo is distilled (9 steps, no guidance); the base model guides.

Guidance, read from ``ZImagePipeline.__call__``: classifier-free guidance runs whenever
``guidance_scale > 0`` (``pred = pos + g * (pos - neg)``, so 0 is "off", not 1) as ONE doubled
list batch ``prompt_embeds + negative_prompt_embeds`` (cond first, then uncond). A missing negative
prompt is encoded as "". ``cfg_normalization`` and ``cfg_truncation`` are fixed at the pipeline's
defaults (off, 1.0: never truncates), which the published model cards use; truncation below 1 would
switch guidance off mid-run (the half batch is warmed up anyway), normalization is arithmetic
outside the denoiser.

Text lengths: the pipeline keeps each caption's unpadded tokens (a list of tensors); the
transformer pads each to a multiple of 32 with its learned ``cap_pad_token`` (attended, so the
per-caption length changes the result and cannot be bucketed) and pads the batch to its longest
sequence with an attention mask (None when every item has the same length). So every caption
length is a new shape and a batch of unequal lengths takes another code path (the mask), as does
a caption of exactly 32k tokens (``warmup_prompts``). The blocks are compiled with every dimension
dynamic (``compile_dynamic``) and warm-up runs each code path once: later lengths compile nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hotlora.families.base import ModelFamily

TEXT_TOKENS = 512  # ZImagePipeline's max_sequence_length: captions are truncated there
SEQ_MULTI_OF = 32  # diffusers' transformer_z_image pads captions and images to multiples of this


class ZImage(ModelFamily):
    name = "zimage"
    # Its embedders see every sample's tokens packed into one sequence (``torch.cat`` of the batch's
    # patches, and of its captions), each sample padded to a multiple of 32: the banks writer binds
    # them per sample by the counts ``packed_segments`` reads; every later Linear has a batch axis.
    packed_linears = ("all_x_embedder.", "cap_embedder.")
    lora_key_pattern = r"(layers|noise_refiner|context_refiner)[._]\d+[._](attention|feed_forward|adaLN)"
    base_model_markers = ("z-image", "z_image", "zimage")
    full_size_models = {"zimage-turbo": "zimage_turbo"}
    pipeline_class = "ZImagePipeline"
    task_pipelines = {"image-to-image": "ZImageImg2ImgPipeline", "inpaint": "ZImageInpaintPipeline"}
    denoiser_class = "ZImageTransformer2DModel"
    # Z-Image-Turbo's model card: 9 steps (8 forward passes of the DiT), guidance 0, 1024 x 1024.
    default_steps, default_guidance = 9, 0.0
    cfg = "batch"
    negative_prompts = True
    latent_multiple = 2  # 2x2 latent patches (all_patch_size=(2,))
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    tiny_size = 32
    compile_dynamic = True  # caption lengths reach the blocks: one dynamic graph per code path
    graphs_per_state = 16  # refiners and main layers x batch 1 / more x mask x RoPE contiguity

    def doubles_batch(self, guidance_scale: float) -> bool:
        return guidance_scale > 0

    def warmup_guidance_scales(self, default: float) -> list[float]:
        """Both batch shapes: without guidance (Turbo's 0) and with it (the base model's)."""
        return [default, 1.0 if default <= 0 else 0.0]

    def call_arguments(self, guidance_scale: float) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "cfg_normalization": False, "cfg_truncation": 1.0}

    def warmup_prompts(self, pipeline=None) -> tuple:
        """Every code path a caption reaches the compiled blocks by. The transformer pads each
        caption to a multiple of 32 (``SEQ_MULTI_OF``) and, when it pads, its position ids come out
        longer than the caption (the context refiner then gets a sliced, non-contiguous RoPE
        tensor): a caption of exactly 32k tokens is another graph. So: a padded caption and an exact
        one alone (no mask), and unequal pairs in one batch (a mixed batch or CFG: the mask), one
        with the exact caption longest, one with a padded one longest. Lengths are counted with the
        pipeline's own tokenizer and chat template; with every dimension dynamic
        (``compile_dynamic``) no later length compiles."""
        short = "warm-up"
        if pipeline is None:
            return (short,)
        exact = caption_of_tokens(pipeline, multiple=SEQ_MULTI_OF, at_least=2 * SEQ_MULTI_OF)
        longer = caption_of_tokens(pipeline, multiple=SEQ_MULTI_OF, at_least=3 * SEQ_MULTI_OF, exact=False)
        return (short, exact, (exact, short), (exact, longer))

    def packed_segments(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, list[int]]:
        """Each sample's image and caption tokens as ``ZImageTransformer2DModel.patchify_and_embed``
        pads them (``forward(x, t, cap_feats, ..., patch_size, f_patch_size)``: one latent
        ``[C, F, H, W]`` and one caption ``[L, D]`` per sample)."""
        images = kwargs["x"] if "x" in kwargs else args[0]
        captions = kwargs["cap_feats"] if "cap_feats" in kwargs else args[2]
        patch, frame_patch = kwargs.get("patch_size", 2), kwargs.get("f_patch_size", 1)
        if any(not hasattr(item, "shape") for item in (*images, *captions)):
            from hotlora.errors import EngineError

            raise EngineError("Z-Image's omni inputs (several images per sample) are not served in mixed batches")

        def padded(tokens: int) -> int:
            return tokens + (-tokens) % SEQ_MULTI_OF

        return {"all_x_embedder.": [padded((i.shape[1] // frame_patch) * (i.shape[2] // patch) * (i.shape[3] // patch))
                                    for i in images],
                "cap_embedder.": [padded(len(caption)) for caption in captions]}

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        """Lists of per-caption tensors (unpadded), as ``ZImagePipeline.encode_prompt`` returns them."""
        embeds, negative = pipeline.encode_prompt(prompt=list(prompts["prompt"]), device=pipeline.device,
                                                  do_classifier_free_guidance=cfg,
                                                  negative_prompt=prompts.get("negative_prompt"))
        return {"prompt_embeds": embeds, **({"negative_prompt_embeds": negative} if cfg else {})}

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """The unified sequence: image patches plus the caption (up to max_sequence_length)."""
        denoiser = configs["transformer"]
        patch = denoiser.get("all_patch_size", [2])[0]
        return latent_pixels // (patch * patch) + TEXT_TOKENS, denoiser["dim"]

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        from hotlora.families._tiny import qwen_tokenizer

        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
            axes_dims=[8, 4, 4], axes_lens=[1024, 32, 32],
        )
        # The pad tokens start as zeros (torch.empty in earlier diffusers): random ones, so that
        # padding visibly matters and the model is the same wherever it is built.
        with torch.no_grad():
            transformer.x_pad_token.copy_(torch.randn_like(transformer.x_pad_token))
            transformer.cap_pad_token.copy_(torch.randn_like(transformer.cap_pad_token))
        tokenizer = qwen_tokenizer()
        text_encoder = Qwen3Model(Qwen3Config(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        ))
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], layers_per_block=1, latent_channels=4,
            norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
        )
        return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer)

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """musubi-tuner's layout (``networks/lora_zimage.py``): kohya names over the main ``layers``
        (refiners and ``adaLN_modulation`` excluded by its default patterns), alpha 1.5 x rank."""
        from hotlora.families._tiny import save_kohya_layout

        return save_kohya_layout(path, sd, alpha=rank * 1.5, keep=musubi_targets)

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import musubi_and_comfy_samples

        return musubi_and_comfy_samples(linears, out, rank, attention_only, keep=musubi_targets)


def musubi_targets(module: str) -> bool:
    """The Linears musubi-tuner trains in Z-Image: ZImageTransformerBlock's, less ``.*(_modulation|_refiner).*``."""
    return module.startswith("layers.") and "adaLN_modulation" not in module


def caption_tokens(pipeline, caption: str) -> int:
    """Tokens ZImagePipeline._encode_prompt gives ``caption`` (its chat template, unpadded)."""
    text = pipeline.tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
    return len(pipeline.tokenizer(text).input_ids)


def caption_of_tokens(pipeline, multiple: int, at_least: int, exact: bool = True) -> str:
    """A caption of at least ``at_least`` tokens whose count is (``exact``) or is not a multiple of
    ``multiple``, counted with the pipeline's tokenizer."""
    words = "a watercolor portrait of an astronaut above a quiet city at dusk".split()
    caption = ""
    for i in range(4 * (at_least + multiple)):
        caption = f"{caption} {words[i % len(words)]}".strip()
        n = caption_tokens(pipeline, caption)
        if n >= at_least and (n % multiple == 0) == exact:
            return caption
        for tail in ("a", "."):  # one more token, where a word added several
            if n + 1 >= at_least and caption_tokens(pipeline, caption + tail) % multiple == 0 and exact:
                return caption + tail
    raise ValueError(f"no caption of {'exactly ' if exact else ''}k x {multiple} >= {at_least} tokens")
