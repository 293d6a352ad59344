"""The published configurations of the full-size models ``hotlora plan`` can name (hotlora.fullsize):
each denoiser, built on the meta device with the class its config names, has the exact parameter
count its module records, within 1% of the model card's figure where the card's figure is not a
rounded name; the text encoders, where their architecture names a transformers class, have their
published sizes. No weights are allocated: each build is seconds."""

import importlib
from types import SimpleNamespace

import pytest
import torch

from hotlora.engine.plan.models import _build, build_parts, on_meta

# diffusers' ChromaTransformer2DModel builds its rotary embedding with a class diffusers deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`FluxPosEmbed` is deprecated:FutureWarning")

# module -> (denoiser component, parameters the model card gives, tolerance against that figure)
PUBLISHED = {
    "zimage_turbo": ("transformer", 6e9, 0.03),  # "6B" (6.15B)
    "qwen_image": ("transformer", 20e9, 0.03),  # "20B" (20.43B)
    "qwen_image_21": ("transformer", 7e9, 0.02),  # "7B" (7.12B)
    "flux2_dev": ("transformer", 32e9, 0.01),  # "32B" (32.22B)
    "flux2_klein_4b": ("transformer", 4e9, 0.035),  # "4B" is a rounded name (3.88B)
    "flux2_klein_9b": ("transformer", 9e9, 0.01),  # "9B" (9.08B)
    "sd35_large": ("transformer", 8.1e9, 0.01),  # "8.1B" (8.06B)
    "sd35_medium": ("transformer", 2.5e9, 0.11),  # "2.5B" on the card; the class builds 2.24B (see its docstring)
    "chroma1_hd": ("transformer", 8.9e9, 0.01),  # "8.9B" (8.90B)
    "sd15": ("unet", 860e6, 0.01),  # "860M" (859.5M)
    "wan21_t2v_1_3b": ("transformer", 1.3e9, 0.10),  # "1.3B" is a rounded name (1.42B)
    "wan21_t2v_14b": ("transformer", 14e9, 0.025),  # "14B" (14.29B)
    "wan22_t2v_a14b": ("transformer", 14e9, 0.025),  # "14B" per expert (14.29B each)
    # "14B" is the family's name: the image cross-attention adds 2.1B (16.39B; see the module)
    "wan21_i2v_14b_480p": ("transformer", 14e9, 0.18),
    "wan21_flf2v_14b_720p": ("transformer", 14e9, 0.18),  # I2V's and a position embedding of 514 x 1280
    "wan22_i2v_a14b": ("transformer", 14e9, 0.025),  # "14B" per expert (14.29B each)
    "wan22_ti2v_5b": ("transformer", 5e9, 0.01),  # "5B" (5.00B)
    "ltx_video": ("transformer", 2e9, 0.04),  # "2B" is a rounded name (1.92B)
    "sana_1600m": ("transformer", 1.6e9, 0.01),  # "1600M" (1.604B)
    "krea2_turbo": ("transformer", 12.9e9, 0.01),  # "12.9B" (12.82B)
}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build(module, component: str) -> torch.nn.Module:
    """A component built as the engine's plan builds it: the class ``MODEL_INDEX`` names (else its
    config's), from its config, on the meta device."""
    config = module.COMPONENTS[component]
    entry = module.MODEL_INDEX.get(component)
    if isinstance(entry, list):
        library, class_name = entry
    elif "_class_name" in config:
        library, class_name = "diffusers", config["_class_name"]
    else:
        library, class_name = "transformers", config["architectures"][0]
    with on_meta(torch.bfloat16):
        return _build(component, library, class_name, config, torch.bfloat16)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_denoiser_has_the_published_parameter_count(name):
    module = importlib.import_module(f"hotlora.fullsize.{name}")
    component, published, tolerance = PUBLISHED[name]
    denoiser = build(module, component)
    assert next(denoiser.parameters()).device.type == "meta"
    assert type(denoiser).__name__ == module.COMPONENTS[component]["_class_name"]
    exact = module.UNET_PARAMETERS if component == "unet" else module.TRANSFORMER_PARAMETERS
    assert count(denoiser) == exact
    assert abs(exact - published) / published <= tolerance


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_module_is_in_the_plan_format(name):
    """What engine/plan/models.py reads: NAME, HUB_ID, MODEL_INDEX, COMPONENTS (component -> a config
    naming its class, the classes the model index names), a tokenizer vocabulary per text encoder."""
    module = importlib.import_module(f"hotlora.fullsize.{name}")
    assert module.NAME and "/" in module.HUB_ID and module.MODEL_INDEX["_class_name"].endswith("Pipeline")
    for component, config in module.COMPONENTS.items():
        assert "_class_name" in config or "architectures" in config, component
        assert component in module.MODEL_INDEX, component
        library, class_name = module.MODEL_INDEX[component]
        if library == "diffusers":
            assert config["_class_name"] == class_name, component
            import diffusers

            assert hasattr(diffusers, class_name), class_name
    encoders = [c for c in module.COMPONENTS if c.startswith("text_encoder")]
    tokenizers = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
    assert set(getattr(module, "TOKENIZER_VOCABULARY", {})) == {tokenizers[e] for e in encoders}


