"""What is not served is said as such: a pipeline no family serves names what it lacks, a request
option its family does not take lists what it takes, and another family's LoRA is named."""

import json
import subprocess
import sys

import pytest

from hotlora.families import FAMILIES, UnservedModel, family_named, family_of_class, family_of_model_index
from hotlora.families.recognize import families_of_keys, families_of_metadata, foreign_note
from hotlora.families.vocabulary import denoiser_templates, vocabularies


@pytest.mark.parametrize("pipeline, reason", [
    ("CogVideoXPipeline", "video pipeline (CogVideoXLoraLoaderMixin) of no served video family (served: wan"),
    # LTX image-to-video: a task of the ltx family, not a checkpoint it serves.
    ("LTXImageToVideoPipeline", "runs it as its image-to-video task on a LTXPipeline checkpoint"),
    # Variants sharing a served family's LoRA mixin: named as such, with their denoiser.
    ("WanVACEPipeline", "shares the LoRA mixin WanLoraLoaderMixin of hotlora's wan family, which serves WanPipeline"),
    ("LTXConditionPipeline", "a variant with its own __call__ (denoiser: LTXVideoTransformer3DModel)"),
    ("DDPMPipeline", "no diffusers LoRA loader mixin"),
    ("QwenImage21ModularPipeline", "QwenImage21Pipeline, which hotlora serves"),  # the family's own words
])
def test_an_unserved_pipeline_names_what_it_lacks(pipeline, reason):
    import diffusers

    with pytest.raises(UnservedModel, match=f"{pipeline} is not a pipeline hotlora serves") as info:
        family_of_class(getattr(diffusers, pipeline))
    assert reason in str(info.value) and "hotlora families" in str(info.value)
    with pytest.raises(UnservedModel, match=reason.split(" (")[0]):
        family_of_model_index({"_class_name": pipeline})


def test_hotlora_families_lists_every_registered_family():
    done = subprocess.run([sys.executable, "-m", "hotlora.cli", "families", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    listed = {entry["family"]: entry for entry in json.loads(done.stdout)}
    assert set(listed) == set(FAMILIES)
    for name, entry in listed.items():
        family = family_named(name)
        assert entry["pipeline"] == family.pipeline_class and entry["cfg"] == family.cfg
        assert ("negative_prompt" in entry["request_options"]) == family.negative_prompts
        assert entry["defaults"]["num_inference_steps"] == family.default_steps
        assert entry["tasks"] == ["text-to-image", *family.task_pipelines]
    assert listed["wan"]["single_task_checkpoints"] == {"WanImageToVideoPipeline": "image-to-video"}
    assert "image-to-video" in listed["ltx"]["tasks"] and not listed["ltx"]["single_task_checkpoints"]


def test_request_options_a_family_does_not_take_are_refused_with_what_it_takes():
    from hotlora.engine.request import RequestLimits, RequestRules
    from hotlora.errors import InvalidRequest

    family = next(f for f in FAMILIES.values() if not f.negative_prompts)
    rules = RequestRules(family=family, defaults=family.defaults, limits=RequestLimits(), sizes=((64, 64),),
                         size_multiple=16, sizes_only=True)
    with pytest.raises(InvalidRequest, match=f"negative_prompt not taken by the {family.name} family") as info:
        rules.check("a cat", negative_prompt="blurry")
    assert f"it takes: {', '.join(family.request_options())}" in str(info.value)
    rules.check("a cat")  # without it: fine


SDXL_KEYS = ["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k.lora_down.weight",
             "unet.up_blocks.0.attentions.1.transformer_blocks.1.attn2.to_q.lora_A.weight"]
FLUX_KEYS = ["transformer.single_transformer_blocks.0.attn.to_k.lora_A.weight",
             "transformer.transformer_blocks.1.attn.add_q_proj.lora_B.weight",
             "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
             "double_blocks.0.processor.qkv_lora1.down.weight"]


def test_another_familys_lora_is_named():
    flux, sdxl = family_named("flux"), family_named("sdxl")
    assert sdxl in families_of_keys(SDXL_KEYS) and flux not in families_of_keys(SDXL_KEYS)
    assert flux in families_of_keys(FLUX_KEYS) and sdxl not in families_of_keys(FLUX_KEYS)
    note = foreign_note(flux, SDXL_KEYS)
    assert "looks like a LoRA for the sdxl" in note and "this engine serves the flux family" in note
    assert "looks like a LoRA for the flux" in foreign_note(sdxl, FLUX_KEYS)
    # Its own family's names: a damaged file of the served family, not a foreign one.
    assert foreign_note(flux, FLUX_KEYS) == ""
    # Trainers' metadata: kohya's base model version, sd-scripts' modelspec architecture.
    assert flux in families_of_metadata({"ss_base_model_version": "flux1"})
    assert sdxl in families_of_metadata({"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"})
    assert "its metadata names that base model" in foreign_note(flux, ["a.lora_A.weight"],
                                                              {"ss_base_model_version": "sdxl_base_v1-0"})
    assert "it declares base model 'stabilityai/stable-diffusion-xl-base-1.0'" in foreign_note(
        flux, ["a.lora_A.weight"], None, "stabilityai/stable-diffusion-xl-base-1.0")
    assert foreign_note(flux, ["something.else.lora_A.weight"]) == ""


@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.lora_key_pattern])
def test_each_familys_own_lora_keys_are_recognised_as_its_own(name):
    """A LoRA over every Linear of the family's tiny denoiser, keyed as diffusers saves it, is
    recognised as that family's (perhaps beside a family sharing its names: SD1.5 and SDXL's
    U-Net, Flux's and Chroma's blocks, Flux.2 and klein), so a wrong-family refusal names it."""
    import torch

    family = family_named(name)
    denoiser = getattr(family.build_tiny(), family.denoiser)
    keys = [f"{family.denoiser}.{module}.lora_A.weight" for module, layer in denoiser.named_modules()
            if isinstance(layer, torch.nn.Linear)]
    found = families_of_keys(keys)
    assert family in found and len(found) <= 3, [f.name for f in found]  # Flux.2 dev and klein: one denoiser class
    # The layer-name vocabulary kept in vocabulary.json is this tiny model's (python -m hotlora.families.vocabulary).
    assert vocabularies()[name] == frozenset(denoiser_templates(denoiser))


