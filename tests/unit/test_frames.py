"""Video families' frame counts: a request's ``num_frames`` is checked against the VAE's tk + 1 rule
(Wan's 4k + 1, LTX's 8k + 1)
and the counts a compiled engine warmed up, before anything reaches the model; image families take
no ``num_frames``. Rules only: no model is built."""

import pytest

from hotlora.engine.request import RequestRules, UnservedShape
from hotlora.errors import InvalidRequest
from hotlora.families import REGISTERED, family_named, family_of_class
from hotlora.settings import RequestLimits

from ..helpers import served_frames

VIDEO = [f.name for f in REGISTERED if f.video]


def served(name) -> tuple[int, int]:
    return served_frames(family_named(name))


def video_rules(name, frames=None, sizes_only=True) -> RequestRules:
    family = family_named(name)
    return RequestRules(family, family.defaults, RequestLimits(), ((16, 16),), 16, sizes_only=sizes_only,
                        frames=tuple(frames or served(name)))


@pytest.mark.parametrize("name", VIDEO)
def test_a_frame_count_off_the_tk_plus_1_rule_is_refused_naming_it(name):
    rules = video_rules(name)
    t = rules.family.frame_multiple
    for bad in (t + 2, 2 * t, 2, 20 * t):
        with pytest.raises(InvalidRequest, match=rf"num_frames must be {t}k \+ 1") as info:
            rules.check("a cat", num_frames=bad)
        assert not isinstance(info.value, UnservedShape), "a count the VAE cannot make is the request's mistake"
        assert f"got {bad}" in str(info.value)
    for bad in (0, -3, 4.0, True, "5"):
        with pytest.raises(InvalidRequest, match="num_frames must be a positive integer"):
            rules.check("a cat", num_frames=bad)


@pytest.mark.parametrize("name", VIDEO)
def test_served_frame_counts_and_the_default(name):
    rules = video_rules(name)
    first, second = served(name)
    third = 3 * rules.family.frame_multiple + 1
    assert rules.check("a cat").num_frames == first  # the first served count
    assert rules.check("a cat", num_frames=second).num_frames == second
    assert rules.check("a cat", num_frames=second).pipeline_kwargs(rules.family)["num_frames"] == second
    # A valid count that was never warmed up would compile: unserved, listing what is.
    with pytest.raises(UnservedShape, match=f"{third} frames is not served .* served frame counts: {first}, {second}"):
        rules.check("a cat", num_frames=third)
    # An eager engine compiles nothing: any valid count.
    assert video_rules(name, sizes_only=False).check("a cat", num_frames=third).num_frames == third
    # Frames are part of the work bound.
    with pytest.raises(InvalidRequest, match="frames"):
        RequestRules(rules.family, rules.family.defaults, RequestLimits(max_work=16 * 16 * 4 * (second - 1)),
                     ((16, 16),), 16, sizes_only=True, frames=(second,)).check("a cat", steps=4)


def test_an_image_family_takes_no_num_frames():
    family = family_named("flux")
    rules = RequestRules(family, family.defaults, RequestLimits(), ((64, 64),), 16, sizes_only=True)
    assert rules.check("a cat").num_frames is None
    assert "num_frames" not in rules.check("a cat").pipeline_kwargs(family)
    with pytest.raises(InvalidRequest, match="num_frames not taken by the flux family"):
        rules.check("a cat", num_frames=5)


def test_wan_is_served_and_its_experts_are_no_text_encoders():
    import diffusers

    wan = family_named("wan")
    assert family_of_class(diffusers.WanPipeline) is wan
    # The mixin's loadable modules are transformer and transformer_2 (Wan 2.2's second expert).
    assert wan.lora_mixin._lora_loadable_modules == ["transformer", "transformer_2"]
    assert wan.denoiser == "transformer" and wan.lora_text_encoders == () and wan.text_encoders == ()
    assert "num_frames" in wan.request_options() and wan.defaults["num_frames"] == 81
    # Image-to-video checkpoints are served, with that task alone; the other pipelines sharing the mixin
    # and the denoiser class (video-to-video, VACE) are not claimed.
    assert wan.matches(diffusers.WanImageToVideoPipeline) == 1
    assert wan.conditioned_checkpoints == {"WanImageToVideoPipeline": "image-to-video"}
    assert wan.matches(diffusers.WanVideoToVideoPipeline) == 0 and wan.matches(diffusers.WanVACEPipeline) == 0