# module, component -> parameters (the published sizes of the text encoders they ship)
TEXT_ENCODERS = {
    ("zimage_turbo", "text_encoder"): 4_022_468_096,  # Qwen3-4B as Qwen3Model: 4.02B, embeddings tied
    ("flux2_klein_9b", "text_encoder"): 8_190_735_360,  # Qwen3-8B: 8.19B
    ("qwen_image", "text_encoder"): 8_292_166_656,  # Qwen2.5-VL-7B-Instruct: 8.29B
    ("qwen_image_21", "text_encoder"): 8_767_123_696,  # Qwen3-VL-8B-shaped: 8.77B
    ("flux2_dev", "text_encoder"): 24_011_361_280,  # Mistral-Small-3.2-24B: 24.0B
    ("sd35_large", "text_encoder_2"): 694_659_840,  # OpenCLIP bigG/14 text tower with projection
    # UMT5-XXL's encoder: 5.68B, consistent with the 11.4 GB bf16 encoder file Wan ships (not confirmed here)
    ("wan21_t2v_1_3b", "text_encoder"): 5_680_910_336,
    ("sana_1600m", "text_encoder"): 2_614_341_888,  # gemma-2-2b-it's decoder: 2.61B
}


@pytest.mark.parametrize("name,component", sorted(TEXT_ENCODERS))
def test_text_encoder_has_the_published_size(name, component):
    module = importlib.import_module(f"hotlora.fullsize.{name}")
    assert count(build(module, component)) == TEXT_ENCODERS[name, component]


def test_plan_places_each_component_where_its_pipeline_has_it(monkeypatch):
    """Once a family lists a module in ``full_size_models``, the plan builds each of ``COMPONENTS``
    under its own name: SD3's CLIP-L with projection is ``text_encoder`` and T5 ``text_encoder_3``
    (placing by class alone would put both on ``text_encoder_2``)."""
    from hotlora.engine.plan import models
    from hotlora.fullsize import sd35_large

    family = SimpleNamespace(name="sd3", denoiser="transformer", denoiser_class="SD3Transformer2DModel", other_denoisers=(),
                             tokenizer_of={"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2",
                                           "text_encoder_3": "tokenizer_3"})
    monkeypatch.setattr(models, "full_size_model", lambda name: (family, "sd35_large"))
    spec = models._built_in("sd3.5-large")
    assert set(spec.configs) == {"transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"}
    assert spec.classes["text_encoder_3"] == ("transformers", "T5EncoderModel")
    parts = build_parts(spec, torch.bfloat16)
    assert count(parts.transformer) == sd35_large.TRANSFORMER_PARAMETERS
    assert type(parts.text_encoder).__name__ == "CLIPTextModelWithProjection"
    assert type(parts.text_encoder_3).__name__ == "T5EncoderModel"
    assert parts.tokenizer_3.size == 32100


