"""The family registry: facts read from diffusers match what each family's pipeline does, every
lookup (name, pipeline class with its variants, model_index.json) finds the same family, and no
module outside ``hotlora.families`` branches on a family's name."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hotlora.families import (
    DEFAULT_FAMILY, FAMILIES, REGISTERED, family_named, family_of_class, family_of_denoiser_class, family_of_model_index,
    full_size_model, full_size_names,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "hotlora"
# A family's name as a string literal, or a comparison with one: every registered name.
BRANCH_ON_NAME = re.compile(r'"(' + "|".join(re.escape(name) for name in sorted(FAMILIES, key=len, reverse=True))
                            + r')"|family\.name ==', re.IGNORECASE)


@pytest.mark.parametrize("family", REGISTERED, ids=lambda f: f.name)
def test_facts_read_from_diffusers_agree_with_the_pipeline(family):
    import diffusers

    pipeline = getattr(diffusers, family.pipeline_class)
    loadable = pipeline._lora_loadable_modules
    assert family.denoiser in loadable
    # Chroma's loadable text_encoder is T5, which diffusers cannot load LoRA into (checked below).
    unloadable = {"text_encoder"} if family.name == "chroma" else set()
    assert set(family.lora_text_encoders) == set(loadable) - {family.denoiser, *family.other_denoisers} - unloadable
    assert set(family.other_denoisers) <= set(loadable)
    # The denoiser the family names is the one the pipeline's constructor takes, of the declared class.
    import inspect

    import typing

    annotation = inspect.signature(pipeline.__init__).parameters[family.denoiser].annotation
    # Optional where the pipeline may go without it (WanPipeline: either expert may be absent).
    classes = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    assert [c.__name__ for c in classes] == [family.denoiser_class]
    # Every embedding key extends a text encoder the pipeline has, with a tokenizer it has.
    parameters = inspect.signature(pipeline.__init__).parameters
    for _, encoder in family.embedding_keys:
        assert encoder in parameters and family.tokenizer_of[encoder] in parameters
    assert family.cfg in ("none", "batch", "true")
    if family.negative_prompts:  # served only where the pipeline takes them (Flux takes one for true CFG, not served)
        assert "negative_prompt" in inspect.signature(pipeline.__call__).parameters


@pytest.mark.parametrize("family", REGISTERED, ids=lambda f: f.name)
def test_every_lookup_finds_the_same_family(family, tmp_path):
    import diffusers

    assert family_named(family.name) is family
    assert family_of_class(family.pipeline_type, config=family.pipeline_config) is family
    index = {"_class_name": family.pipeline_class, family.denoiser: ["diffusers", family.denoiser_class],
             **family.pipeline_config}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert family_of_model_index(tmp_path) is family
    assert family_of_model_index(index) is family
    # A subclass (a user's own pipeline) is still the family's.
    subclass = type("MyPipeline", (getattr(diffusers, family.pipeline_class),), {})
    assert family_of_class(subclass, config=family.pipeline_config) is family
    for name in family.full_size_models:
        assert full_size_model(name)[0] is family and name in full_size_names()


@pytest.mark.parametrize("variant, expected", [
    ("FluxImg2ImgPipeline", "flux"), ("FluxInpaintPipeline", "flux"),
    ("StableDiffusionXLImg2ImgPipeline", "sdxl"), ("StableDiffusionXLInpaintPipeline", "sdxl"),
    ("StableDiffusionImg2ImgPipeline", "sd15"), ("StableDiffusionInpaintPipeline", "sd15"),
    ("StableDiffusion3Img2ImgPipeline", "sd3"), ("StableDiffusion3InpaintPipeline", "sd3"),
    ("ChromaImg2ImgPipeline", "chroma"), ("ChromaInpaintPipeline", "chroma"),
    ("QwenImageEditPlusPipeline", "qwenimage"), ("QwenImageEditPipeline", "qwenimage"),
])
def test_task_variants_resolve_to_their_base_family(variant, expected):
    import diffusers

    assert family_of_class(getattr(diffusers, variant)).name == expected


def test_a_pipeline_sharing_a_mixin_is_told_apart_by_its_denoiser():
    """Chroma loads LoRA through Flux's mixin but is another model: served as chroma, never as Flux."""
    import diffusers

    assert family_of_class(diffusers.ChromaPipeline).name == "chroma"
    assert family_of_class(diffusers.FluxPipeline).name == "flux"
    assert family_of_model_index({"_class_name": "ChromaPipeline",
                                  "transformer": ["diffusers", "ChromaTransformer2DModel"]}).name == "chroma"
    # A Flux-mixin pipeline over a denoiser no family serves is still refused.
    mine = type("MyFluxMixinPipeline", (diffusers.DiffusionPipeline, diffusers.loaders.FluxLoraLoaderMixin), {})
    with pytest.raises(ValueError, match="not a pipeline hotlora serves"):
        family_of_class(mine, "MyTransformer")
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        family_named("nope")
    with pytest.raises(ValueError, match="not a diffusers pipeline"):
        family_of_model_index({"_class_name": "NoSuchPipeline"})


