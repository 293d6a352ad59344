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
