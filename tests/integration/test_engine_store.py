"""The engine resolving references through the store; the adapters CLI."""

import json
import shutil

import pytest
import torch

from hotlora import Engine
from hotlora.families import family_named
from hotlora.adapters.format.convert import load_adapter
from hotlora.cli import main
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterRejected

from ..helpers import canonical_deltas, fresh_pipeline, loaded_deltas


@pytest.fixture(scope="module")
def eager_flux(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("store-engine")
    adapters = root / "adapters"
    shutil.copytree(tiny_models["flux"] / "adapters", adapters)
    (adapters / "catalog.toml").write_text('[adapters.watercolor]\nref = "style-kohya.safetensors"\nscale = 0.4\npin = true\n')
    from hotlora.adapters.store import AdapterStore

    config = StoreConfig(cache_dir=root / "cache", local_roots=(adapters,))
    store = AdapterStore(config, family_named("flux"), catalog=adapters / "catalog.toml")
    engine = Engine.from_pretrained(tiny_models["flux"], target_rank=8, batch_size=2, compile=False, store=store)
    return engine, adapters, store


def test_catalog_names_and_default_scales_resolve_through_the_store(eager_flux):
    engine, adapters, store = eager_flux
    by_name = engine.generate("a cat", adapters={"identity": "identity-diffusers", "style": {"ref": "watercolor"}},
                              num_images=2, output_type="latent", num_inference_steps=2)
    assert by_name.adapters["style"]["scale"] == 0.4 and by_name.adapters["style"]["layout"] == "kohya"
    direct = engine.generate(
        "a cat", num_images=2, output_type="latent", num_inference_steps=2,
        adapters={"identity": (load_adapter(adapters / "identity-diffusers", engine.family), 1.0),
                  "style": (load_adapter(adapters / "style-kohya.safetensors", engine.family), 0.4)},
    )
    torch.testing.assert_close(by_name.images, direct.images, atol=1e-6, rtol=0)
    hits = store.stats()["ram"]["hits"]
    engine.generate("a cat", adapters={"style": "catalog:watercolor"}, output_type="latent", num_inference_steps=1)
    assert store.stats()["ram"]["hits"] == hits + 1


def test_declared_base_model_must_match_the_served_model(eager_flux):
    engine, adapters, _ = eager_flux
    assert engine.generate("a cat", adapters={"identity": "identity-peft"}, output_type="latent",
                           num_inference_steps=1).adapters["identity"]["layout"] == "peft"  # hotlora/tiny-flux: fine
    config = json.loads((adapters / "identity-peft" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "stabilityai/stable-diffusion-xl-base-1.0"
    foreign = adapters / "foreign-peft"
    shutil.copytree(adapters / "identity-peft", foreign)
    (foreign / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejected, match="declares base model 'stabilityai/stable-diffusion-xl-base-1.0'"):
        engine.generate("a cat", adapters={"identity": "foreign-peft"})


def test_cli_convert_writes_what_plain_diffusers_loads_identically(tiny_models, tmp_path, capsys):
    source = tiny_models["flux"] / "adapters" / "style-kohya.safetensors"
    assert main(["adapters", "inspect", str(source), "--cache-dir", str(tmp_path / "c")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == "kohya" and len(report["sha256"]) == 64 and report["modules"] > 0
    assert main(["adapters", "convert", str(source), str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")]) == 0
    pipeline = fresh_pipeline(tiny_models["flux"])
    pipeline.load_lora_weights(str(tmp_path / "out"), adapter_name="converted")
    original = load_adapter(source, family_named("flux"))
    ours, theirs = canonical_deltas(original), loaded_deltas(pipeline.transformer, "converted")
    assert set(ours) == set(theirs)
    for module in ours:
        torch.testing.assert_close(theirs[module].detach(), ours[module], rtol=1e-5, atol=1e-6)
