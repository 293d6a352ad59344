"""``RequestRules.check`` bounds the image an engine that serves any size may be asked for."""

import pytest

from hotlora.settings import RequestLimits
from hotlora.engine.request import RequestRules, UnservedShape
from hotlora.errors import InvalidRequest, RequestTooLarge
from hotlora.families import family_named

DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 3.5}


def rules(sizes=((1024, 1024),), sizes_only=False, size_policy="refuse", **limits) -> RequestRules:
    return RequestRules(family_named("flux"), DEFAULTS, RequestLimits(**limits), tuple(sizes), 16, sizes_only=sizes_only,
                        size_policy=size_policy)


def test_an_eager_engine_with_no_sizes_refuses_a_huge_image():
    eager = rules()
    with pytest.raises(RequestTooLarge, match=r"4096x4096 .* 16,777,216 pixels; .* at most 4,194,304 \(max_pixels\)"):
        eager.check("a cat", num_images=1, steps=1, height=4096, width=4096)
    assert issubclass(RequestTooLarge, InvalidRequest)  # 413, the request's fault: the engine stays warm
    with pytest.raises(RequestTooLarge, match="max_pixels"):
        eager.check("a cat", steps=1, height=2048, width=4096)
    # Up to the bound, any multiple is served, at any aspect ratio.
    assert eager.check("a cat", steps=1, height=2048, width=2048).size == "2048x2048"
    assert eager.check("a cat", steps=1, height=1024, width=4096).size == "4096x1024"
    assert eager.check("a cat", steps=1, height=512, width=768).size == "768x512"


def test_the_bound_is_configurable_and_configured_sizes_are_served_whatever_their_area():
    small = rules(max_pixels=512 * 512)
    with pytest.raises(RequestTooLarge, match="262,144"):
        small.check("a cat", steps=1, height=512, width=528)
    assert small.check("a cat", steps=1).size == "1024x1024"  # the engine's own default size
    assert small.check("a cat", steps=1, height=512, width=512).size == "512x512"
    # A sizes-only engine serves exactly what it was configured with; other sizes are unserved
    # (or snapped to a served one), never bounded by area.
    served = rules(sizes=((1024, 1024), (2048, 4096)), sizes_only=True, max_pixels=512 * 512)
    assert served.check("a cat", steps=1, height=2048, width=4096).size == "4096x2048"
    with pytest.raises(UnservedShape):
        served.check("a cat", steps=1, height=4096, width=4096)
    nearest = rules(sizes=((1024, 1024),), sizes_only=True, size_policy="nearest", max_pixels=512 * 512)
    assert nearest.check("a cat", steps=1, height=4096, width=4096).size == "1024x1024"


def test_the_work_bound_still_applies_below_the_pixel_bound():
    eager = rules(max_work=2048 * 2048 * 10)
    assert eager.check("a cat", steps=10, height=2048, width=2048).size == "2048x2048"
    with pytest.raises(RequestTooLarge, match="pixel-steps"):
        eager.check("a cat", steps=11, height=2048, width=2048)


def test_the_second_experts_guidance_is_taken_by_a_model_of_two_experts_only():
    wan = family_named("wan")
    defaults = {"num_inference_steps": 4, "guidance_scale": 5.0, "num_frames": 5}

    def wan_rules(experts):
        return RequestRules(wan, defaults, RequestLimits(), ((16, 16),), 16, sizes_only=True, experts=experts)

    two = wan_rules(2)
    assert "guidance_scale_2" in two.options() and "guidance_scale_2" not in wan_rules(1).options()
    params = two.check("a cat", guidance=5.0, guidance_scale_2=3.0)
    assert params.guidance_scale_2 == 3.0 and params.pipeline_kwargs(wan)["guidance_scale_2"] == 3.0
    assert "guidance_scale_2" not in two.check("a cat").pipeline_kwargs(wan)  # the pipeline's own default
    assert two.check("a cat", guidance=5.0, guidance_scale_2=1.0).guidance_scale_2 == 1.0  # low-noise unguided
    assert params != two.check("a cat", guidance=5.0, guidance_scale_2=4.0)  # another forward batch
    with pytest.raises(InvalidRequest, match="guidance_scale_2 is taken by a model of two experts"):
        wan_rules(1).check("a cat", guidance_scale_2=3.0)
    for bad in (float("nan"), -1.0, 51.0, True):
        with pytest.raises(InvalidRequest, match="guidance_scale_2 must be a finite number in 0..50"):
            two.check("a cat", guidance_scale_2=bad)
    # WanPipeline guides neither expert at guidance_scale <= 1: a guided low-noise stage would be ignored.
    with pytest.raises(InvalidRequest, match="guidance_scale_2 4 needs guidance_scale above 1 .got 1."):
        two.check("a cat", guidance=1.0, guidance_scale_2=4.0)


def test_a_shift_is_taken_where_the_scheduler_has_a_fixed_one():
    fixed = RequestRules(family_named("flux"), DEFAULTS, RequestLimits(), ((1024, 1024),), 16, sizes_only=False,
                         shift_key="shift", scheduler="FlowMatchEulerDiscreteScheduler")
    assert "shift" in fixed.options() and fixed.check("a cat", shift=5).shift == 5.0
    assert fixed.check("a cat").shift is None and "shift" not in fixed.check("a cat", shift=5).pipeline_kwargs(
        family_named("flux"))  # the runner sets the scheduler; the pipeline takes no shift
    for bad in (0, -1.0, float("inf"), 101.0, True):
        with pytest.raises(InvalidRequest, match=r"shift must be a number in \(0, 100\]"):
            fixed.check("a cat", shift=bad)
    dynamic = RequestRules(family_named("flux"), DEFAULTS, RequestLimits(), ((1024, 1024),), 16, sizes_only=False,
                           scheduler="FlowMatchEulerDiscreteScheduler")
    assert "shift" not in dynamic.options()
    with pytest.raises(InvalidRequest, match=r"shift is not taken by this model: its scheduler "
                                             r"\(FlowMatchEulerDiscreteScheduler\) has no fixed timestep shift"):
        dynamic.check("a cat", shift=5.0)
