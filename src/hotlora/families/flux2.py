"""Flux.2 (Flux2Pipeline: Flux.2 dev, a Mistral-3 text encoder) and Flux.2 klein (Flux2KleinPipeline:
a Qwen3 text encoder), one transformer class (Flux2Transformer2DModel). diffusers loads LoRA into
the transformer only (Flux2LoraLoaderMixin).

Guidance differs, read from the pipelines' ``__call__``: Flux.2 dev has a guidance embedding and one
pass (no negative prompt); klein runs true CFG, a second pass on the embedding of "" (it takes no
negative prompt text), for ``guidance_scale > 1`` unless the model is step-distilled
(``is_distilled`` in the pipeline's config), which ignores guidance with a warning. So klein is
two families, told apart by that config flag: ``flux2-klein`` (distilled) and ``flux2-klein-base``.

Every prompt is padded to ``max_sequence_length`` (512) before the text encoder, and the stacked
hidden states of three encoder layers (10/20/30 for Mistral, 9/18/27 for Qwen3) reach the
denoiser: the text length is fixed, whatever the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hotlora.families.base import ModelFamily

TEXT_TOKENS = 512  # both pipelines' max_sequence_length default; the engine does not change it

# The tiny models' chat templates: what the real ones render for text-only prompts, short.
MISTRAL_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}"
)
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def byte_tokenizer(specials: list[str], chat_template: str, pad: str):
    """A byte-level BPE tokenizer with no merges (every byte one token) and a chat template, made
    in memory; it round-trips ``save_pretrained`` / ``from_pretrained`` offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(specials)}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, model_max_length=TEXT_TOKENS,
                                        additional_special_tokens=[s for s in specials if s != pad])
    tokenizer.chat_template = chat_template
    return tokenizer


def qwen3_tokenizer():
    """Qwen3's special tokens and a chat template that honours ``enable_thinking`` (klein passes
    ``enable_thinking=False``)."""
    return byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], QWEN3_TEMPLATE,
                          pad="<|endoftext|>")


def large_enough(image):
    """``image`` as the Flux.2 pipelines take a reference: each side at least the image processor's
    ``min_side_length``; a smaller one scaled up (Lanczos, aspect kept, sides rounded up)."""
    import inspect
    import math

    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from PIL import Image

    least = inspect.signature(Flux2ImageProcessor.check_image_input).parameters["min_side_length"].default
    width, height = image.size
    if min(width, height) >= least:
        return image
    scale = least / min(width, height)
    return image.resize((max(least, math.ceil(width * scale)), max(least, math.ceil(height * scale))),
                        Image.Resampling.LANCZOS)


def mistral_tokenizer():
    """A tokenizer in place of Flux.2 dev's PixtralProcessor (which needs torchvision): the
    pipeline only calls ``apply_chat_template`` on text-only conversations, which a tokenizer does."""
    return byte_tokenizer(["<pad>", "<s>", "</s>", "[IMG]"], MISTRAL_TEMPLATE, pad="<pad>")


