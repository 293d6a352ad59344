"""The generic family: a pipeline hotlora has no module for, served from the facts diffusers gives,
when it follows the conventions the engine relies on.

The conventions (``convention_problems`` checks each on the pipeline class, before anything loads):
    - a diffusers LoRA loader mixin whose loadable modules are exactly one denoiser, ``transformer``
      (no text-encoder LoRA: the text writer would have nothing declared to work with);
    - no second denoiser among the constructor's models (Wan 2.2's ``transformer_2``, Ideogram's
      ``unconditional_transformer``): the slots live in one model;
    - a standard ``__call__``: ``prompt``, ``num_inference_steps``, ``guidance_scale`` (with a
      numeric default), ``height``, ``width``, ``generator``, ``num_images_per_prompt``,
      ``output_type`` and ``callback_on_step_end``;
    - nothing measured to break under them (``KNOWN_BREAKS``: fullgraph compile, sizes the
      pipeline changes behind the caller's back).

What is read from diffusers: the denoiser and its class (the mixin, the constructor's annotation),
default steps and guidance (``__call__``'s defaults), whether negative prompts exist, the default
size (``__call__``'s, else the transformer's ``sample_size`` times the VAE factor). What it cannot
read is declared per pipeline in ``GENERIC`` and tested on its tiny model: the CFG style (the
tests count the denoiser's batch at the default guidance and at 1), the published models' patch
size, arguments fixed on every call (Sana's resolution binning, off), prompts warm-up runs (where
the prompt's length reaches the denoiser).

A pipeline is served only if it is claimed here (a tiny model, covered by the contract test); any
other is refused at start-up naming the pipeline and the convention it misses, or saying that it
follows them but no tiny model tests it. Mixed batches (``mixed=True``, the banks writer) are
served where a claim says so (``Claim.mixed``: measured on its tiny model) and refused at start-up
elsewhere: per-sample binding needs one row per sample on every Linear (or the runs of packed rows,
``Claim.packed_linears``; on the second axis, ``Claim.sequence_first_linears``) and a batch of prompts
that gives each what it gives alone. Measured: Sana, Krea 2 (fixed-length prompts; its text fusion
packs each sample's tokens) and ERNIE-Image (masked prompts, sequence-first MLPs) yes; CogView4 pads a
batch's prompts to the longest (two prompts 0.3 off each alone), so it mixes requests of the same prompt
and negative prompt only (``Claim.mixed_same_texts``); AuraFlow's batch of two prompts is 2e-4 off each
alone: refused. The pipeline encodes a batch's prompts in one call, so under CFG a missing and a given
negative prompt do not share a batch.
"""

from __future__ import annotations

import inspect
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from hotlora.families import krea2
from hotlora.families._tiny import comfy_prefixed
from hotlora.families.base import CfgStyle, ModelFamily

REQUIRED_CALL_ARGUMENTS = ("prompt", "num_inference_steps", "guidance_scale", "height", "width", "generator",
                           "num_images_per_prompt", "output_type", "callback_on_step_end")

# Measured here (docs: design.md, "Families: facts measured here"): what breaks a pipeline that
# otherwise looks conventional. Keyed by class name; a subclass inherits its base's entry.
KNOWN_BREAKS = {
    "HiDreamImagePipeline": "fullgraph compile fails on its MoE routing (it calls .cpu().numpy()), and it "
                            "rescales every size to a fixed area, so the size asked is not the size run",
    "Lumina2Pipeline": "fullgraph compile fails on its data-dependent caption lengths",
    "Kandinsky5T2IPipeline": "it runs any size but its seven resolutions (1024x1024, 640x1408, 1408x640, 768x1280, "
                             "1280x768, 896x1152, 1152x896) as the one nearest in aspect ratio, so the size asked is "
                             "not the size run",
}


def _lora_mixin(pipeline_type: type) -> type | None:
    for cls in pipeline_type.__mro__:
        if cls.__name__.endswith("LoraLoaderMixin") and "_lora_loadable_modules" in vars(cls):
            return cls
    return None


def _is_model_class(annotation: Any) -> bool:
    from diffusers import ModelMixin

    return isinstance(annotation, type) and issubclass(annotation, ModelMixin)


