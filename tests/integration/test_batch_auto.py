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

    def run(engine, batch, *args, **keywords):
        real_run(engine, batch, *args, **keywords)
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


@pytest.fixture
def counted_timer(fake_timer, monkeypatch):
    """The fake timer, counting every reading: a start that reuses a saved measurement reads it never."""
    readings = {"n": 0}
    timer = warmup.clock

    def clock():
        readings["n"] += 1
        return timer()

    monkeypatch.setattr(warmup, "clock", clock)
    return readings


def _auto(model_dir, cache, **options):
    options = {"target_rank": TARGET_RANK, "compile": False, "batch_size": "auto", "max_batch_size": 4, **options}
    return Engine.from_pretrained(model_dir, compile_cache_dir=cache, **options)


def test_a_restart_reuses_the_saved_measurement_and_a_new_key_measures_again(tiny_models, counted_timer, tmp_path):
    cache = tmp_path / "compile"
    first = _auto(tiny_models["sdxl"], cache)
    assert counted_timer["n"] > 0 and len(list(cache.glob("chunks-*.json"))) == 1
    counted_timer["n"] = 0
    again = _auto(tiny_models["sdxl"], cache)
    assert counted_timer["n"] == 0  # nothing timed
    assert again.chunks == first.chunks and {m["chosen"] for m in again.chunks.values()} == {2}
    changed = _auto(tiny_models["sdxl"], cache, max_batch_size=3)  # other graphs: another key
    assert counted_timer["n"] > 0 and len(list(cache.glob("chunks-*.json"))) == 2
    assert set(changed.chunks) == set(first.chunks)


@pytest.mark.parametrize("damage", ["cut short", "garbage", "foreign choice", "writable by others"])
def test_a_corrupt_or_untrusted_measurement_is_ignored(tiny_models, counted_timer, tmp_path, damage):
    import json

    from hotlora import durable

    cache = tmp_path / "compile"
    first = _auto(tiny_models["sdxl"], cache)
    (path,) = cache.glob("chunks-*.json")
    saved = json.loads(path.read_text())
    for entry in saved["chunks"].values():
        entry["chosen"] = 64 if damage == "foreign choice" else 1  # 64: a size this engine never compiled for
    if damage == "cut short":  # written in place and killed: the checksum no longer matches
        path.write_text(json.dumps(saved)[:40])
    elif damage == "garbage":  # whole, as its checksum says, but not a measurement
        durable.write_verified(path, b"{not json")
    else:
        durable.write_verified(path, json.dumps(saved).encode())
        if damage == "writable by others":
            path.chmod(0o666)
    counted_timer["n"] = 0
    again = _auto(tiny_models["sdxl"], cache)
    assert counted_timer["n"] > 0  # measured again
    assert again.chunks == first.chunks  # from the measurement, not the file


def test_the_measurement_stops_at_its_budget(tiny_models, fake_timer):
    # Each timed run "takes" 10-50 ms: a 25 ms budget stops after the first runs (the limit first).
    engine = Engine.from_pretrained(tiny_models["sdxl"], target_rank=TARGET_RANK, compile=False, batch_size="auto",
                                    max_batch_size=4, chunk_budget_s=0.025)
    measured = list(engine.chunks.values())
    assert all(m["bounded"] for m in measured)
    assert measured[0]["ms_per_image"] == {4: 12.5} and measured[0]["chosen"] == 4
    assert measured[1]["ms_per_image"] == {} and measured[1]["chosen"] == 4  # none timed: the compiled limit
