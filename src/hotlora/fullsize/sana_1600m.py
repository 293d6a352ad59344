"""Sana 1600M 1024px as published: the Hugging Face Hub repository
``Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers``, the model diffusers' own Sana LoRA
trainer (``examples/dreambooth/train_dreambooth_lora_sana.py``) starts from, so ``hotlora plan
sana-1600m`` builds it on the meta device and ``bench/full_size.py --family sana`` serves it at its
real size on a CPU.

Source (the Hub is not reachable where this was written): diffusers' conversion script
``scripts/convert_sana_to_diffusers.py`` at commit 58eb52c0 writes these files: the transformer's
``model_kwargs["SanaMS_1600M_P1_D20"]`` (70 heads of 32, 20 layers, cross-attention 20 heads of
112 at 2240) with its common fields (32 latent channels in and out, caption channels 2304, MLP
ratio 2.5, no attention bias, patch size 1, ``sample_size`` 1024 // 32, no interpolation scale at
1024), the default ``flow-dpm_solver`` scheduler (``DPMSolverMultistepScheduler`` with
``flow_shift`` 3.0, flow sigmas, flow prediction), the DC-AE ``mit-han-lab/dc-ae-f32c32-sana-1.1``
whose shape is ``convert_dcae_to_diffusers.py``'s ``dc-ae-f32c32-sana-1.0`` config (1.1 retrained
the weights, not the shape), and the text encoder ``Efficient-Large-Model/gemma-2-2b-it``'s
decoder (``Gemma2Model``), whose config is google/gemma-2-2b-it's: recalled field by field, not
compared with a copy of the file. The transformer has 1,604,462,752 parameters (checked at build
time and in ``tests/unit/test_fullsize_plans.py``; the model's name says "1600M").

Built offline with random seeded weights for the full-size run::

    python -m hotlora.fullsize.sana_1600m build DIR [--seed 0] [--dtype bfloat16] [--adapters DIR]

The tokenizer is the character-level Gemma tokenizer the tiny Sana uses, adding ``<bos>`` as Gemma's
does (so the empty negative prompt is one token, not a fully masked text); the real vocabulary
cannot be downloaded here; the embedding table keeps its real 256,000 rows. Two adapters, as Sana's
trainers write them (random weights, real layout and size): diffusers' DreamBooth LoRA script's
default (rank 32 here, ``to_k``/``to_q``/``to_v`` of both attentions, ``save_lora_weights`` with its
``LoraConfig``) and a rank-128 one on every Linear of the transformer blocks (what ``--lora_layers``
widens it to, and SimpleTuner's ``all`` target writes in the same layout).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

NAME = "sana-1600m"
HUB_ID = "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers"
PUBLISHED_TRANSFORMER_PARAMETERS = "1600M"
TRANSFORMER_PARAMETERS = 1_604_462_752

MODEL_INDEX = {
    "_class_name": "SanaPipeline",
    "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
    "text_encoder": ["transformers", "Gemma2Model"],
    "tokenizer": ["transformers", "GemmaTokenizerFast"],
    "transformer": ["diffusers", "SanaTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderDC"],
}

TRANSFORMER = {
    "_class_name": "SanaTransformer2DModel",
    "attention_bias": False,
    "attention_head_dim": 32,
    "caption_channels": 2304,
    "cross_attention_dim": 2240,
    "cross_attention_head_dim": 112,
    "in_channels": 32,
    "interpolation_scale": None,
    "mlp_ratio": 2.5,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 70,
    "num_cross_attention_heads": 20,
    "num_layers": 20,
    "out_channels": 32,
    "patch_size": 1,
    "sample_size": 32,
}

VAE = {
    "_class_name": "AutoencoderDC",
    "attention_head_dim": 32,
    "decoder_act_fns": "silu",
    "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "decoder_block_types": ["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock",
                            "EfficientViTBlock"],
    "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
    "decoder_norm_types": "rms_norm",
    "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "downsample_block_type": "conv",
    "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "encoder_block_types": ["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock",
                            "EfficientViTBlock"],
    "encoder_layers_per_block": [2, 2, 2, 3, 3, 3],
    "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "in_channels": 3,
    "latent_channels": 32,
    "scaling_factor": 0.41407,
    "upsample_block_type": "interpolate",
}

TEXT_ENCODER = {  # google/gemma-2-2b-it; the pipeline loads its decoder, Gemma2Model
    "architectures": ["Gemma2Model"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": 30.0,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 256000,
}

SCHEDULER = {
    "_class_name": "DPMSolverMultistepScheduler",
    "flow_shift": 3.0,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}

TOKENIZER_VOCABULARY = {"tokenizer": 256000}

COMPONENTS = {"transformer": TRANSFORMER, "text_encoder": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER}

# The adapters' LoRA branch: a few % of its layer's output, as for SDXL's full-size run.
ADAPTER_STRENGTH = 0.05
DREAMBOOTH_TARGETS = (".to_k", ".to_q", ".to_v")  # train_dreambooth_lora_sana.py's default target_modules
log = logging.getLogger(__name__)


def _config(values: dict) -> dict:
    """A published config as its class's constructor takes it (without the keys naming the class)."""
    return {k: v for k, v in values.items() if k not in ("_class_name", "architectures", "torch_dtype")}


