import argparse

import pytest

from hotlora.cli import _parse_lora
from hotlora.engine.runner import chunk_sizes, image_generators
from hotlora.errors import AdapterRejected, EngineError, RequestError, SlotStateCorrupt
from hotlora.server.errors import status_of


def test_lora_argument_takes_the_scale_from_the_right():
    assert _parse_lora("identity=/a/b.safetensors:0.7") == ("identity", "/a/b.safetensors", 0.7)
    assert _parse_lora("style=C:/x/y.safetensors") == ("style", "C:/x/y.safetensors", 1.0)
    assert _parse_lora("style=plain") == ("style", "plain", 1.0)
    with pytest.raises(argparse.ArgumentTypeError):
        _parse_lora("no-equals-sign")


def test_chunks_are_full_except_the_last():
    assert chunk_sizes(6, 6) == [6]
    assert chunk_sizes(7, 3) == [3, 3, 1]
    assert chunk_sizes(2, 6) == [2]


def test_image_noise_depends_only_on_seed_and_index():
    a = [g.initial_seed() for g in image_generators(10, 0, 5)]
    b = [g.initial_seed() for g in image_generators(10, 3, 2)]
    assert a[3:] == b


def test_error_tree_splits_caller_faults_from_engine_faults():
    rejected = AdapterRejected("x.safetensors", ["rank 32 exceeds", "NaN in a.b"])
    assert isinstance(rejected, RequestError) and status_of(rejected) == 422
    assert "2 problem(s)" in str(rejected) and "NaN in a.b" in str(rejected)
    assert issubclass(SlotStateCorrupt, EngineError) and not issubclass(SlotStateCorrupt, RequestError)


def test_rank_buckets_come_from_flags_env_and_files(monkeypatch, tmp_path):
    from hotlora.settings import ServerConfig

    assert ServerConfig.load(rank_buckets="4, 8")[0].rank_buckets == (4, 8)
    monkeypatch.setenv("HOTLORA_RANK_BUCKETS", "2,16")
    assert ServerConfig.load()[0].rank_buckets == (2, 16)
    config_file = tmp_path / "serve.toml"
    config_file.write_text("[server]\nrank_buckets = [4]\n")
    monkeypatch.delenv("HOTLORA_RANK_BUCKETS")
    assert ServerConfig.load(config_file)[0].rank_buckets == (4,)
    with pytest.raises(ValueError, match="integers"):
        ServerConfig(rank_buckets="four")


def test_skipped_text_encoder_parts_are_reported_by_model_not_by_layer():
    from hotlora.adapters.format.convert import Adapter
    from hotlora.engine.guard import skipped

    keys = ["text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_A.weight",
            "text_encoder_2.text_model.encoder.layers.1.mlp.fc1.lora_A.weight",
            "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight",
            "lora_te3_encoder_block_1_layer_0_SelfAttention_q.lora_down.weight"]
    adapter = Adapter("a", "flux", "kohya", {}, "0" * 64, skipped_keys=keys)
    report = skipped(adapter)
    assert report["keys"] == 4 and report["parts"] == ["lora_te3", "text_encoder", "text_encoder_2"]
    assert skipped(Adapter("b", "flux", "diffusers", {}, "1" * 64)) is None
    # Text-encoder LoRA the engine runs without (text_encoder_lora=False) is reported; applied, it is not.
    import torch

    from hotlora.adapters.format.convert import LoraWeights

    weights = {"encoder.layers.0.mlp.fc1": LoraWeights(torch.zeros(2, 4), torch.zeros(4, 2), 1.0)}
    with_text = Adapter("c", "sdxl", "diffusers", {}, "2" * 64, text_modules={"text_encoder": weights})
    assert skipped(with_text) == {**skipped(with_text), "keys": 2, "parts": ["text_encoder"]}
    assert skipped(with_text, applied_text_encoders=("text_encoder",)) is None


def test_a_run_lays_its_requests_images_out_in_order_and_cuts_them_into_chunks():
    from hotlora.engine.runner import Part, plan_chunks

    assert plan_chunks([7], 3) == [(Part(request=0, start=0, count=3),), (Part(request=0, start=3, count=3),),
                                   (Part(request=0, start=6, count=1),)]
    assert [sum(p.count for p in chunk) for chunk in plan_chunks([7], 3)] == chunk_sizes(7, 3)
    assert plan_chunks([2, 3], 5) == [(Part(request=0, start=0, count=2), Part(request=1, start=0, count=3))]
    assert plan_chunks([2, 3], 4) == [(Part(request=0, start=0, count=2), Part(request=1, start=0, count=2)),
                                      (Part(request=1, start=2, count=1),)]