def test_plan_builds_the_class_the_model_index_names(monkeypatch):
    """Z-Image's text encoder config names Qwen3ForCausalLM; its pipeline loads Qwen3Model."""
    from hotlora.engine.plan import models

    family = SimpleNamespace(name="zimage", denoiser="transformer", denoiser_class="ZImageTransformer2DModel", other_denoisers=(),
                             tokenizer_of={"text_encoder": "tokenizer"})
    monkeypatch.setattr(models, "full_size_model", lambda name: (family, "zimage_turbo"))
    spec = models._built_in("zimage-turbo")
    assert spec.classes["text_encoder"] == ("transformers", "Qwen3Model")
    assert spec.vocabulary == {"tokenizer": 151665}


@pytest.mark.parametrize("name,factor,width", [("sd15", 8, 128), ("flux2_dev", 8, 128), ("qwen_image", 8, 96),
                                               ("qwen_image_21", 16, 144), ("sd35_large", 8, 128),
                                               ("wan21_t2v_14b", 8, 96), ("wan22_ti2v_5b", 16, 256),
                                               ("ltx_video", 32, 128), ("sana_1600m", 32, 128)])
def test_activation_workload_reads_every_vae_layout(name, factor, width):
    """The plan's activation workload reads the VAE's scale and width from AutoencoderKL-style
    configs (block_out_channels), from the Wan-style ones Qwen-Image ships and from Sana's DC-AE, as
    its pipelines do."""
    from hotlora.engine.plan.activations import vae_scale_factor, vae_width

    vae = importlib.import_module(f"hotlora.fullsize.{name}").COMPONENTS["vae"]
    assert (vae_scale_factor(vae), vae_width(vae)) == (factor, width)


def test_wan22_a14b_builds_both_experts_as_published():
    """Wan 2.2 A14B's low-noise expert is its own component with the high-noise expert's config and
    size, switched to at the published boundary; the plan builds and counts both (a built-in spec
    reads the family's other denoisers as a folder's does)."""
    from hotlora.engine.plan import models
    from hotlora.fullsize import wan22_t2v_a14b as a14b

    assert a14b.MODEL_INDEX["boundary_ratio"] == 0.875
    assert count(build(a14b, "transformer_2")) == a14b.TRANSFORMER_PARAMETERS
    spec = models._built_in("wan2.2-t2v-a14b")
    assert {"transformer", "transformer_2"} <= set(spec.configs)
    parts = build_parts(spec, torch.bfloat16)
    assert count(parts.transformer) == count(parts.transformer_2) == a14b.TRANSFORMER_PARAMETERS
    assert "transformer_2" not in models._built_in("wan2.1-t2v-14b").configs


def test_wan_image_to_video_plans_hold_the_image_encoder_and_both_experts():
    """Wan2.1-I2V's plan builds and counts its CLIP image encoder (ViT-H/14 with projection) beside
    the transformer; Wan2.2-I2V-A14B's both image-to-video experts, switched at 0.9. Both are
    image-to-video checkpoints of the wan family."""
    from hotlora.engine.plan import models
    from hotlora.families import family_named, family_of_model_index
    from hotlora.fullsize import wan21_flf2v_14b_720p as flf2v, wan21_i2v_14b_480p as i2v, wan22_i2v_a14b as a14b

    assert count(build(i2v, "image_encoder")) == i2v.IMAGE_ENCODER_PARAMETERS
    # FLF2V: the I2V transformer with a position embedding over both frames' CLIP tokens.
    parts = build_parts(models._built_in("wan2.1-flf2v-14b-720p"), torch.bfloat16)
    assert count(parts.transformer) == flf2v.TRANSFORMER_PARAMETERS == i2v.TRANSFORMER_PARAMETERS + 514 * 1280
    assert count(parts.image_encoder) == flf2v.IMAGE_ENCODER_PARAMETERS
    published = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120, "pos_embed_seq_len": 514,
                 "rope_max_seq_len": 1024, "num_layers": 40, "num_attention_heads": 40, "ffn_dim": 13824}
    assert {key: parts.transformer.config[key] for key in published} == published
    assert tuple(parts.transformer.condition_embedder.image_embedder.pos_embed.shape) == (1, 514, 1280)
    assert flf2v.SCHEDULER["flow_shift"] == 16.0 and i2v.SCHEDULER["flow_shift"] == 3.0
    # Its image features take both frames: image-to-video with two input images, not one or two.
    pipeline = SimpleNamespace(config={}, image_encoder=parts.image_encoder, transformer=parts.transformer)
    assert family_named("wan").input_frame_counts(pipeline) == (2,)
    parts = build_parts(models._built_in("wan2.1-i2v-14b-480p"), torch.bfloat16)
    assert count(parts.image_encoder) == i2v.IMAGE_ENCODER_PARAMETERS
    assert count(parts.transformer) == i2v.TRANSFORMER_PARAMETERS
    assert a14b.MODEL_INDEX["boundary_ratio"] == 0.9
    parts = build_parts(models._built_in("wan2.2-i2v-a14b"), torch.bfloat16)
    assert count(parts.transformer) == count(parts.transformer_2) == a14b.TRANSFORMER_PARAMETERS
    wan = family_named("wan")
    for module in (i2v, a14b, flf2v):
        assert family_of_model_index(module.MODEL_INDEX) is wan
        assert wan.conditioned_checkpoints[module.MODEL_INDEX["_class_name"]] == "image-to-video"