def convention_problems(pipeline_type: type) -> list[str]:
    """Every convention of the generic family ``pipeline_type`` misses, in words (empty: it follows them)."""
    mixin = _lora_mixin(pipeline_type)
    if mixin is None:
        return ["it has no diffusers LoRA loader mixin"]
    problems = []
    loadable = list(mixin._lora_loadable_modules)
    if loadable != ["transformer"]:
        others = [m for m in loadable if m != "transformer"]
        problems.append(f"its LoRA mixin {mixin.__name__} loads into {', '.join(loadable)}; the generic family "
                        "needs exactly one denoiser, transformer"
                        + (f" (no text-encoder LoRA: {', '.join(others)})" if others else ""))
    init = inspect.signature(pipeline_type.__init__).parameters
    seconds = [name for name, p in init.items() if name != "transformer" and _is_model_class(p.annotation)
               and ("transformer" in name or "unet" in name)]
    if seconds:
        problems.append(f"it has a second denoiser ({', '.join(seconds)}); the slots live in one")
    call = inspect.signature(pipeline_type.__call__).parameters
    missing = [name for name in REQUIRED_CALL_ARGUMENTS if name not in call]
    if missing:
        problems.append(f"its __call__ takes no {', '.join(missing)}")
    for name in ("num_inference_steps", "guidance_scale"):
        if name in call and not isinstance(call[name].default, (int, float)):
            problems.append(f"its __call__ gives {name} no numeric default")
    for cls in pipeline_type.__mro__:
        if cls.__name__ in KNOWN_BREAKS:
            problems.append(KNOWN_BREAKS[cls.__name__])
            break
    return problems


@dataclass(frozen=True)
class Claim:
    """What hotlora declares of one pipeline the generic family serves (what diffusers does not say)."""

    name: str  # the family's name (CLI, registry)
    pipeline_class: str
    cfg: CfgStyle  # read from its __call__; tests/unit/test_generic_families.py measures it
    latent_multiple: int  # the published models' patch size
    build_tiny: Callable[[int], Any]
    tiny_size: int = 32
    # Arguments every call passes (warm-up, requests, the tests' reference), each with why.
    fixed: Mapping[str, Any] = field(default_factory=dict)
    why_fixed: str = ""
    # Prompts of different token lengths where the prompt's length reaches the denoiser.
    warmup_prompts: tuple[str, ...] = ("warm-up",)
    # Plan name -> its published configuration's module in hotlora.fullsize (ModelFamily.full_size_models).
    full_size_models: Mapping[str, str] = field(default_factory=dict)
    # The transformer's block classes, for regional compilation, where it declares no
    # ``_repeated_blocks``: compiled whole, a full-size one traces every layer for every graph.
    repeated_blocks: tuple[str, ...] = ()
    # "true" CFG: the guidance above which the pipeline runs its second pass (read from its
    # ``do_classifier_free_guidance``; Krea 2 guides above 0).
    guides_above: float = 1.0
    # Recognising its adapters and base model ids (ModelFamily.lora_key_pattern, base_model_markers).
    lora_key_pattern: str = ""
    base_model_markers: tuple[str, ...] = ()
    # Its trainers' own layouts that diffusers' converter reads: sample name -> a writer of PEFT-form
    # layers in that layout (the tiny model's samples; the first is the contract test's).
    trainer_layouts: Mapping[str, Callable[[Mapping], dict]] = field(default_factory=dict)
    # ModelFamily.converter_reads_peft_prefix: a trainer's layout under PEFT's key prefix.
    converter_reads_peft_prefix: Callable[[Iterable[str]], bool] | None = None
    # ModelFamily.checkpoint_defaults: defaults a loaded checkpoint's config implies.
    checkpoint_defaults: Callable[[Any], dict] | None = None
    # Whether it serves mixed batches: its forward passes keep one row per sample on every Linear
    # of the denoiser and a batch of prompts gives each what it gives alone (the mixed-batch tests
    # pass on its tiny model against plain diffusers).
    mixed: bool = False
    # Whether it serves mixed batches of requests with the same prompt and negative prompt only: its
    # pipeline pads a batch's prompts to the longest (CogView4), so prompts of different lengths in one
    # batch give each something else than alone, while a templated prompt with each user's adapters mixes.
    mixed_same_texts: bool = False
    # ModelFamily.packed_linears / packed_segments: Linears fed every sample's rows packed together.
    packed_linears: tuple[str, ...] = ()
    packed_segments: Callable[[tuple, Mapping[str, Any]], dict[str, list[int]]] | None = None
    # ModelFamily.sequence_first_linears: Linears whose input is [tokens, batch, ...].
    sequence_first_linears: str = ""


