"""The generic family (hotlora.families.generic): what it claims follows its conventions and
behaves as declared on its tiny model (the CFG style is measured, not assumed); what it does not
claim is refused at start-up naming the pipeline and what it misses; explicit families win."""

import pytest

from hotlora.families import FAMILIES, REGISTERED, UnservedModel, family_of_class, family_of_model_index
from hotlora.families.generic import GENERIC, GENERIC_FAMILIES, Claim, GenericFamily, convention_problems

CLAIMED = [pytest.param(family, id=family.name) for family in GENERIC_FAMILIES]


def test_every_claim_is_registered_after_the_explicit_families():
    names = [family.name for family in REGISTERED]
    assert [claim.name for claim in GENERIC] == names[len(names) - len(GENERIC):]
    assert all(not family.generic for family in REGISTERED[:len(names) - len(GENERIC)])


@pytest.mark.parametrize("family", CLAIMED)
def test_a_claimed_pipeline_follows_the_conventions(family):
    import diffusers

    pipeline = getattr(diffusers, family.pipeline_class)
    assert convention_problems(pipeline) == []
    assert family_of_class(pipeline) is family and FAMILIES[family.name] is family
    assert family_of_model_index({"_class_name": family.pipeline_class,
                                  "transformer": ["diffusers", family.denoiser_class]}) is family
    assert family.denoiser == "transformer" and family.lora_text_encoders == ()
    assert family.mixed_batches is (family.claim.mixed or family.claim.mixed_same_texts) is family.describe()["mixed"]
    assert family.describe()["generic"] is True
    for name, value in family.call_arguments(1.0).items():  # every fixed argument is one __call__ takes
        assert name == "guidance_scale" or name in family._call_defaults, name