def test_wan22_ti2v_5b_plan_builds_48_channels_over_the_wan22_vae():
    """Wan 2.2 TI2V-5B's plan: one transformer of 48 channels in and out (no ``transformer_2``), the
    48-channel Wan 2.2 VAE (16x spatial) built from its config, ``expand_timesteps`` in its model
    index (what lets the wan family serve image-to-video on it), a text-to-video model of the family."""
    from hotlora.engine.plan import models
    from hotlora.families import family_named, family_of_model_index
    from hotlora.fullsize import wan22_ti2v_5b as ti2v

    assert ti2v.MODEL_INDEX["_class_name"] == "WanPipeline" and ti2v.MODEL_INDEX["expand_timesteps"] is True
    assert "boundary_ratio" not in ti2v.MODEL_INDEX and ti2v.SCHEDULER["flow_shift"] == 5.0
    spec = models._built_in("wan2.2-ti2v-5b")
    assert "transformer_2" not in spec.configs
    parts = build_parts(spec, torch.bfloat16)
    assert (parts.transformer.config.in_channels, parts.transformer.config.out_channels) == (48, 48)
    assert count(parts.transformer) == ti2v.TRANSFORMER_PARAMETERS
    assert parts.vae.config.z_dim == 48 and parts.vae.config.is_residual and parts.vae.config.patch_size == 2
    assert parts.vae.config.scale_factor_spatial == 16
    wan = family_named("wan")
    assert family_of_model_index(ti2v.MODEL_INDEX) is wan
    assert ti2v.MODEL_INDEX["_class_name"] not in wan.conditioned_checkpoints


def test_wan22_ti2v_5b_plan_workload_at_720p():
    """81 frames are 21 latent frames; the Wan 2.2 VAE is 16x spatial, so a 1280x704 latent frame is
    80 x 44 latent pixels, (44 / 2) x (80 / 2) patches; the layer width is 24 heads x 128."""
    from hotlora.engine.plan.activations import workload
    from hotlora.families import family_named
    from hotlora.fullsize import wan22_ti2v_5b

    work = workload(family_named("wan"), wan22_ti2v_5b.COMPONENTS, 704, 1280, images=1, cfg=False)
    assert (work.tokens, work.width) == (21 * 22 * 40, 3072)