class GenericFamily(ModelFamily):
    """A family made from a ``Claim`` and the pipeline's facts in diffusers."""

    generic = True
    # Its prompts are encoded by the pipeline, one call a batch (no ``encode_prompts`` per group):
    # under CFG a missing negative prompt and a given one cannot share that call.
    mixed_batch_shares = "the presence of a negative prompt"
    mixed_batches_refused = ("no tiny model of it has been tested binding adapters per sample (one row per sample on "
                             "every Linear, a batch of prompts giving each what it gives alone)")

    def __init__(self, claim: Claim):
        self.claim = claim
        self.name, self.pipeline_class, self.cfg = claim.name, claim.pipeline_class, claim.cfg
        self.latent_multiple, self.tiny_size = claim.latent_multiple, claim.tiny_size
        self.embedding_keys, self.tokenizer_of, self.prompt_argument_of = (), {}, {}
        self.full_size_models, self.repeated_blocks = claim.full_size_models, claim.repeated_blocks
        self.lora_key_pattern, self.base_model_markers = claim.lora_key_pattern, claim.base_model_markers
        self.mixed_batches, self.packed_linears = claim.mixed or claim.mixed_same_texts, claim.packed_linears
        if claim.mixed_same_texts:
            self.mixed_batch_shares = "the prompt and negative prompt"
        self.sequence_first_linears = claim.sequence_first_linears

    @property
    def _call_defaults(self) -> Mapping[str, Any]:
        return {name: p.default for name, p in inspect.signature(self.pipeline_type.__call__).parameters.items()}

    @property
    def denoiser_class(self) -> str:  # the constructor's annotation of the denoiser
        return inspect.signature(self.pipeline_type.__init__).parameters[self.denoiser].annotation.__name__

    @property
    def default_steps(self) -> int:
        return int(self._call_defaults["num_inference_steps"])

    @property
    def default_guidance(self) -> float:
        return float(self._call_defaults["guidance_scale"])

    @property
    def negative_prompts(self) -> bool:
        return "negative_prompt" in self._call_defaults

    @property
    def default_size(self) -> tuple[int, int]:
        """``__call__``'s height and width defaults where it has them (None: worked out from the
        model at load, ``pipeline_default_size``; 1024 stands for it here)."""
        defaults = self._call_defaults
        height, width = defaults.get("height"), defaults.get("width")
        return (height, width) if isinstance(height, int) and isinstance(width, int) else (1024, 1024)

    def pipeline_default_size(self, pipeline) -> tuple[int, int]:
        defaults = self._call_defaults
        height, width = defaults.get("height"), defaults.get("width")
        if isinstance(height, int) and isinstance(width, int):
            return height, width
        sample = getattr(getattr(pipeline, self.denoiser).config, "sample_size", None)
        side = int(sample * pipeline.vae_scale_factor) if isinstance(sample, int) else super().pipeline_default_size(
            pipeline)[0]
        return side, side

    def matches(self, pipeline_type: type, denoiser_class: str | None = None) -> int:
        """2 for the claimed pipeline or a subclass; 0 for anything else, variants sharing its mixin
        too (their ``__call__`` is another's: an img2img, a distilled sampler)."""
        return 2 if self.pipeline_class in {cls.__name__ for cls in pipeline_type.__mro__} else 0

    def plan_tokens(self, configs: Mapping[str, dict], latent_pixels: int) -> tuple[int, int]:
        """The image tokens (the published patch size, ``latent_multiple``) and the blocks' width
        (heads x head dim): what a calibrated fit scales (Sana's, ``bench/plan_calibrate.py``); a
        family without one (AuraFlow, CogView4) is planned by its weights and says so."""
        denoiser = configs[self.denoiser]
        width = denoiser.get("hidden_size") or denoiser["num_attention_heads"] * denoiser["attention_head_dim"]
        return latent_pixels // self.latent_multiple ** 2, width

    def call_arguments(self, guidance_scale: float) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, **self.claim.fixed}

    def warmup_prompts(self, pipeline=None) -> tuple[str, ...]:
        return self.claim.warmup_prompts

    def converter_reads_peft_prefix(self, keys) -> bool:
        return bool(self.claim.converter_reads_peft_prefix and self.claim.converter_reads_peft_prefix(keys))

    def checkpoint_defaults(self, pipeline) -> dict[str, Any]:
        return self.claim.checkpoint_defaults(pipeline) if self.claim.checkpoint_defaults else {}

    def trainer_lora(self, path, linears, sd, rank: int, seed: int):
        from safetensors.torch import save_file

        writers = list(self.claim.trainer_layouts.values())
        if not writers:
            return None
        save_file(writers[0](sd), str(path))
        return path

    def write_trainer_samples(self, pipeline, linears, out, rank: int, attention_only) -> dict:
        from safetensors.torch import save_file

        from hotlora.families._tiny import random_lora

        samples = {}
        for seed, (name, write) in enumerate(self.claim.trainer_layouts.items(), start=4):
            save_file(write(random_lora(linears, rank, seed=seed)), str(out / f"{name}.safetensors"))
            samples[name] = out / f"{name}.safetensors"
        return samples

    def build_tiny(self, seed: int = 0):
        return self.claim.build_tiny(seed)

    def mixed_batch_texts(self, prompt: str, negative: str | None, text_state: tuple) -> tuple:
        return (prompt, negative) if self.claim.mixed_same_texts else (negative is None,)

    def packed_segments(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, list[int]]:
        return self.claim.packed_segments(args, kwargs)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "generic": True, "fixed_arguments": dict(self.claim.fixed),
                **({"why_fixed": self.claim.why_fixed} if self.claim.fixed else {})}


