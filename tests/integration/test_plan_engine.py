"""The memory plan counts what the engine really holds: every part of a plan of a tiny model
equals the bytes the warm engine built from the same folder and settings reports."""

import pytest

from hotlora import Engine
from hotlora.settings import EngineConfig
from hotlora.engine.plan import plan_memory
from hotlora.engine.quantize import weight_bytes


@pytest.mark.parametrize("family,options", [
    ("flux", {"target_rank": 8}),
    ("flux", {"target_rank": 4, "adapter_mode": "fused"}),
    ("flux", {"target_rank": 4, "mixed": True}),
    ("flux", {"target_rank": 4, "base_quantization": "int8_weight_only"}),
    ("sdxl", {"target_rank": 8}),
])
def test_plan_equals_what_the_engine_holds(tiny_models, family, options):
    settings = dict(compile=False, batch_size=1, **options)
    plan = plan_memory(str(tiny_models[family]), EngineConfig(**settings), budget=2**40, device="cpu")
    parts = {p.name: p.bytes for p in plan.parts}
    engine = Engine.from_pretrained(tiny_models[family], **settings)
    described = engine.describe()
    assert parts[engine.family.denoiser] == engine.denoiser_bytes
    for component in ("text_encoder", "text_encoder_2", "vae"):  # the text encoders with their reserved rows
        assert parts[component] == weight_bytes(getattr(engine.pipeline, component)), component
    if options.get("adapter_mode") == "fused":
        assert parts["fused pristine copy"] == described["pristine_bytes"] > 0
    else:
        writer = "banks" if options.get("mixed") else "slots"
        assert parts[f"{writer} (LoRA buffers)"] == described["slot_bytes"] > 0
    # Text-encoder LoRA runs unfused: no pristine copy, its recent factors up to the writer's bound.
    text_bounds = {k: v for k, v in parts.items() if k.endswith("LoRA factors (bound)")}
    assert text_bounds == {f"{te} LoRA factors (bound)": type(w).PLAN_CACHE_BYTES for te, w in engine.text.lora.items()}
    assert text_bounds and not any(k.endswith("pristine copy") and k != "fused pristine copy" for k in parts)
    assert plan.fits is True


def test_a_hub_id_is_planned_from_the_local_cache(tiny_models, tmp_path, monkeypatch):
    """A Hub id whose snapshot is in the local Hugging Face cache plans like the folder (no network)."""
    import shutil

    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-flux"
    shutil.copytree(tiny_models["flux"], repo / "snapshots" / commit, ignore=shutil.ignore_patterns("*.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = EngineConfig(target_rank=8)
    from_cache = plan_memory("someone/tiny-flux", config, budget=2**40, device="cpu")
    from_folder = plan_memory(str(tiny_models["flux"]), config, budget=2**40, device="cpu")
    assert [(p.name, p.bytes) for p in from_cache.parts] == [(p.name, p.bytes) for p in from_folder.parts]
    assert from_cache.model == "someone/tiny-flux"


def test_built_in_sdxl_reads_published_configs_by_their_class(tiny_models, monkeypatch):
    """``hotlora plan sdxl`` takes hotlora.fullsize.sdxl's configs, each placed by the class it names
    (here the tiny SDXL's configs stand in for the published ones)."""
    import json
    import sys
    import types

    folder = tiny_models["sdxl"]
    module = types.ModuleType("hotlora.fullsize.sdxl")
    for attribute, component in (("UNET", "unet"), ("VAE", "vae"), ("CLIP_L", "text_encoder"),
                                 ("CLIP_G", "text_encoder_2")):
        setattr(module, attribute, json.loads((folder / component / "config.json").read_text()))
    monkeypatch.setitem(sys.modules, "hotlora.fullsize.sdxl", module)
    config = EngineConfig(target_rank=8)
    built_in = plan_memory("sdxl", config, budget=2**40, device="cpu")
    from_folder = plan_memory(str(folder), config, budget=2**40, device="cpu")
    assert built_in.family == "sdxl"
    # The text encoders differ only by the reserved rows: the folder's tokenizers are real, the
    # built-in's stand-ins start at the config's vocabulary size.
    same = {"unet", "vae", "slots (LoRA buffers)", "process runtime"}
    assert [(p.name, p.bytes) for p in built_in.parts if p.name in same] == \
           [(p.name, p.bytes) for p in from_folder.parts if p.name in same]
