"""Parts the families' tiny offline models share: tokenizers built in memory (the hub is never
reached) and a small CLIP text encoder config, plus random LoRA weights for their sample adapters."""

from __future__ import annotations

import string
from typing import Iterable, Mapping


def clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE with no merges: every byte is a token. End-of-text gets the highest id,
    # which is what CLIP's legacy pooling (argmax of input ids) expects.
    vocab = {}
    for suffix in ("", "</w>"):
        for char in bytes_to_unicode().values():
            vocab[char + suffix] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -2.0) for c in string.ascii_lowercase]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    return T5TokenizerFast(vocab=pieces, model_max_length=512)


def clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=512, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-5,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=513, vocab_size=600, hidden_act="gelu",
        projection_dim=32, max_position_embeddings=77,
    )


def random_lora(linears: Mapping[str, tuple[int, int]], rank: int, seed: int, modules: Iterable[str] | None = None,
                strength: float = 0.5) -> dict:
    """A random LoRA in PEFT key form (``module.lora_A.weight``), unprefixed.

    ``strength`` sizes the update so that it visibly moves the output of the tiny models.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    chosen = list(modules) if modules is not None else list(linears)
    sd = {}
    for name in chosen:
        in_f, out_f = linears[name]
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * strength / rank**0.5
    return sd


# A Qwen chat template reduced to what the pipelines render: messages in ChatML (a content string, or
# Qwen-VL's list of parts, whose text parts are kept: Qwen-Image 2.1's system message), the assistant's
# turn opened by ``add_generation_prompt``, and Qwen3's empty thinking block when ``enable_thinking`` is
# false (Z-Image passes it true).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


# Qwen2.5-VL's vision tokens, numbered after the text vocabulary in this order (the tiny Qwen-Image
# text encoder's config names these ids): start, end, and the pad each image's patches replace.
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


def draw_zero_parameters(model, scale: float = 0.2) -> None:
    """Every all-zero parameter of ``model`` drawn from N(0, scale^2): diffusers zero-initialises output
    layers, modulation tables and zero-centred norms, behind which a tiny model's output ignores
    the blocks (ERNIE-Image's ``final_linear``: every output zero, every adapter without effect)."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():
                parameter.copy_(torch.randn_like(parameter) * scale)


def mistral3_config(vocab_size: int, layers: int, max_positions: int):
    """A small Mistral3 (Mistral text model with a one-layer Pixtral vision tower), ids as Flux.2's
    byte tokenizer numbers its specials: Flux.2's and ERNIE-Image's text encoders."""
    from transformers import Mistral3Config

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": vocab_size, "hidden_size": 8, "intermediate_size": 8,
                     "max_position_embeddings": max_positions, "num_attention_heads": 2,
                     "num_hidden_layers": layers, "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-05,
                     "rope_theta": 1000000000.0, "sliding_window": None, **ids},
        vision_config={"model_type": "pixtral", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 8, "image_size": 30, "patch_size": 6, "num_channels": 3},
        image_seq_length=4, vision_feature_layer=-1, image_token_index=3, **ids,
    )


def qwen_tokenizer(vision: bool = False):
    """A byte-level BPE tokenizer of the Qwen kind (Qwen2Tokenizer) with no merges: every byte is one
    token, so Qwen-Image's prompt template is far more than the 34 tokens its pipeline drops.
    ChatML special tokens after the bytes; the chat template handles ``enable_thinking``.
    ``vision``: Qwen's vision tokens too (the same ids before them), ``<|image_pad|>`` named the
    tokenizer's ``image_token``, where a processor looks for it."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
    for special in specials + (QWEN_VISION_TOKENS if vision else ()):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=131072,
                               **({"extra_special_tokens": {"image_token": "<|image_pad|>"}} if vision else {}))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                                *(QWEN_VISION_TOKENS if vision else ())]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen_vl_processor(tokenizer, max_pixels: int, patch_size: int = 14):
    """An image processor and ``tokenizer`` (``qwen_tokenizer(vision=True)``) as one processor, as
    the Qwen-Image-Edit pipelines call it: ``processor(text=..., images=..., padding=True)``, each
    ``<|image_pad|>`` expanded to the image's merged patches. ``max_pixels`` bounds what the vision
    tower sees (the pipelines hand it 384 x 384 or more); ``patch_size``: the vision tower's (Qwen2.5-VL's
    14, Qwen3-VL's 16).

    Qwen-Image-Edit checkpoints ship a ``Qwen2VLProcessor``, whose constructor and loader require
    transformers' video processor and so torchvision, which does not import beside this torch build.
    ``PaddleOCRVLProcessor`` is transformers' processor of a Qwen2-VL-derived model without video:
    the same ``ProcessorMixin.__call__``, the same expansion (``image_grid_thw.prod() //
    merge_size**2``), over the same ``Qwen2VLImageProcessor`` (its PIL backend)."""
    from transformers import PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels, patch_size=patch_size,
                                               merge_size=2, temporal_patch_size=2)
    return PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template)


def save_kohya_layout(path, sd: Mapping, alpha: float, keep=lambda module: True):
    """``sd`` (PEFT form) as kohya-style trainers write it: ``lora_unet_`` + the module path with
    dots flattened to underscores, ``lora_down`` / ``lora_up`` and an ``alpha`` per module (musubi-tuner's
    LoRANetwork: ``networks/lora.py``, prefix ``lora_unet``). ``keep``: the modules the trainer targets."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for key, value in sd.items():
        module, part = key.split(".lora_")
        if not keep(module):
            continue
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    save_file(out, str(path), metadata={"ss_network_module": "networks.lora", "ss_network_alpha": str(alpha)})
    return path


def comfy_prefixed(sd: Mapping, prefix: str = "diffusion_model.") -> dict:
    """``sd`` (PEFT form) under ComfyUI's ``diffusion_model.`` prefix, ``lora_A`` / ``lora_B`` and no alpha,
    as ai-toolkit saves Z-Image, Qwen-Image and ERNIE-Image LoRAs (its own Z-Image assistant adapter is
    read as ``diffusion_model.layers.0.attention.to_k.lora_A.weight``)."""
    return {prefix + key: value.contiguous() for key, value in sd.items()}


def save_prefixed_layout(path, sd: Mapping, prefix: str = "diffusion_model."):
    """``comfy_prefixed`` written to ``path``."""
    from safetensors.torch import save_file

    save_file(comfy_prefixed(sd, prefix), str(path))
    return path


def musubi_and_comfy_samples(linears, out, rank: int, attention_only, keep) -> dict:
    """The two trainers' layouts of the single-stream DiT families (Z-Image, Qwen-Image) as sample
    adapters: musubi-tuner's kohya names over the Linears it trains (``keep``), alpha rank / 2, and
    ai-toolkit's ComfyUI-prefixed diffusers names over the attention layers."""
    musubi = save_kohya_layout(out / "style-kohya.safetensors", random_lora(linears, rank, seed=4), alpha=rank / 2,
                               keep=keep)
    toolkit = save_prefixed_layout(out / "style-comfy.safetensors", random_lora(linears, rank, seed=5,
                                                                                modules=attention_only))
    return {"style-kohya": musubi, "style-comfy": toolkit}

