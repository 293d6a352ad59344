"""The chunk size chosen by measurement (batch_size="auto"): deterministic given the timings (a fake
timer here), explicit sizes kept, and outputs unchanged by the choice (per-image seeds make chunking
exact). Eager engines: the choice is made the same way with or without compile."""

import pytest
import torch

from hotlora import Engine
from hotlora.engine import warmup

from ..helpers import TARGET_RANK


def test_the_choice_is_the_best_time_per_image_and_ties_go_to_the_larger_chunk():
    assert warmup.choose({1: 10.0, 2: 6.0, 3: 7.5}) == 2
    assert warmup.choose({1: 5.0, 3: 5.0, 6: 5.0}) == 6
    assert warmup.candidates(6) == [1, 3, 5, 6] and warmup.candidates(1) == [1] and warmup.candidates(2) == [1, 2]


@pytest.fixture
def fake_timer(monkeypatch):
    """Each timed run "takes" a time from ``per_batch`` (seconds for the whole batch), read off the batch
    the pipeline is asked for: the measurement decides, not this machine's load."""
    per_batch = {1: 0.010, 2: 0.012, 3: 0.030, 4: 0.050}  # batch 2 is the fastest per image (6 ms)
    ticks = {"t": 0.0}
    real_run = warmup._run

    def run(engine, batch, *args):
        real_run(engine, batch, *args)
        ticks["t"] += per_batch[batch]

    monkeypatch.setattr(warmup, "_run", run)
    monkeypatch.setattr(warmup, "clock", lambda: ticks["t"])
    return per_batch


def test_auto_measures_each_size_and_cfg_mode_and_changes_no_pixel(tiny_models, fake_timer):
    auto = Engine.from_pretrained(tiny_models["sdxl"], target_rank=TARGET_RANK, compile=False, batch_size="auto",
                                  max_batch_size=4)
    size = f"{auto.width}x{auto.height}"
    assert set(auto.chunks) == {size, size + "+cfg"}
    for measured in auto.chunks.values():
        assert measured["chosen"] == 2
        assert measured["ms_per_image"] == {1: 10.0, 2: 6.0, 3: 10.0, 4: 12.5}
    assert auto.batch_size == 4 and auto.describe()["chunks"] == auto.chunks
    fixed = Engine.from_pretrained(tiny_models["sdxl"], target_rank=TARGET_RANK, compile=False, batch_size=4)
    assert fixed.chunks == {} and fixed.batch_size == 4  # an explicit size is kept, nothing measured
    for guidance in (5.0, 1.0):  # with and without CFG
        a = auto.generate("a cat", num_images=5, num_inference_steps=2, guidance_scale=guidance, output_type="latent")
        b = fixed.generate("a cat", num_images=5, num_inference_steps=2, guidance_scale=guidance, output_type="latent")
        assert (len(a.timings.generate_ms), len(b.timings.generate_ms)) == (3, 2)  # chunks 2+2+1 vs 4+1
        torch.testing.assert_close(a.images, b.images, atol=1e-5, rtol=0)  # the same images