class _Flux2Base(ModelFamily):
    max_edit_references = 4  # Flux2Pipeline takes a list of references (``image``); each count is warmed up
    denoiser_class = "Flux2Transformer2DModel"
    latent_multiple = 2  # the transformer packs 2x2 latent patches into one token
    tokenizer_of = {"text_encoder": "tokenizer"}
    prompt_argument_of = {"text_encoder": "prompt"}
    tiny_size = 32
    lora_key_pattern = r"to_qkv_mlp_proj|(ff|ff_context)[._]linear_(in|out)|stream_modulation"
    text_encoder_layers: int  # the deepest hidden state the pipeline taps, i.e. the encoder's layers

    def task_arguments(self, task, images, masks, strength, references):
        arguments = super().task_arguments(task, images, masks, strength, references)
        if task == "edit":
            # References come fitted to the served size; the Flux.2 pipelines refuse a reference with a
            # side under their image processor's minimum (``check_image_input``: 64 px), which a small
            # served size is. Such a reference is scaled up (aspect kept) to the least size the pipeline
            # takes: the same for every request at that served size, so its token count was warmed up.
            arguments["image"] = ([large_enough(image) for image in arguments["image"]]
                                  if isinstance(arguments["image"], list) else large_enough(arguments["image"]))
        return arguments

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        denoiser = configs["transformer"]
        return latent_pixels // (2 * 2) + TEXT_TOKENS, denoiser["num_attention_heads"] * denoiser["attention_head_dim"]

    def _tiny_transformer(self, guidance_embeds: bool, joint_attention_dim: int):
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=joint_attention_dim, timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4], guidance_embeds=guidance_embeds,
        )

    @staticmethod
    def _tiny_vae():
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2(
            sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
            norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        )

    def check_raw_lora(self, raw: Mapping[str, Any], label: str) -> None:
        """diffusers' kohya Flux.2 converter splits ``alpha / rank`` in the same endless loop as
        Flux's for a negative alpha: the same refusal."""
        from hotlora.families.flux import Flux

        Flux.check_raw_lora(self, raw, label)

    def trainer_lora(self, path: Path, linears, sd, rank: int, seed: int) -> Path:
        """ai-toolkit's layout: BFL module names under ``diffusion_model.`` (fused qkv with one
        shared ``lora_A``), no alpha (alpha = rank), every block layer."""
        return save_file_at(path, bfl_lora(linears, rank, seed, ai_toolkit_key, "lora_A.weight", "lora_B.weight"))

    def write_trainer_samples(self, pipeline, linears, out: Path, rank: int, attention_only) -> dict:
        from hotlora.families._tiny import random_lora

        blocks = [n for n in linears if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
        return {
            "style-ai-toolkit": save_file_at(out / "style-ai-toolkit.safetensors",
                                             bfl_lora(linears, rank, 4, ai_toolkit_key, "lora_A.weight", "lora_B.weight")),
            "style-musubi": save_file_at(out / "style-musubi.safetensors",
                                         bfl_lora(linears, rank, 5, musubi_key, "lora_down.weight", "lora_up.weight",
                                                  alpha=rank / 2)),
            "style-comfy": save_file_at(out / "style-comfy.safetensors",
                                        {f"diffusion_model.{k}": v for k, v in
                                         random_lora(linears, rank, seed=6, modules=blocks).items()}),
        }


class Flux2(_Flux2Base):
    name = "flux2"
    base_model_markers = ("flux.2-dev", "flux2-dev", "flux2_dev", "flux.2 dev")
    full_size_models = {"flux2-dev": "flux2_dev"}
    pipeline_class = "Flux2Pipeline"
    task_pipelines = {"edit": "Flux2Pipeline"}  # reference images go in as the pipeline's own ``image``
    default_steps, default_guidance = 50, 4.0  # the FLUX.2-dev model card; 4.0 is the pipeline's default too
    cfg = "none"  # guidance goes in through the guidance embedding
    text_encoder_layers = 30

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        embeds, _ = pipeline.encode_prompt(prompt=prompts["prompt"], device=pipeline.device, num_images_per_prompt=1)
        return {"prompt_embeds": embeds}

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
        from transformers import Mistral3ForConditionalGeneration

        from hotlora.families._tiny import mistral3_config

        torch.manual_seed(seed)
        transformer = self._tiny_transformer(guidance_embeds=True, joint_attention_dim=3 * 8)  # 3 taps of width 8
        tokenizer = mistral_tokenizer()
        config = mistral3_config(len(tokenizer), layers=self.text_encoder_layers, max_positions=TEXT_TOKENS)
        text_encoder = Mistral3ForConditionalGeneration(config).eval()
        return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=self._tiny_vae(),
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


class Flux2Klein(_Flux2Base):
    """Step-distilled klein (FLUX.2-klein 4B / 9B): 4 steps, ``guidance_scale`` ignored."""

    name = "flux2-klein"
    base_model_markers = ("klein",)
    full_size_models = {"flux2-klein-4b": "flux2_klein_4b", "flux2-klein-9b": "flux2_klein_9b"}
    pipeline_class = "Flux2KleinPipeline"
    task_pipelines = {"edit": "Flux2KleinPipeline", "inpaint": "Flux2KleinInpaintPipeline"}
    default_steps, default_guidance = 4, 1.0  # the klein model cards
    cfg = "none"
    takes_guidance = False  # the pipeline warns and ignores it on a distilled model
    text_encoder_layers = 27
    distilled = True
    pipeline_config = {"is_distilled": True}

    def encode_prompts(self, pipeline, prompts: Mapping[str, list], cfg: bool) -> dict:
        embeds, _ = pipeline.encode_prompt(prompt=prompts["prompt"], device=pipeline.device, num_images_per_prompt=1)
        out = {"prompt_embeds": embeds}
        if not self.distilled:
            # The pipeline encodes "" for the unconditional pass; given prompt embeddings it would
            # encode one "" for the whole batch, so the group's are made here (used only under CFG).
            negative, _ = pipeline.encode_prompt(prompt=[""] * embeds.shape[0], device=pipeline.device,
                                                 num_images_per_prompt=1)
            out["negative_prompt_embeds"] = negative
        return out

    def build_tiny(self, seed: int = 0):
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(seed)
        hidden = 8
        transformer = self._tiny_transformer(guidance_embeds=False, joint_attention_dim=3 * hidden)
        tokenizer = qwen3_tokenizer()
        config = Qwen3Config(hidden_size=hidden, intermediate_size=8, num_hidden_layers=self.text_encoder_layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=len(tokenizer),
                             max_position_embeddings=TEXT_TOKENS, pad_token_id=0, bos_token_id=0, eos_token_id=2,
                             tie_word_embeddings=True)
        text_encoder = Qwen3ForCausalLM(config).eval()
        return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=self._tiny_vae(),
                                  text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                  is_distilled=self.distilled)


