"""The full-size SD1.5's kohya adapter (``hotlora.fullsize.sd15``), on the meta device for the
model: written as sd-scripts names SD1.x files, read by hotlora through diffusers' kohya converter
onto every layer it names, U-Net and text encoder (the served model: tests/fullsize)."""


def test_kohya_file_lands_on_every_layer_it_names(tmp_path):
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors import safe_open

    from hotlora.adapters.format.convert import load_adapter
    from hotlora.families import family_named
    from hotlora.fullsize.sd15 import UNET, adapter_layers, write_kohya_lora

    layers = adapter_layers()
    path = write_kohya_lora(tmp_path / "kohya.safetensors", layers, rank=1)
    with safe_open(str(path), "pt") as f:
        keys, header = set(f.keys()), f.metadata()
    assert header["ss_base_model_version"] == "sd_v1"
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_11_mlp_fc2.lora_up.weight" in keys
    assert "lora_unet_mid_block_attentions_0_proj_in.lora_down.weight" in keys  # a 1x1 conv, as sd-scripts wraps it
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config({k: v for k, v in UNET.items() if k != "_class_name"})
    adapter = load_adapter(path, family_named("sd15"), denoiser_config=unet.config)
    assert set(adapter.modules) == set(layers["kohya_unet"]) | set(layers["kohya_unet_convs"])
    assert len(layers["kohya_unet_convs"]) == 32  # proj_in and proj_out of 16 transformers
    assert tuple(adapter.modules["mid_block.attentions.0.proj_out"].up.shape) == (1280, 1, 1, 1)
    assert {m.removeprefix("text_model.") for m in adapter.text_modules["text_encoder"]} == \
        {m.removeprefix("text_model.") for m in layers["te"]}
    assert adapter.family == "sd15" and adapter.rank == 1
