"""The full-size SDXL's configuration and its kohya adapter's keys, on the meta device (no weights:
seconds and no memory; the served model is tested in tests/fullsize)."""

import re

import pytest


@pytest.fixture(scope="module")
def meta_parts():
    from hotlora.fullsize.sdxl import components

    return components(device="meta")


def test_parameter_counts_are_the_published_ones(meta_parts):
    from hotlora.fullsize.sdxl import UNET_PARAMETERS, parameter_count

    assert parameter_count(meta_parts["unet"]) == UNET_PARAMETERS == 2_567_463_684
    # CLIP ViT-L/14 text tower 123.1M, OpenCLIP bigG/14 text tower with projection 694.7M
    assert parameter_count(meta_parts["text_encoder"]) == 123_060_480
    assert parameter_count(meta_parts["text_encoder_2"]) == 694_659_840
    assert len(meta_parts["text_encoder_2"].text_model.encoder.layers) == 32


def test_kohya_keys_are_sd_scripts_names_that_diffusers_maps_onto_every_layer(meta_parts):
    """The file's keys as sd-scripts names them (SGM block numbers for the U-Net, lora_te1 / lora_te2),
    and diffusers' own kohya converter puts each on a layer of this architecture."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    from hotlora.fullsize.sdxl import UNET, adapter_layers
    from hotlora.testing import sd_scripts_sdxl_lora

    layers = adapter_layers()

    def rank_one(linears):
        out = {}
        for module, (in_features, out_features) in linears.items():
            out[f"{module}.lora_A.weight"] = torch.zeros(1, in_features)
            out[f"{module}.lora_B.weight"] = torch.zeros(out_features, 1)
        return out

    kohya = sd_scripts_sdxl_lora(rank_one(layers["kohya_unet"]), UNET["layers_per_block"], 16.0,
                                 text_encoders={"te1": rank_one(layers["te1"]), "te2": rank_one(layers["te2"])})
    modules = {k.split(".")[0] for k in kohya}
    assert len(modules) == 722 + 72 + 192
    for name in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                 "lora_unet_middle_block_1_transformer_blocks_9_ff_net_2", "lora_unet_output_blocks_0_1_proj_in",
                 "lora_unet_output_blocks_5_1_transformer_blocks_1_attn2_to_out_0",
                 "lora_te1_text_model_encoder_layers_11_self_attn_q_proj", "lora_te2_text_model_encoder_layers_31_mlp_fc2"):
        assert name in modules
    sd, _alphas = StableDiffusionXLPipeline.lora_state_dict(kohya, unet_config=meta_parts["unet"].config)
    parts = {"unet": meta_parts["unet"], "text_encoder": meta_parts["text_encoder"],
             "text_encoder_2": meta_parts["text_encoder_2"]}
    # The converter's names: U-Net ``<module>.lora.down``; CLIP MLP ``<module>.lora_linear_layer.down`` and
    # attention ``self_attn.to_q_lora.down`` (diffusers' legacy names its text-encoder loader maps to q_proj ...).
    legacy = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}
    targets = set()
    for key in sd:
        module = re.sub(r"(\.lora|\.lora_linear_layer|_lora)\.(down|up)\.weight$", "", key)
        head, _, last = module.rpartition(".")
        if key.startswith("text_encoder") and last in legacy:
            module = f"{head}.{legacy[last]}"
        elif head.endswith(".processor"):  # U-Net attention: ``attn1.processor.to_out_lora`` -> attn1.to_out.0
            module = f"{head.removesuffix('.processor')}.{last}" + (".0" if last == "to_out" else "")
        targets.add(module)
    assert len(targets) == len(modules)
    for target in targets:
        prefix, module = target.split(".", 1)
        if not hasattr(parts[prefix], "text_model"):  # transformers 5's CLIPTextModel: diffusers strips the level
            module = module.removeprefix("text_model.")
        assert isinstance(parts[prefix].get_submodule(module), torch.nn.Linear), target
