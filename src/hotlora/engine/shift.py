"""A request's scheduler shift: the timestep shift a flow-matching model samples with, set per request
(or declared by an adapter: a step-distilled LoRA is trained at its own shift, lightx2v's Wan LoRAs at
5.0 where the model's default is 3.0).

The shift lives in the scheduler's config, and diffusers reads it when the scheduler is made
(``FlowMatchEulerDiscreteScheduler``'s ``shift``, ``UniPCMultistepScheduler``'s ``flow_shift`` with
``use_flow_sigmas``): a run at another shift gets a scheduler of its own, made from the model's config
with only that value changed (``from_config``: what a diffusers user writes to change it), put on the
pipeline for the run and the model's own put back after it. Nothing compiled sees it: the timesteps
reach the denoiser as tensor values, so no graph depends on them. Schedulers that shift by the
image's size (``use_dynamic_shifting``: Flux, Qwen-Image) or not at all have no shift to set.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

MAX_SHIFT = 100.0  # published flow shifts are 1-17; past this every step is the first


def static_shift_key(scheduler) -> str | None:
    """The config key of ``scheduler``'s fixed timestep shift, or None where it has none to set."""
    config = getattr(scheduler, "config", None) or {}
    if config.get("use_dynamic_shifting"):
        return None
    if "flow_shift" in config and config.get("use_flow_sigmas"):
        return "flow_shift"
    if "shift" in config and "use_dynamic_shifting" in config:  # the flow-matching schedulers' own key
        return "shift"
    return None


def shift_problems(shift, key: str | None, scheduler_name: str) -> list[str]:
    """What is wrong with a request's ``shift`` on a model whose scheduler's shift key is ``key``."""
    if shift is None:
        return []
    if key is None:
        return [f"shift is not taken by this model: its scheduler ({scheduler_name}) has no fixed timestep "
                "shift to set (it shifts by image size, or not at all)"]
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) \
            or not 0 < shift <= MAX_SHIFT:
        return [f"shift must be a number in (0, {MAX_SHIFT:g}]"]
    return []


@contextmanager
def shifted(pipeline, shift: float | None):
    """``pipeline`` with a scheduler at ``shift`` for the block (None: the model's own, untouched)."""
    if shift is None:
        yield
        return
    own = pipeline.scheduler
    key = static_shift_key(own)
    if key is None:  # RequestRules refuses such a request before it gets here
        raise ValueError(f"{type(own).__name__} has no fixed shift to set")
    pipeline.scheduler = type(own).from_config(own.config, **{key: float(shift)})
    try:
        yield
    finally:
        pipeline.scheduler = own