# ----------------------------------------------------------------------------- tiny models


def char_tokenizer(add_bos_token: bool = False):
    """A character-level Gemma tokenizer built in memory (BPE, no merges): specials first, then
    every printable ASCII character. ``add_bos_token``: an empty prompt is one token, not none
    (CogView4 pads its prompts by length and runs the text encoder on them as they are)."""
    from transformers import GemmaTokenizer

    specials = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    vocab = {token: i for i, token in enumerate(specials.values())}
    for char in "\u2581" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=add_bos_token, **specials)


def _small_vae(latent_channels: int = 4):
    """An AutoencoderKL of two blocks: a VAE factor of 2."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         layers_per_block=1, norm_num_groups=1, sample_size=32)


def tiny_auraflow(seed: int = 0):
    import torch
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from hotlora.families._tiny import t5_tokenizer

    torch.manual_seed(seed)
    transformer = AuraFlowTransformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        out_channels=4, pos_embed_max_size=256)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=160, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                               relative_attention_num_buckets=8, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))
    return AuraFlowPipeline(tokenizer=t5_tokenizer(), text_encoder=text_encoder, vae=_small_vae(),
                            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler())


def tiny_sana(seed: int = 0):
    import torch
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=8,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        sample_size=16)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407)
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=8, hidden_size=16, intermediate_size=32, max_position_embeddings=4096, num_attention_heads=2,
        num_hidden_layers=1, num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, attn_implementation="eager"))
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))


def tiny_cogview4(seed: int = 0):
    import torch
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmModel

    torch.manual_seed(seed)
    tokenizer = char_tokenizer(add_bos_token=True)
    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
        text_embed_dim=32, time_embed_dim=8, condition_dim=4, sample_size=16)
    text_encoder = GlmModel(GlmConfig(
        hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
        num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    return CogView4Pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=_small_vae(), transformer=transformer,
                            scheduler=scheduler)


def tiny_ernie_image(seed: int = 0):
    """diffusers' classes at small widths: a two-stage Flux.2 VAE (its latents patchified 2x2 by the
    pipeline: a factor of 4), a two-layer Mistral3 text model and Flux.2's byte tokenizer."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler,
    )
    from transformers import Mistral3Model

    from hotlora.families._tiny import draw_zero_parameters, mistral3_config
    from hotlora.families.flux2 import mistral_tokenizer

    torch.manual_seed(seed)
    transformer = ErnieImageTransformer2DModel(
        hidden_size=16, num_attention_heads=2, num_layers=2, ffn_hidden_size=32, in_channels=16, out_channels=16,
        patch_size=1, text_in_dim=8, rope_theta=256, rope_axes_dim=(4, 2, 2), eps=1e-6, qk_layernorm=True)
    draw_zero_parameters(transformer)  # its final_linear and modulation start at zero: all outputs would too
    vae = AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    tokenizer = mistral_tokenizer()
    text_encoder = Mistral3Model(mistral3_config(len(tokenizer), layers=2, max_positions=512)).eval()
    return ErnieImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              scheduler=FlowMatchEulerDiscreteScheduler())