class Flux2KleinBase(Flux2Klein):
    """klein base (undistilled): true CFG, a second pass on the embedding of "" for guidance > 1."""

    name = "flux2-klein-base"
    base_model_markers = ("klein-base", "klein_base")
    full_size_models = {}  # the plans of klein's published (distilled) models belong to flux2-klein
    default_steps, default_guidance = 50, 4.0  # the klein base model cards
    cfg = "true"
    takes_guidance = True
    distilled = False
    pipeline_config = {"is_distilled": False}


# ----------------------------------------------------------------------------- trainer layouts

# BFL's Flux.2 module names (what ai-toolkit and musubi-tuner train on) -> the diffusers layers
# each covers; a fused qkv shares one down projection.
BFL_DOUBLE_BLOCK = {
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_attn.proj": ["attn.to_out.0"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "txt_attn.proj": ["attn.to_add_out"],
    "img_mlp.0": ["ff.linear_in"],
    "img_mlp.2": ["ff.linear_out"],
    "txt_mlp.0": ["ff_context.linear_in"],
    "txt_mlp.2": ["ff_context.linear_out"],
}
BFL_SINGLE_BLOCK = {"linear1": ["attn.to_qkv_mlp_proj"], "linear2": ["attn.to_out"]}


def ai_toolkit_key(kind: str, i: int, part: str) -> str:
    return f"diffusion_model.{kind}.{i}.{part}"


def musubi_key(kind: str, i: int, part: str) -> str:
    """musubi-tuner's ``lora_unet_`` prefix with the BFL module path's dots as underscores."""
    return f"lora_unet_{kind}_{i}_{part.replace('.', '_')}"


def bfl_lora(linears, rank: int, seed: int, key_of, down: str, up: str, alpha: float | None = None) -> dict:
    """A random LoRA over every double- and single-stream block layer in BFL naming."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for kind, diffusers_kind, parts in (("double_blocks", "transformer_blocks", BFL_DOUBLE_BLOCK),
                                        ("single_blocks", "single_transformer_blocks", BFL_SINGLE_BLOCK)):
        i = 0
        while f"{diffusers_kind}.{i}.{next(iter(parts.values()))[0]}" in linears:
            for part, targets in parts.items():
                in_f = linears[f"{diffusers_kind}.{i}.{targets[0]}"][0]
                out_f = sum(linears[f"{diffusers_kind}.{i}.{t}"][1] for t in targets)
                key = key_of(kind, i, part)
                sd[f"{key}.{down}"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
                sd[f"{key}.{up}"] = torch.randn(out_f, rank, generator=g) * 0.5 / rank**0.5
                if alpha is not None:
                    sd[f"{key}.alpha"] = torch.tensor(float(alpha))
            i += 1
    return sd


def save_file_at(path: Path, sd: Mapping[str, Any]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path