@pytest.mark.parametrize("size,tokens", [((480, 832), 21 * 60 * 104 // 4), ((720, 1280), 21 * 90 * 160 // 4)])
def test_wan_plan_workload_at_the_published_sizes(size, tokens):
    """81 frames are 21 latent frames (4x temporal, the first kept); each latent frame is
    (height / 8 / 2) x (width / 8 / 2) patches; the layer width is 40 heads x 128 at 14B."""
    from hotlora.engine.plan.activations import workload
    from hotlora.families import family_named
    from hotlora.fullsize import wan21_t2v_14b

    work = workload(family_named("wan"), wan21_t2v_14b.COMPONENTS, *size, images=1, cfg=False)
    assert (work.tokens, work.width) == (tokens, 5120)


@pytest.mark.parametrize("size,tokens", [((480, 832), 21 * 15 * 26), ((704, 1280), 21 * 22 * 40)])
def test_ltx_plan_workload_at_its_sizes(size, tokens):
    """161 frames are 21 latent frames (8x temporal, the first kept); each latent frame is
    (height / 32) x (width / 32) tokens (patch 1); the layer width is 32 heads x 64."""
    from hotlora.engine.plan.activations import workload
    from hotlora.families import family_named
    from hotlora.fullsize import ltx_video

    work = workload(family_named("ltx"), ltx_video.COMPONENTS, *size, images=1, cfg=True)
    assert (work.tokens, work.width, work.batch, work.frames) == (tokens, 2048, 2, 161)


def test_sana_plan_models_the_dc_ae_decode_with_its_own_fit():
    """Sana's DC-AE is no AutoencoderKL: the plan counts its weights (312M) and predicts its decode
    with its own fit (``dc_ae_decode``), never the AutoencoderKL one; its transformer with its own."""
    from hotlora.engine.plan import models
    from hotlora.engine.plan.activations import predict, vae_part, workload
    from hotlora.engine.plan.planner import _coefficients
    from hotlora.families import family_named

    spec = models._built_in("sana-1600m")
    assert spec.family is family_named("sana") and spec.classes["text_encoder"] == ("transformers", "Gemma2Model")
    parts = build_parts(spec, torch.bfloat16)
    assert count(parts.vae) == 312_250_275
    work = workload(spec.family, spec.configs, 1024, 1024, 1, cfg=True)
    assert (work.tokens, work.width, work.vae_channels, work.vae_part) == (32 * 32, 2240, 128, "dc_ae_decode")
    assert vae_part(spec.configs["vae"]) == "dc_ae_decode"
    only_kl = {"vae": {"decode": {"bfloat16": {"one": (1.0, 0)}}}}  # an AutoencoderKL fit, which must not apply
    assert predict(only_kl, "sana", work, torch.bfloat16, "slots")["vae_decode"] is None
    predicted = predict(_coefficients(), "sana", work, torch.bfloat16, "slots")
    # ~1.67 GiB for the decode; the transformer's one block (linear attention, 1,024 image tokens) far less
    assert 1 * 2**30 < predicted["vae_decode"] < 3 * 2**30 and 0 < predicted["denoiser"] < predicted["vae_decode"] / 4


@pytest.mark.parametrize("name", ["flux-dev", "sdxl", "sd15", "sd3.5-large", "sd3.5-medium", "zimage-turbo", "qwen-image",
                                  "qwen-image-2.1", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "chroma1-hd",
                                  "sana-1600m"])
def test_published_image_model_is_planned_with_its_activations(name):
    """Every built-in image model (Krea 2 aside: its plan counts image tokens only, not calibrated) has
    its denoiser's and its VAE's activations predicted (``bench/plan_calibrate.py``), in both dtypes a
    server runs, so a plan's verdict covers a pack and not the weights alone; Qwen-Image's VAEs by fits
    of their own (one latent frame of a causal video VAE), never the AutoencoderKL one."""
    from hotlora.engine.plan import models
    from hotlora.engine.plan.activations import coefficient, predict, workload
    from hotlora.engine.plan.planner import _coefficients

    spec = models._built_in(name)
    work = workload(spec.family, spec.configs, 1024, 1024, 1, cfg=False)
    for dtype in (torch.bfloat16, torch.float32):
        predicted = predict(_coefficients(), spec.family.name, work, dtype, "slots")
        assert predicted["denoiser"] > 0 and predicted["vae_decode"] > 0, (dtype, predicted)
    if spec.family.name.startswith("qwenimage"):
        assert coefficient(_coefficients(), spec.family.name, work.vae_part, torch.bfloat16) is not None