def components(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The pipeline's parts from the configs above, seeded, built directly in ``dtype``."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from hotlora.families.generic import char_tokenizer

    tokenizer = char_tokenizer(add_bos_token=True)  # Gemma's own tokenizer starts every text with <bos>
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        config = Gemma2Config(**{**_config(TEXT_ENCODER), "pad_token_id": tokenizer.pad_token_id,
                                 "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
        parts = {"transformer": SanaTransformer2DModel.from_config(_config(TRANSFORMER)),
                 "text_encoder": Gemma2Model(config),
                 "vae": AutoencoderDC.from_config(_config(VAE))}
    finally:
        torch.set_default_dtype(previous)
    parts = {name: module.eval() for name, module in parts.items()}
    parts["scheduler"] = DPMSolverMultistepScheduler.from_config(_config(SCHEDULER))
    parts["tokenizer"] = tokenizer
    return parts


def save_sana(directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Build and save the pipeline like a Hub snapshot; returns ``directory``."""
    from diffusers import SanaPipeline

    directory = Path(directory)
    parts = components(seed, dtype)
    count = sum(p.numel() for p in parts["transformer"].parameters())
    if count != TRANSFORMER_PARAMETERS:  # the configs above were mistyped: refuse to save a wrong model
        raise AssertionError(f"transformer has {count:,} parameters, Sana 1600M's {TRANSFORMER_PARAMETERS:,}")
    SanaPipeline(**parts).save_pretrained(str(directory))
    defaults = {"model_id": "hotlora/sana-1600m-full-size-random", "base_model_aliases": [HUB_ID], "height": 256,
                "width": 256, "num_inference_steps": 4}
    (directory / "hotlora.json").write_text(json.dumps(defaults, indent=2))
    log.info("saved Sana 1600M (transformer %s parameters, %s) to %s", f"{count:,}", dtype, directory)
    return directory


def adapter_layers() -> dict[str, dict[str, tuple[int, int]]]:
    """{"dreambooth", "all_linear"} -> the transformer's module name -> (in, out), read on the meta device."""
    from diffusers import SanaTransformer2DModel

    with torch.device("meta"):
        transformer = SanaTransformer2DModel.from_config(_config(TRANSFORMER))
    blocks = {name: (m.in_features, m.out_features) for name, m in transformer.named_modules()
              if isinstance(m, torch.nn.Linear) and name.startswith("transformer_blocks.")}
    return {"dreambooth": {n: shape for n, shape in blocks.items() if n.endswith(DREAMBOOTH_TARGETS)},
            "all_linear": blocks}


def write_adapters(out: str | Path) -> dict[str, Path]:
    """Both real-size adapters under ``out``: {"dreambooth-r32": file, "diffusers-r128": file}."""
    from hotlora.tiny import random_lora, save_diffusers_lora

    out = Path(out)
    layers = adapter_layers()
    made = {}
    for key, part, rank, seed in (("dreambooth-r32", "dreambooth", 32, 1), ("diffusers-r128", "all_linear", 128, 4)):
        sd = {k: v.half() for k, v in random_lora(layers[part], rank, seed, strength=ADAPTER_STRENGTH).items()}
        made[key] = save_diffusers_lora(out / key, "sana", sd, rank=rank, alpha=rank)
    return made


def main(argv: list[str] | None = None) -> None:
    from hotlora.fullsize._build import build_command

    build_command(argv, module="sana_1600m", what="Sana 1600M", save=save_sana, write_adapters=write_adapters)


if __name__ == "__main__":
    main()