GENERIC: tuple[Claim, ...] = (
    Claim(name="auraflow", pipeline_class="AuraFlowPipeline", cfg="batch", latent_multiple=2,
          build_tiny=tiny_auraflow, repeated_blocks=("AuraFlowJointTransformerBlock", "AuraFlowSingleTransformerBlock")),
    Claim(name="sana", pipeline_class="SanaPipeline", cfg="batch", latent_multiple=1, build_tiny=tiny_sana,
          fixed={"use_resolution_binning": False}, full_size_models={"sana-1600m": "sana_1600m"},
          repeated_blocks=("SanaTransformerBlock",), mixed=True,
          why_fixed="Sana snaps every size to its resolution bins by default; hotlora runs the size asked "
                    "(a served size is one warmed up), so binning is off on every call"),
    # CogView4 pads its prompt to a multiple of 16 tokens, not to a fixed length: the text length
    # reaches the transformer. Warm-up runs prompts of two lengths, so dynamo turns that dimension
    # dynamic and any later length reuses the graphs (tests/unit/test_generic_families.py).
    Claim(name="cogview4", pipeline_class="CogView4Pipeline", cfg="true", latent_multiple=2,
          build_tiny=tiny_cogview4, repeated_blocks=("CogView4TransformerBlock",), mixed_same_texts=True,
          warmup_prompts=("warm-up", "a warm-up prompt of more than sixteen tokens, so a second text length")),
    # Krea 2 pads every prompt to max_sequence_length (512): one text length. 48 pixels: 36 image
    # tokens, no tiny width (16 channels, a head's 8) for dynamo's duck sizing to tie them to.
    Claim(name="krea2", pipeline_class="Krea2Pipeline", cfg="true", guides_above=0.0, latent_multiple=2,
          build_tiny=krea2.tiny_krea2, tiny_size=48, full_size_models={"krea2-turbo": "krea2_turbo"},
          lora_key_pattern=r"text_fusion[._](layerwise|refiner)_blocks|txtfusion[._]|blocks[._]\d+[._]attn[._](to_gate|wq)\b",
          base_model_markers=("krea-2", "krea2", "krea_2"), trainer_layouts=krea2.TRAINER_LAYOUTS,
          converter_reads_peft_prefix=krea2.ai_toolkit_names, checkpoint_defaults=krea2.checkpoint_defaults,
          mixed=True, packed_linears=krea2.PACKED_LINEARS, packed_segments=krea2.packed_segments),
    # ERNIE-Image encodes each prompt unpadded and pads a batch to its longest (with the lengths as a
    # mask): the text length reaches the transformer, so warm-up runs two lengths (as CogView4's).
    Claim(name="ernie-image", pipeline_class="ErnieImagePipeline", cfg="batch", latent_multiple=1,
          build_tiny=tiny_ernie_image, fixed={"use_pe": False},
          why_fixed="its prompt enhancer (a checkpoint's optional `pe` language model) rewrites every prompt by "
                    "sampling (temperature 0.6), so a seed would not fix the image; hotlora runs prompts as sent",
          warmup_prompts=("warm-up", "a warm-up prompt of more than sixteen tokens, so a second text length"),
          lora_key_pattern=r"layers[._]\d+[._]self_attention[._]to_[qkv]|layers[._]\d+[._]mlp[._]linear_fc2",
          base_model_markers=("ernie-image", "ernie_image"),
          trainer_layouts={"style-comfy": comfy_prefixed},
          # Its blocks run sequence-first: the MLPs and the final layer see [tokens, batch, width].
          mixed=True, sequence_first_linears=r"layers\.\d+\.mlp\..*|final_linear"),
)

GENERIC_FAMILIES: tuple[GenericFamily, ...] = tuple(GenericFamily(claim) for claim in GENERIC)