def test_a_two_expert_wan_has_both_experts_and_warms_up_on_both_sides_of_its_boundary():
    """Wan 2.2 A14B: both transformers get slots and a compile (``experts``); warm-up runs enough
    steps that each is called (``__call__`` switches at boundary_ratio x 1000). A transformer_2
    without a boundary is never called, so it is no expert."""
    from diffusers import WanPipeline

    wan = family_named("wan")
    one = wan.build_tiny()
    assert list(wan.experts(one)) == ["transformer"] and wan.warmup_steps(one, 2) == 2
    two = wan.build_tiny_variant("two-experts")
    assert list(wan.experts(two)) == ["transformer", "transformer_2"] and two.config.boundary_ratio == 0.875
    steps = wan.warmup_steps(two, 2)
    two.scheduler.set_timesteps(steps)
    boundary = 0.875 * two.scheduler.config.num_train_timesteps
    assert {bool(t >= boundary) for t in two.scheduler.timesteps} == {True, False}
    unbounded = WanPipeline(**{**one.components, "transformer_2": two.transformer_2})
    assert list(wan.experts(unbounded)) == ["transformer"]
    with pytest.raises(ValueError, match="no tiny variant 'other'"):
        wan.build_tiny_variant("other")


def test_videos_are_finished_as_frames():
    """The frames output kind: "pil" one list of PIL frames per video, "uint8" one (B, T, H, W, C)
    tensor that ``pil_images`` (the engine process's other side) turns into the same frames, both
    from the pixels diffusers' own video post-processing gives."""
    import numpy as np
    import torch
    from diffusers.video_processor import VideoProcessor

    from hotlora.engine.results import FRAMES, IMAGES, output_kind, pil_images

    assert output_kind(family_named("wan")) is FRAMES and output_kind(family_named("flux")) is IMAGES
    assert (FRAMES.attribute, FRAMES.per_prompt) == ("frames", "num_videos_per_prompt")
    processor = VideoProcessor(vae_scale_factor=8)
    decoded = torch.rand(2, 3, 5, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1  # (B, C, T, H, W)
    pt = processor.postprocess_video(decoded, output_type="pt")  # what the pipeline is asked for
    pipeline = type("Pipeline", (), {"video_processor": processor})()
    assert FRAMES.pipeline_output_type("pil") == "pt" and FRAMES.pipeline_output_type("latent") == "latent"
    videos = FRAMES.finish(pipeline, FRAMES.join([pt[:1], pt[1:]]), "pil")
    theirs = processor.postprocess_video(decoded, output_type="pil")
    assert [len(v) for v in videos] == [5, 5] and videos[0][0].size == (24, 16)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for v, w in zip(videos, theirs) for a, b in zip(v, w))
    shipped = FRAMES.finish(pipeline, pt, "uint8")
    assert shipped.dtype == torch.uint8 and tuple(shipped.shape) == (2, 5, 16, 24, 3)
    again = pil_images(shipped)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for v, w in zip(again, videos) for a, b in zip(v, w))


def test_a_two_expert_model_refuses_at_start_up_what_only_one_transformer_is_built_for():
    """Only slots are built on two experts: fused, auto and mixed batches are refused by name,
    before anything is quantized or installed; a step cache is not (test_step_cache.py)."""
    from hotlora.engine.warm import check_expert_config
    from hotlora.families import UnservedModel
    from hotlora.settings import EngineConfig, StepCache

    experts = {"transformer": None, "transformer_2": None}
    check_expert_config(EngineConfig(), experts)
    for options, said in (({"adapter_mode": "fused"}, "adapter_mode='fused'"), ({"adapter_mode": "auto"}, "'auto'"),
                          ({"mixed": True}, r"mixed batches \(mixed=True\)")):
        with pytest.raises(UnservedModel, match=said + r" is not served on a model of several experts \(transformer, "):
            check_expert_config(EngineConfig(**options), experts)
    check_expert_config(EngineConfig(step_cache=StepCache("dbcache", 0.3)), experts)  # cache-dit caches each expert


