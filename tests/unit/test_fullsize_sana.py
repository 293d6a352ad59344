"""The full-size Sana 1600M's adapters (``hotlora.fullsize.sana_1600m``), on the meta device for the
model: written in diffusers' layout as its DreamBooth LoRA script saves them, read by hotlora onto
every layer they name (the served model: tests/fullsize)."""


def test_adapters_land_on_the_layers_the_trainers_target(tmp_path, monkeypatch):
    import torch
    from diffusers import SanaTransformer2DModel
    from safetensors import safe_open

    from hotlora.adapters.format.convert import load_adapter
    from hotlora.families import family_named
    from hotlora.fullsize import sana_1600m

    layers = sana_1600m.adapter_layers()
    # The DreamBooth script's default targets: q, k, v of the linear self-attention and the cross-attention.
    assert len(layers["dreambooth"]) == 20 * 2 * 3 and len(layers["all_linear"]) == 20 * 2 * 4
    assert layers["dreambooth"]["transformer_blocks.0.attn2.to_k"] == (2240, 2240)
    monkeypatch.setattr(sana_1600m, "adapter_layers", lambda: {  # two blocks: the same names, seconds not minutes
        part: {n: shape for n, shape in named.items() if n.startswith(("transformer_blocks.0.", "transformer_blocks.19."))}
        for part, named in layers.items()})
    paths = sana_1600m.write_adapters(tmp_path)
    with torch.device("meta"):
        transformer = SanaTransformer2DModel.from_config(sana_1600m._config(sana_1600m.TRANSFORMER))
    for key, part, rank in (("dreambooth-r32", "dreambooth", 32), ("diffusers-r128", "all_linear", 128)):
        with safe_open(str(paths[key]), "pt") as f:
            keys = set(f.keys())
            assert f.get_tensor(next(iter(keys))).dtype == torch.float16
        assert "transformer.transformer_blocks.19.attn1.to_v.lora_A.weight" in keys
        adapter = load_adapter(paths[key], family_named("sana"), denoiser_config=transformer.config)
        assert adapter.family == "sana" and adapter.rank == rank
        assert set(adapter.modules) == {n for n in layers[part] if n.startswith(("transformer_blocks.0.",
                                                                                 "transformer_blocks.19."))}