def test_klein_is_two_families_told_apart_by_is_distilled():
    """One pipeline class, two guidance regimes: the model's ``is_distilled`` (model_index.json)
    picks the family; without it the pipeline's default (False: base) applies."""
    import diffusers

    index = {"_class_name": "Flux2KleinPipeline", "transformer": ["diffusers", "Flux2Transformer2DModel"]}
    assert family_of_model_index({**index, "is_distilled": True}).name == "flux2-klein"
    assert family_of_model_index({**index, "is_distilled": False}).name == "flux2-klein-base"
    assert family_of_model_index(index).name == "flux2-klein-base"
    assert family_of_class(diffusers.Flux2KleinPipeline).name == "flux2-klein-base"


def test_flux2_and_chroma_facts_agree_with_their_pipelines():
    """What the families declare, read against diffusers' code: guidance regimes, negative prompts,
    which text encoder takes LoRA."""
    import inspect

    import diffusers

    klein, base = family_named("flux2-klein"), family_named("flux2-klein-base")
    call = inspect.signature(diffusers.Flux2KleinPipeline.__call__).parameters
    assert "negative_prompt" not in call and not klein.negative_prompts and not base.negative_prompts
    # do_classifier_free_guidance: guidance > 1 and not is_distilled (a second pass on "").
    cfg = diffusers.Flux2KleinPipeline.do_classifier_free_guidance.fget

    def fake(distilled):
        return type("P", (), {"_guidance_scale": 4.0, "config": type("C", (), {"is_distilled": distilled})})

    assert not cfg(fake(True)) and cfg(fake(False))
    assert klein.cfg == "none" and not klein.takes_guidance and "guidance_scale" not in klein.request_options()
    assert base.cfg == "true" and base.takes_guidance and not base.doubles_batch(4.0)
    flux2 = family_named("flux2")
    assert "negative_prompt" not in inspect.signature(diffusers.Flux2Pipeline.__call__).parameters
    assert flux2.cfg == "none" and flux2.takes_guidance and flux2.lora_text_encoders == ()
    assert inspect.signature(diffusers.Flux2Pipeline.__call__).parameters["guidance_scale"].default == flux2.default_guidance
    chroma = family_named("chroma")
    parameters = inspect.signature(diffusers.ChromaPipeline.__init__).parameters
    assert "text_encoder" in diffusers.ChromaPipeline._lora_loadable_modules and chroma.lora_text_encoders == ()
    assert parameters["text_encoder"].annotation.__name__ == "T5EncoderModel"
    # Why none: diffusers' own loader fails on a T5 LoRA (a test that fails the day it learns to load one).
    import torch

    pipeline = chroma.build_tiny()
    name = "encoder.block.0.layer.0.SelfAttention.q"
    linear = pipeline.text_encoder.get_submodule(name)
    t5_lora = {f"text_encoder.{name}.lora_A.weight": torch.zeros(2, linear.in_features),
               f"text_encoder.{name}.lora_B.weight": torch.zeros(linear.out_features, 2)}
    with pytest.raises(ValueError, match="Could not automatically infer state dict type"):
        pipeline.load_lora_weights(t5_lora, adapter_name="t5")
    assert chroma.embedding_keys == () and chroma.cfg == "true" and chroma.negative_prompts
    call = inspect.signature(diffusers.ChromaPipeline.__call__).parameters
    assert (call["num_inference_steps"].default, call["guidance_scale"].default) == (chroma.default_steps,
                                                                                     chroma.default_guidance)