def test_a_pair_adapter_holds_each_experts_lora_as_diffusers_converts_it(tmp_path):
    """One file with ``transformer.`` and ``transformer_2.`` keys: the second expert's modules are
    named ``transformer_2.<module>``, each part with the alpha/r its own metadata gives (what
    ``load_lora_weights(..., load_into_transformer_2=True)`` reads from a file of its own); a file of
    the low-noise expert alone has no first-expert modules; export writes the pair back as one file."""
    import torch

    from hotlora.adapters.format.convert import load_adapter
    from hotlora.adapters.format.export import save_as_diffusers
    from hotlora.tiny import write_expert_samples

    wan = family_named("wan")
    samples = write_expert_samples(wan.build_tiny_variant("two-experts"), "wan", tmp_path, low=2, high=8)
    high, low = load_adapter(samples["experts-high"], wan), load_adapter(samples["experts-low"], wan)
    pair, low_only = load_adapter(samples["experts-pair"], wan), load_adapter(samples["experts-low-only"], wan)
    assert set(pair.modules) == set(high.modules) | {f"transformer_2.{m}" for m in low.modules}
    assert set(low_only.modules) == {f"transformer_2.{m}" for m in low.modules} and not pair.skipped_keys
    for module, w in low.modules.items():
        assert w.scaling == 2.0 and pair.modules[f"transformer_2.{module}"].scaling == 2.0  # alpha 4 / r 2
        assert torch.equal(pair.modules[f"transformer_2.{module}"].up, w.up)
    assert {w.scaling for w in high.modules.values()} == {0.5}
    again = load_adapter(save_as_diffusers(pair, tmp_path / "exported"), wan)
    assert set(again.modules) == set(pair.modules)
    for module, w in pair.modules.items():
        torch.testing.assert_close(again.modules[module].up * again.modules[module].scaling, w.up * w.scaling)


def test_the_memory_plan_of_a_two_expert_model_holds_both_experts_and_their_slots(tmp_path):
    """Wan 2.2 A14B holds two transformers (one runs at a time): the plan counts both, each with
    its slots, as the engine installs them."""
    from hotlora.engine.plan.planner import plan_memory
    from hotlora.tiny import save_tiny_model

    plans = {variant: plan_memory(str(save_tiny_model(tmp_path / str(variant), "wan", variant=variant))).as_dict()
             for variant in (None, "two-experts")}
    one, two = ({p["name"]: p["bytes"] for p in plans[v]["parts"]} for v in (None, "two-experts"))
    assert "transformer_2" not in one and two["transformer_2"] == two["transformer"] == one["transformer"]
    assert two["slots (LoRA buffers)"] == 2 * one["slots (LoRA buffers)"]


def test_two_expert_files_become_one_pair_adapter_from_the_command_line(tmp_path, monkeypatch):
    """``hotlora adapters convert HIGH OUT --low-noise LOW --family wan``: the two files diffusers
    loads apart (the second with load_into_transformer_2=True) written as one adapter, the same as
    a pair file holding both experts' keys; a pair of families without a second expert is refused."""
    import torch

    from hotlora.adapters.format.convert import load_adapter
    from hotlora.adapters.format.export import pair_experts
    from hotlora.cli import main
    from hotlora.errors import AdapterFormatError
    from hotlora.tiny import write_expert_samples

    wan = family_named("wan")
    samples = write_expert_samples(wan.build_tiny_variant("two-experts"), "wan", tmp_path / "samples", low=2, high=8)
    monkeypatch.chdir(tmp_path)
    assert main(["adapters", "convert", str(samples["experts-high"]), str(tmp_path / "out"), "--family", "wan",
                 "--low-noise", str(samples["experts-low"]), "--cache-dir", str(tmp_path / "cache")]) == 0
    made = load_adapter(tmp_path / "out" / "pytorch_lora_weights.safetensors", wan)
    pair = load_adapter(samples["experts-pair"], wan)
    assert set(made.modules) == set(pair.modules)
    for module, w in pair.modules.items():
        torch.testing.assert_close(made.modules[module].up * made.modules[module].scaling, w.up * w.scaling)
        torch.testing.assert_close(made.modules[module].down, w.down)
    high = load_adapter(samples["experts-high"], wan)
    with pytest.raises(AdapterFormatError, match="not one expert's LoRA"):
        pair_experts(high, pair)
    flux = family_named("flux")
    flux_lora = load_adapter({"transformer.x_embedder.lora_A.weight": torch.ones(1, 4),
                              "transformer.x_embedder.lora_B.weight": torch.ones(4, 1)}, flux)
    with pytest.raises(AdapterFormatError, match="a second expert"):
        pair_experts(flux_lora, flux_lora)