@pytest.mark.parametrize("family", CLAIMED)
def test_the_declared_cfg_style_is_what_the_tiny_pipeline_does(family, tmp_path):
    """The denoiser's calls per step and their batch, counted at the default guidance and at 1:
    "batch" doubles the batch above 1, "true" runs a second pass, "none" neither. The tiny model
    round-trips save_pretrained / from_pretrained offline and its denoiser is small."""
    import torch
    from diffusers import DiffusionPipeline

    family.build_tiny(0).save_pretrained(str(tmp_path))
    pipeline = DiffusionPipeline.from_pretrained(str(tmp_path), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    denoiser = getattr(pipeline, family.denoiser)
    assert sum(p.numel() for p in denoiser.parameters()) < 200_000
    batches, largest = [], []
    denoiser.register_forward_pre_hook(
        lambda m, args, kwargs: batches.append((args[0] if args else kwargs["hidden_states"]).shape[0]),
        with_kwargs=True)
    # A zero-initialised output layer makes every prediction zero and every adapter invisible.
    denoiser.register_forward_hook(lambda m, args, out: largest.append(float(out[0].abs().max())))
    steps, images = 2, 2
    for guidance in sorted({family.default_guidance, 1.0, family.claim.guides_above}):
        batches.clear()
        out = pipeline(prompt="a cat", num_images_per_prompt=images, num_inference_steps=steps,
                       height=family.tiny_size, width=family.tiny_size, output_type="latent",
                       generator=[torch.Generator().manual_seed(i) for i in range(images)],
                       **family.call_arguments(guidance)).images
        assert out.shape[0] == images
        doubled = family.doubles_batch(guidance)
        passes = 2 if family.cfg == "true" and guidance > family.claim.guides_above else 1
        assert batches == [images * (2 if doubled else 1)] * (steps * passes), (guidance, batches)
        assert family.batch_factor(guidance) == (2 if doubled else 1)
    assert min(largest) > 0
    # Regional compilation: the block classes (the claim's where the transformer declares none) are
    # the transformer's repeated blocks, and compile_denoiser compiles them, not the whole model.
    from hotlora.engine.pipeline import compile_denoiser

    declared = getattr(type(denoiser), "_repeated_blocks", None)
    assert bool(declared) != bool(family.repeated_blocks)  # a claim names them only where diffusers does not
    classes = family.repeated_blocks or tuple(declared)
    lists = [m for m in denoiser.children() if isinstance(m, torch.nn.ModuleList)]
    assert {type(block).__name__ for blocks in lists for block in blocks} == set(classes)
    assert compile_denoiser(denoiser, family) == f"regional ({', '.join(classes)})"


@pytest.mark.parametrize("pipeline, missing", [
    ("Lumina2Pipeline", "data-dependent caption lengths"),
    ("HiDreamImagePipeline", "MoE routing"),
    ("Ideogram4Pipeline", "second denoiser (unconditional_transformer)"),
    ("PRXPipeline", "loads into unet, text_encoder"),
    ("BriaFiboPipeline", "no text-encoder LoRA: text_encoder"),
    ("SanaSprintPipeline", "no tiny model of it is tested"),
    ("BriaFibo2Pipeline", "no tiny model of it is tested"),
    ("Kandinsky5T2IPipeline", "seven resolutions"),
    ("CogVideoXPipeline", "of no served video family"),
])
def test_an_unclaimed_pipeline_is_refused_naming_what_it_misses(pipeline, missing):
    import diffusers

    with pytest.raises(UnservedModel, match=f"{pipeline} is not a pipeline hotlora serves") as info:
        family_of_class(getattr(diffusers, pipeline))
    assert missing in str(info.value)


def test_an_explicit_family_wins_over_a_generic_claim(monkeypatch):
    """A generic claim of a pipeline an explicit family serves never shadows it."""
    import diffusers

    import hotlora.families as families

    shadow = GenericFamily(Claim(name="shadow", pipeline_class="FluxPipeline", cfg="none", latent_multiple=2,
                                 build_tiny=lambda seed: None))
    monkeypatch.setattr(families, "REGISTERED", (*families.REGISTERED, shadow))
    assert family_of_class(diffusers.FluxPipeline).name == "flux"


def test_variants_sharing_a_claimed_mixin_are_not_served_as_it():
    """SanaSprint shares Sana's mixin and denoiser but not its __call__: the generic family claims
    the pipeline it was tested on (and subclasses), never variants."""
    import diffusers

    sana = FAMILIES["sana"]
    assert sana.matches(diffusers.SanaSprintPipeline) == 0
    assert sana.matches(type("MySana", (diffusers.SanaPipeline,), {})) == 2


def test_mixed_batches_are_refused_at_start_up(tmp_path):
    from hotlora import Engine
    from hotlora.tiny import save_tiny_model

    family = GENERIC_FAMILIES[0]
    model = save_tiny_model(tmp_path / family.name, family.name)
    with pytest.raises(UnservedModel, match=f"{family.pipeline_class} .* does not serve mixed batches"):
        Engine.from_pretrained(model, compile=False, mixed=True)


def test_the_default_size_comes_from_call_or_the_model():
    """AuraFlow's __call__ says 1024; CogView4's says None: its transformer's sample_size times the VAE factor."""
    by_name = {family.pipeline_class: family for family in GENERIC_FAMILIES}
    if "AuraFlowPipeline" in by_name:
        assert by_name["AuraFlowPipeline"].pipeline_default_size(None) == (1024, 1024)
    if "CogView4Pipeline" in by_name:
        family = by_name["CogView4Pipeline"]
        pipeline = family.build_tiny(0)
        side = pipeline.transformer.config.sample_size * pipeline.vae_scale_factor
        assert family.pipeline_default_size(pipeline) == (side, side)


def test_a_generic_familys_model_is_planned_by_its_weights(tmp_path):
    """No activation workload is declared for a generic family: `hotlora plan` (and the server's
    start-up check) plans its weights and buffers and says the activations are not modelled."""
    from hotlora.engine.plan import plan_memory
    from hotlora.settings import EngineConfig
    from hotlora.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "auraflow", "auraflow")
    plan = plan_memory(str(model), EngineConfig(target_rank=4), device="cpu", budget=2**34)
    assert plan.family == "auraflow" and plan.peak_bytes > 0
    assert all(size.activation_bytes is None for size in plan.sizes)
    assert "not modelled" in plan.text()


def test_a_distilled_krea2_checkpoint_defaults_to_its_few_steps_without_guidance(tmp_path):
    """Krea 2's pipeline config says which checkpoint it is (``is_distilled``): the TDM one runs 8
    steps without guidance by default (its pipeline's docstring), the base one its __call__'s 28 at
    4.5; a model's hotlora.json still wins."""
    import json

    from hotlora import Engine
    from hotlora.families.krea2 import tiny_krea2

    tiny_krea2(0, distilled=True).save_pretrained(str(tmp_path / "turbo"))
    tiny_krea2(0).save_pretrained(str(tmp_path / "base"))
    assert json.loads((tmp_path / "turbo" / "model_index.json").read_text())["is_distilled"] is True
    def served_defaults(name):
        engine = Engine.from_pretrained(tmp_path / name, compile=False, target_rank=4, height=48, width=48,
                                        batch_size=1, rank_buckets=())
        return engine.describe()["defaults"]

    defaults = {name: served_defaults(name) for name in ("turbo", "base")}
    assert defaults == {"turbo": {"num_inference_steps": 8, "guidance_scale": 0.0},
                        "base": {"num_inference_steps": 28, "guidance_scale": 4.5}}
    (tmp_path / "turbo" / "hotlora.json").write_text(json.dumps({"num_inference_steps": 6}))
    assert served_defaults("turbo") == {"num_inference_steps": 6, "guidance_scale": 0.0}
