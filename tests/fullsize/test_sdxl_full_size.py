"""The real SDXL architecture served end to end on the CPU (`make test-full`; not in `make test`).

What ``bench/full_size.py`` measures, asserted: ``hotlora serve`` (compiled, bfloat16, 256x256)
answers the no-adapter request, a kohya rank-32 LoRA on the U-Net and both text encoders and a
diffusers rank-128 LoRA, swapped and brought back, with 0 recompiles, the same bytes each time an
adapter comes back, and images as close to plain diffusers as plain diffusers' own dtype noise.

Needs ~12 GB of free memory (one full-size process at a time) and ~7 GB of disk under
``.cache/fullsize`` (the model, built on first use, kept across runs; HOTLORA_FULLSIZE_WORK moves
it). Keeps the inductor cache and compile artifacts of earlier runs (``--warm-caches``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fullsize, pytest.mark.timeout(4 * 3600)]

REPO = Path(__file__).resolve().parents[2]
# How much further from plain diffusers the server may be than plain diffusers is from itself in
# another dtype (both bfloat16 paths round differently from float32; inductor's fused kernels
# round differently again), with one 8-bit level of PNG quantization on top.
NOISE_FACTOR = 2.0
LEVEL = 1.0
# A dropped or wrong adapter must move the image far more than the tolerance, or the comparison
# could not tell: the adapters' effect on the reference is required to be this many tolerances.
EFFECT_MARGIN = 4.0


@pytest.fixture(scope="module")
def measured():
    from bench.full_size import parser, run

    work = Path(os.environ.get("HOTLORA_FULLSIZE_WORK", REPO / ".cache" / "fullsize"))
    return run(parser().parse_args(["--model", str(work / "sdxl"), "--work", str(work / "test"), "--no-warm",
                                    "--warm-caches"]))


def tolerance(result: dict, label: str) -> float:
    """The mean level difference allowed for a request: NOISE_FACTOR x the references' own noise."""
    noise = result["comparison"]["reference_noise"]["bfloat16_vs_float32"][label]["mean"]
    return NOISE_FACTOR * noise + LEVEL


def test_no_recompiles_across_swaps(measured):
    assert measured["sequence"] == ["none", "kohya", "diffusers", "kohya", "diffusers", "none"]
    assert measured["recompiles"] == 0


def test_same_bytes_when_an_adapter_comes_back(measured):
    assert measured["same_bytes_on_return"] == {"none": True, "kohya": True, "diffusers": True}


@pytest.mark.parametrize("label", ["none", "kohya", "diffusers"])
def test_equal_to_plain_diffusers_within_its_dtype_noise(measured, label):
    allowed = tolerance(measured, label)
    for dtype in ("bfloat16", "float32"):
        assert measured["comparison"]["server_vs"][dtype][label]["mean"] <= allowed, (dtype, measured["comparison"])


@pytest.mark.parametrize("label", ["kohya", "diffusers"])
def test_the_comparison_would_see_a_dropped_adapter(measured, label):
    effect = measured["comparison"]["adapter_effect"]["float32"][label]["mean"]
    assert effect >= EFFECT_MARGIN * tolerance(measured, label), measured["comparison"]
