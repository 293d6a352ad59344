"""A request's scheduler shift (``hotlora.engine.shift``): which schedulers have a fixed one to set,
and the scheduler a run gets at another shift, the model's own put back after it."""

import pytest
from diffusers import (
    EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler,
)

from hotlora.engine.shift import shifted, static_shift_key


def test_the_fixed_shift_key_is_read_from_the_schedulers_config():
    assert static_shift_key(FlowMatchEulerDiscreteScheduler(shift=3.0)) == "shift"  # SD3, Z-Image, tiny Wan
    assert static_shift_key(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) is None  # Flux, Qwen-Image
    assert static_shift_key(UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                                    flow_shift=3.0)) == "flow_shift"  # Wan's published scheduler
    assert static_shift_key(UniPCMultistepScheduler()) is None  # flow_shift unused without flow sigmas
    assert static_shift_key(EulerDiscreteScheduler()) is None  # SDXL, SD1.5


class Holder:
    """What ``shifted`` needs of a pipeline: a ``scheduler`` attribute."""

    def __init__(self, scheduler):
        self.scheduler = scheduler


@pytest.mark.parametrize("scheduler, key", [
    (FlowMatchEulerDiscreteScheduler(shift=3.0), "shift"),
    (UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0), "flow_shift"),
])
def test_a_run_at_another_shift_gets_a_scheduler_of_its_own(scheduler, key):
    pipeline = Holder(scheduler)
    own_sigmas = _sigmas(scheduler)
    with shifted(pipeline, 7.0):
        run = pipeline.scheduler
        assert run is not scheduler and type(run) is type(scheduler) and run.config[key] == 7.0
        assert {k: v for k, v in run.config.items() if k != key} == {k: v for k, v in scheduler.config.items() if k != key}
        assert _sigmas(run)[1] > own_sigmas[1]  # a stronger shift keeps more noise at the same step
    assert pipeline.scheduler is scheduler and scheduler.config[key] == 3.0
    with shifted(pipeline, None):
        assert pipeline.scheduler is scheduler
    with pytest.raises(RuntimeError), shifted(pipeline, 5.0):  # put back when the run fails too
        raise RuntimeError("the run failed")
    assert pipeline.scheduler is scheduler


def test_a_scheduler_without_a_fixed_shift_is_refused_not_silently_kept():
    with pytest.raises(ValueError, match="EulerDiscreteScheduler has no fixed shift"), \
            shifted(Holder(EulerDiscreteScheduler()), 5.0):
        pass


def _sigmas(scheduler):
    scheduler.set_timesteps(4)
    return [float(s) for s in scheduler.sigmas]