def test_guidance_styles():
    """Under batch CFG warm-up runs every batch shape a guidance makes (guided and not; LTX-2's
    audio guidance doubles at any); other styles never double."""
    for family in REGISTERED:
        scales = family.warmup_guidance_scales(family.default_guidance)
        assert scales[0] == family.default_guidance
        if family.cfg == "batch":
            shapes = {family.doubles_batch(g) for g in (0.0, 1.0, family.default_guidance, 9.0)}
            assert {family.doubles_batch(g) for g in scales} == shapes and True in shapes
        else:
            assert not any(family.doubles_batch(g) for g in (*scales, family.default_guidance))
        for g in scales:
            assert family.batch_factor(g) == (2 if family.doubles_batch(g) else 1)
    assert DEFAULT_FAMILY in FAMILIES


def test_a_family_whose_mixed_batches_share_texts_says_which():
    """``mixed_batch_texts`` (the batch key) and ``mixed_batch_shares`` (the refusal's words) are
    declared apart: a family that keys its batches by texts must say so, and only such a family."""
    for family in REGISTERED:
        keyed = family.mixed_batch_texts("a", None, ()) != family.mixed_batch_texts("b", "n", ("state",))
        assert keyed == bool(family.mixed_batch_shares), family.name


def test_no_module_outside_the_families_branches_on_a_family_name():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        # families/ holds the facts; fullsize/ the published configurations, named by plan names
        # (``sdxl``, ``sd15``) that happen to be family names too.
        if {"families", "fullsize"} & set(path.relative_to(SRC).parts):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH_ON_NAME.search(line):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "family facts belong in hotlora/families/:\n" + "\n".join(found)


def test_the_check_sees_a_branch(tmp_path):
    assert BRANCH_ON_NAME.search('if engine.family.name == "sdxl":')
    assert BRANCH_ON_NAME.search('DEFAULTS = {"flux": 28}')
    assert not BRANCH_ON_NAME.search('model = "flux-dev"')


def test_sd15_and_sdxl_share_a_denoiser_class_and_resolve_apart():
    """Both denoise with UNet2DConditionModel: the pipeline class (or model_index.json's
    ``_class_name``) tells them apart, the denoiser class alone does not."""
    sd15, sdxl = family_named("sd15"), family_named("sdxl")
    assert sd15.denoiser_class == sdxl.denoiser_class == "UNet2DConditionModel"
    for family in (sd15, sdxl):
        index = {"_class_name": family.pipeline_class, "unet": ["diffusers", "UNet2DConditionModel"]}
        assert family_of_model_index(index) is family
    assert family_of_denoiser_class("UNet2DConditionModel") is None  # ambiguous
    assert family_of_denoiser_class("SD3Transformer2DModel") is family_named("sd3")
    assert family_of_denoiser_class("FluxTransformer2DModel") is family_named("flux")
    assert REGISTERED[0].name == "flux"


def test_sd15_facts_against_diffusers():
    import inspect

    import diffusers

    family = family_named("sd15")
    call = inspect.signature(diffusers.StableDiffusionPipeline.__call__).parameters
    assert (call["num_inference_steps"].default, call["guidance_scale"].default) == (family.default_steps,
                                                                                     family.default_guidance)
    assert family.lora_text_encoders == ("text_encoder",) and family.denoiser == "unet"
    assert "prompt_2" not in call and family.prompt_argument_of == {"text_encoder": "prompt"}
    assert family.cfg == "batch" and family.default_size == (512, 512)