@pytest.mark.parametrize("served, modules, named, why", [
    # diffusers' training scripts' default, attention only: names several MMDiT families share, which
    # no family's key pattern claims; the set of them fits Flux's and Chroma's layers only.
    ("zimage", ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.3.attn.to_k"], "flux or chroma",
     "its layer names"),
    ("sd3", ["single_transformer_blocks.0.attn.to_v"], "flux", "its layer names"),
    ("flux", ["transformer_blocks.0.attn2.to_q"], "sd3", "keys such as"),  # SD3.5's second attention: its pattern
    ("qwenimage", ["layers.7.attention.to_out.0", "noise_refiner.0.attention.to_q"], "zimage", "keys such as"),
])
def test_a_foreign_attention_only_lora_is_named(served, modules, named, why):
    note = foreign_note(family_named(served), modules)
    assert f"looks like a LoRA for the {named}" in note and why in note, note
    assert f"this engine serves the {served} family" in note


def test_layer_names_the_served_model_has_name_no_other_family():
    """Beyond the served model's blocks or a narrowed ceiling, not a foreign file: nothing named."""
    assert foreign_note(family_named("chroma"), ["transformer_blocks.40.attn.to_q"]) == ""
    assert foreign_note(family_named("zimage"), ["transformer.layers.0.feed_forward.w1.lora_A.weight"]) == ""


@pytest.mark.parametrize("declared, expected", [
    ("Qwen/Qwen-Image-2.1", ["qwenimage21"]),  # not Qwen-Image too: its marker is part of 2.1's
    ("Qwen/Qwen-Image-2.1-Turbo", ["qwenimage21"]),
    ("Qwen/Qwen-Image-2512", ["qwenimage"]),  # a Qwen-Image 1.x checkpoint despite the "2"
    ("Qwen/Qwen-Image-Edit-2509", ["qwenimage"]),
    ("black-forest-labs/FLUX.2-dev", ["flux2"]),
    ("black-forest-labs/FLUX.1-dev", ["flux"]),
])
def test_a_declared_base_model_names_its_most_specific_family(declared, expected):
    assert [family.name for family in families_of_metadata(None, declared)] == expected


@pytest.mark.parametrize("family, checkpoint", [
    ("flux2-klein", "Flux2KleinKVPipeline"),  # no guidance_scale: a TypeError at warm-up before
    ("flux", "FluxFillPipeline"),
])
def test_a_variant_checkpoint_of_a_family_is_refused_at_start_up(family, checkpoint, tmp_path):
    """A model directory whose model_index.json names another pipeline sharing the family's LoRA mixin
    and denoiser class is refused before anything is installed or compiled, naming both pipelines."""
    from hotlora import Engine
    from hotlora.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", family)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": checkpoint}))
    assert family_of_model_index(model).name == family  # identified as the family's ...
    # (the loaded KV pipeline's config drops klein's is_distilled: the engine takes it for klein base)
    with pytest.raises(UnservedModel, match=f"{checkpoint} checkpoints are not served: the {family}\\S* family serves "
                                            f"{family_named(family).pipeline_class} checkpoints"):
        Engine.from_pretrained(model, compile=False)  # ... and refused as a checkpoint


def test_qwenimage_serves_text_to_image_from_its_edit_checkpoints_only():
    import diffusers

    family = family_named("qwenimage")
    edit = family.build_tiny_edit()
    assert type(family.text_to_image_pipeline(edit)).__name__ == "QwenImagePipeline"
    layered = diffusers.QwenImageLayeredPipeline.__new__(diffusers.QwenImageLayeredPipeline)
    with pytest.raises(UnservedModel, match="QwenImageLayeredPipeline checkpoints are not served: the qwenimage family"):
        family.text_to_image_pipeline(layered)