def test_sd3_facts_against_diffusers():
    import inspect

    import diffusers

    family = family_named("sd3")
    pipeline = diffusers.StableDiffusion3Pipeline
    call = inspect.signature(pipeline.__call__).parameters
    assert call["num_inference_steps"].default == family.default_steps
    assert {"negative_prompt_2", "negative_prompt_3", "prompt_3"} <= set(call)
    init = inspect.signature(pipeline.__init__).parameters
    for encoder, tokenizer in family.tokenizer_of.items():
        assert encoder in init and tokenizer in init
    assert set(family.prompt_argument_of.values()) <= set(call)
    assert family.lora_text_encoders == ("text_encoder", "text_encoder_2")  # not T5
    # The transformer declares no _repeated_blocks: the family names the class its blocks are.
    assert not getattr(diffusers.SD3Transformer2DModel, "_repeated_blocks", None)
    from diffusers.models.transformers import transformer_sd3

    for block in family.repeated_blocks:
        assert isinstance(getattr(transformer_sd3, block), type)
    assert inspect.signature(diffusers.SD3Transformer2DModel.__init__).parameters["patch_size"].default == \
        family.latent_multiple


def test_a_mixed_batch_derives_every_encoders_prompt_as_the_pipeline_does():
    """A row that lacks ``prompt_2`` / ``prompt_3`` (SD3's T5) takes ``prompt``, as the pipelines'
    ``encode_prompt`` does; the negative prompts likewise."""
    from hotlora.engine.prompts import columns

    rows = [{"prompt": "a", "prompt_3": "c", "negative_prompt": "n"}, {"prompt": "b", "prompt_2": "x", "negative_prompt_3": "m"}]
    assert columns(rows) == {"prompt": ["a", "b"], "prompt_2": ["a", "x"], "prompt_3": ["c", "b"],
                             "negative_prompt": ["n", ""], "negative_prompt_3": ["n", "m"]}
@pytest.mark.parametrize("name", ["flux2", "flux2-klein", "flux2-klein-base", "chroma"])
def test_prompt_length_never_reaches_the_denoiser_as_a_shape(name):
    """These pipelines pad every prompt to max_sequence_length before the text encoder, so one
    compiled graph serves every prompt: a one-word and a long prompt encode to the same shapes,
    and a group's embeddings come one row per prompt."""
    family = family_named(name)
    pipeline = family.build_tiny()
    short = family.encode_prompts(pipeline, {"prompt": ["a"]}, cfg=False)
    long = family.encode_prompts(pipeline, {"prompt": ["a long prompt " * 20, "b"]}, cfg=False)
    assert set(short) == set(long)
    for key in short:
        assert short[key].shape[1:] == long[key].shape[1:] and long[key].shape[0] == 2, key
    assert short["prompt_embeds"].shape[1] == 512


@pytest.mark.parametrize("variant, expected", [
    ("ZImageImg2ImgPipeline", "zimage"), ("ZImageInpaintPipeline", "zimage"),
    ("QwenImageImg2ImgPipeline", "qwenimage"), ("QwenImageInpaintPipeline", "qwenimage"),
])
def test_zimage_and_qwenimage_variants_resolve(variant, expected):
    import diffusers

    assert family_of_class(getattr(diffusers, variant)).name == expected


def test_qwenimage_21_shares_the_mixin_but_not_the_denoiser():
    """Qwen-Image 2.1 runs QwenImage21Transformer2DModel under Qwen-Image's mixin: its own family,
    found by its pipeline or its model_index.json; Qwen-Image's variants stay Qwen-Image's."""
    import diffusers

    assert family_named("qwenimage").matches(diffusers.QwenImage21ModularPipeline, "QwenImage21Transformer2DModel") == 0
    assert family_named("qwenimage").matches(diffusers.QwenImage21Pipeline) == 0
    assert family_of_class(diffusers.QwenImage21Pipeline).name == "qwenimage21"
    assert family_of_model_index({"_class_name": "QwenImage21Pipeline",
                                  "transformer": ["diffusers", "QwenImage21Transformer2DModel"]}).name == "qwenimage21"
    assert family_of_class(diffusers.QwenImageImg2ImgPipeline).name == "qwenimage"
    with pytest.raises(ValueError, match="not a pipeline hotlora serves"):
        family_of_model_index({"_class_name": "QwenImageEditPipeline",
                               "transformer": ["diffusers", "QwenImage21Transformer2DModel"]})


def test_zimage_guidance_facts_agree_with_its_pipeline():
    """Z-Image guides for guidance_scale > 0, as one doubled (list) batch; cfg_normalization and
    cfg_truncation fixed at the pipeline's own defaults."""
    import inspect

    import diffusers

    family = family_named("zimage")
    pipeline = diffusers.ZImagePipeline
    assert pipeline.do_classifier_free_guidance.fget(type("P", (), {"_guidance_scale": 0.0})()) is False
    assert pipeline.do_classifier_free_guidance.fget(type("P", (), {"_guidance_scale": 0.5})()) is True
    assert not family.doubles_batch(0.0) and family.doubles_batch(0.5) and family.batch_factor(1.0) == 2
    assert family.warmup_guidance_scales(0.0) == [0.0, 1.0] and family.warmup_guidance_scales(4.0) == [4.0, 0.0]
    parameters = inspect.signature(pipeline.__call__).parameters
    for name, value in family.call_arguments(2.0).items():
        assert name in parameters
        if name != "guidance_scale":
            assert parameters[name].default == value
    assert family.default_negative_prompt(3.0) is None
    assert (family.default_steps, family.default_guidance) == (9, 0.0)
    assert "latent_multiple" not in vars(pipeline) and family.size_multiple(8) == 16  # vae factor x 2 (its __call__)


def test_qwenimage_guidance_facts_agree_with_its_pipeline():
    """Qwen-Image: hotlora's guidance is ``true_cfg_scale``, true CFG needs a negative prompt."""
    import inspect

    import diffusers

    family = family_named("qwenimage")
    parameters = inspect.signature(diffusers.QwenImagePipeline.__call__).parameters
    assert set(family.call_arguments(4.0)) == {"true_cfg_scale"} and "true_cfg_scale" in parameters
    assert family.cfg == "true" and not family.doubles_batch(4.0) and family.batch_factor(4.0) == 1
    assert family.default_negative_prompt(4.0) == " " and family.default_negative_prompt(1.0) is None
    assert sorted(family.warmup_guidance_scales(4.0)) == [1.0, 4.0]
    assert (family.default_steps, family.default_guidance) == (50, 4.0)


def test_qwenimage_joins_groups_as_its_pipeline_pads_a_batch():
    import torch

    family = family_named("qwenimage")
    a = {"prompt_embeds": torch.ones(1, 3, 2), "prompt_embeds_mask": torch.ones(1, 3, dtype=torch.long)}
    b = {"prompt_embeds": torch.ones(1, 5, 2) * 2, "prompt_embeds_mask": torch.ones(1, 5, dtype=torch.long)}
    joined = family.join_encoded([a, b])
    assert joined["prompt_embeds"].shape == (2, 5, 2) and joined["prompt_embeds"][0, 3:].abs().sum() == 0
    assert joined["prompt_embeds_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert family.join_encoded([b, b])["prompt_embeds_mask"] is None  # all valid: None, as encode_prompt gives


def test_qwen_tokenizer_keeps_more_than_qwenimage_drops():
    from hotlora.families._tiny import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    template = "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, " \
               "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
    assert len(tokenizer(template).input_ids) > 34
    thinking = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    assert thinking.endswith("<think>\n\n</think>\n\n")


def test_a_qwen_image_edit_checkpoint_is_the_qwenimage_family():
    """Qwen-Image-Edit-2509's model_index.json (QwenImageEditPlusPipeline over Qwen-Image's
    transformer class) is served by the qwenimage family."""
    index = {"_class_name": "QwenImageEditPlusPipeline", "processor": ["transformers", "Qwen2VLProcessor"],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"]}
    assert family_of_model_index(index).name == "qwenimage"


def test_linears_in_the_compiled_blocks_and_lora_layers_read_contiguous_inputs():
    """fold_linear_inputs hooks each Linear (or LoRA layer as a whole) inside the repeated blocks
    once, and outside them the LoRA layers over a Linear only (their base weight is frozen): an
    embedder's plain Linear would pay a Python call per step for nothing; a LoRA layer's base layer
    and factors share their wrapper's input."""
    import torch
    from peft import LoraConfig

    from hotlora.engine.pipeline import _contiguous_input, fold_linear_inputs

    flux = family_named("flux")
    denoiser = flux.build_tiny().transformer
    denoiser.add_adapter(LoraConfig(r=2, target_modules=["to_q", "proj_out"]), adapter_name="slot")
    fold_linear_inputs(denoiser, flux)
    fold_linear_inputs(denoiser, flux)  # a rebuilt engine folds again: still one hook a layer
    blocks = {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    inside = {name for name, m in denoiser.named_modules() if type(m).__name__ in blocks}
    for name, module in denoiser.named_modules():
        hooks = list(module._forward_pre_hooks.values()).count(_contiguous_input)
        in_block = any(name.startswith(block + ".") for block in inside)
        wrapped = any(name.startswith(w + ".") for w, m in denoiser.named_modules() if hasattr(m, "base_layer"))
        layer = isinstance(module, torch.nn.Linear) or hasattr(module, "base_layer")
        lora_outside = hasattr(module, "base_layer") and not in_block
        assert hooks == int(layer and (in_block or lora_outside) and not wrapped), name
    assert hasattr(denoiser.proj_out, "base_layer") and list(denoiser.proj_out._forward_pre_hooks.values()) == [
        _contiguous_input]
    assert not denoiser.x_embedder._forward_pre_hooks  # a plain Linear outside the blocks
    sliced = torch.randn(2, 7, 4)[:, 3:]
    folded = _contiguous_input(None, (sliced,))[0]
    assert folded.is_contiguous() and torch.equal(folded, sliced)


def test_flux_single_blocks_hand_on_contiguous_outputs_once_compiled():
    """Flux's single-stream block returns slices of its joined sequence: compiled, its outputs are
    made contiguous, so every later block receives the first one's strides and runs its graphs
    (instead of compiling its own for the sliced strides); the double-stream blocks are left alone."""
    import torch

    from hotlora.engine.pipeline import _contiguous_outputs, compile_denoiser

    flux = family_named("flux")
    denoiser = flux.build_tiny().transformer
    compile_denoiser(denoiser, flux)
    for block in denoiser.modules():
        hooked = _contiguous_outputs in block._forward_hooks.values()
        assert hooked == (type(block).__name__ == "FluxSingleTransformerBlock"), type(block).__name__
    compile_denoiser(denoiser, flux)  # compiled again (a rebuilt engine): still one hook a block
    assert sum(_contiguous_outputs in b._forward_hooks.values() for b in denoiser.modules()) == \
        len(denoiser.single_transformer_blocks)
    for batch in (2, 1):  # a batch of one: the slice "is contiguous" to torch, but not in its batch stride
        joined = torch.randn(batch, 7, 4)
        text, image = joined[:, :3], joined[:, 3:]
        assert image.stride()[0] == 28
        out = _contiguous_outputs(None, (), (text, image))
        assert [t.stride() for t in out] == [(12, 4, 1), (16, 4, 1)], batch  # what a fresh tensor has
        assert torch.equal(out[0], text) and torch.equal(out[1], image)
    fresh = torch.randn(1, 4, 4)
    assert _contiguous_outputs(None, (), fresh) is fresh  # nothing copied when nothing differs


RECOGNISE_FLUX = """
import sys
import diffusers
diffusers.FluxPipeline, diffusers.FluxImg2ImgPipeline  # what loading the model imports anyway
before = set(sys.modules)
from hotlora.families import family_of_class, family_of_model_index
flux = family_of_model_index({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]})
variant = family_of_class(diffusers.FluxImg2ImgPipeline)
print(flux.name, variant.name, sorted(m for m in set(sys.modules) - before if m.startswith("diffusers.pipelines")))
"""


def test_recognising_a_model_imports_no_other_familys_pipeline():
    """Each family's pipeline module imports its models (transformers' too): recognising a Flux model
    at start-up, in the server and in the engine process, must not import the other families'."""
    done = subprocess.run([sys.executable, "-c", RECOGNISE_FLUX], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["flux", "flux", "[]"]
