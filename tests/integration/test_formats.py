"""Each layout, read by hotlora, gives the same per-module update diffusers (or PEFT) loads."""

import pytest
import torch

from hotlora.adapters.format.convert import load_adapter
from hotlora.errors import AdapterFormatError, AdapterNotFound
from hotlora.families import family_named

from ..helpers import (
    CORE_FAMILIES, assert_same_deltas, canonical_deltas, family_params, fresh_pipeline, load_outcomes_in_a_new_process,
    loaded_deltas,
)


SAMPLES = {
    "flux": ["identity-diffusers", "style-diffusers", "style-kohya", "style-xlabs"],
    "sdxl": ["identity-diffusers", "style-diffusers", "style-kohya"],
    "sd15": ["identity-diffusers", "style-diffusers", "style-kohya"],
    "sd3": ["identity-diffusers", "style-diffusers", "style-ai-toolkit"],
    # musubi-tuner writes the kohya layout; ai-toolkit the diffusers one under ComfyUI's prefix.
    "zimage": ["identity-diffusers", "style-kohya", "style-comfy"],
    "qwenimage": ["identity-diffusers", "style-kohya", "style-comfy"],
    # musubi-tuner's kohya names, ai-toolkit's ComfyUI-prefixed original Wan names, lightx2v's
    # (lora_down / lora_up under ComfyUI's prefix, with all-zero .diff norm patches).
    "wan": ["identity-diffusers", "style-diffusers", "style-musubi", "style-ai-toolkit", "style-lightx2v"],
    # LTX-Video-Trainer: diffusers' names under ComfyUI's prefix.
    "ltx": ["identity-diffusers", "style-diffusers", "style-comfy"],
    # ai-toolkit and Krea's reference trainer: the original model's names under base_model.model. / diffusion_model.
    "krea2": ["identity-diffusers", "style-ai-toolkit", "style-comfy"],
    # ai-toolkit: diffusers' names under ComfyUI's prefix.
    "ernie-image": ["identity-diffusers", "style-comfy"],
}
# A sample's name -> the layout hotlora detects: ai-toolkit saves SD3 files in diffusers' key names,
# and ComfyUI's prefix over diffusers' names is still diffusers' layout.
LAYOUT = {"style-ai-toolkit": "diffusers", "style-comfy": "diffusers", "style-musubi": "kohya", "style-lightx2v": "kohya"}
NO_ALPHAS = ("style-xlabs", "style-ai-toolkit", "style-comfy", "style-lightx2v")  # alpha = rank


@pytest.mark.parametrize("family, sample", [pytest.param(f, s, marks=() if f in CORE_FAMILIES else pytest.mark.families)
                                            for f, names in SAMPLES.items() for s in names])
def test_layout_matches_load_lora_weights(tiny_models, family, sample):
    import json

    model_dir = tiny_models[family]
    path = model_dir / "adapters" / json.loads((model_dir / "adapters" / "README.json").read_text())[sample]
    pipeline = fresh_pipeline(model_dir)
    denoiser = getattr(pipeline, family_named(family).denoiser)
    adapter = load_adapter(path, family_named(family), denoiser_config=denoiser.config)
    assert adapter.layout == LAYOUT.get(sample, sample.split("-")[1])
    pipeline.load_lora_weights(str(path), adapter_name="ref")
    assert_same_deltas(canonical_deltas(adapter), loaded_deltas(denoiser, "ref"))
    # Alphas that differ from the rank must survive; the samples all use alpha != rank.
    if sample == "style-kohya" and family == "flux":
        # diffusers' kohya-Flux converter bakes alpha / rank into the weights: check against the raw file.
        from safetensors.torch import load_file

        raw = load_file(str(path))
        key = "lora_unet_double_blocks_0_img_attn_proj"
        expected = raw[f"{key}.alpha"] / raw[f"{key}.lora_down.weight"].shape[0] * (
            raw[f"{key}.lora_up.weight"] @ raw[f"{key}.lora_down.weight"]
        )
        torch.testing.assert_close(canonical_deltas(adapter)["transformer_blocks.0.attn.to_out.0"], expected)
    elif sample == "style-kohya" and family in ("zimage", "qwenimage"):
        # Their converters fold alpha / rank into the weights too (scaling 1.0): the delta keeps alpha.
        from safetensors.torch import load_file

        raw = load_file(str(path))
        key = sorted(k for k in raw if k.endswith(".alpha"))[0].removesuffix(".alpha")
        down, up = raw[f"{key}.lora_down.weight"], raw[f"{key}.lora_up.weight"]
        module = next(m for m in adapter.modules if m.replace(".", "_") == key.removeprefix("lora_unet_"))
        torch.testing.assert_close(canonical_deltas(adapter)[module], raw[f"{key}.alpha"] / down.shape[0] * (up @ down))
        assert float(raw[f"{key}.alpha"]) != down.shape[0]
    elif sample == "style-musubi":
        # diffusers' Wan converters fold alpha / rank into the weights (scaling 1.0): the delta keeps it.
        from safetensors.torch import load_file

        from hotlora.trainer_layouts import wan_original_name

        raw = load_file(str(path))
        assert adapter.modules and {round(w.scaling, 6) for w in adapter.modules.values()} == {1.0}
        for module in adapter.modules:
            key = "lora_unet_" + wan_original_name(module).replace(".", "_")
            down, up, alpha = raw[f"{key}.lora_down.weight"], raw[f"{key}.lora_up.weight"], raw[f"{key}.alpha"]
            assert float(alpha) != down.shape[0]
            torch.testing.assert_close(canonical_deltas(adapter)[module], alpha / down.shape[0] * (up @ down))
    elif sample not in NO_ALPHAS:
        assert {round(w.scaling, 6) for w in adapter.modules.values()} != {1.0}


@pytest.mark.parametrize("family", family_params())
def test_peft_layout_matches_peft_loading(tiny_models, family):
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    model_dir = tiny_models[family]
    path = model_dir / "adapters" / "identity-peft"
    adapter = load_adapter(path, family_named(family))
    assert adapter.layout == "peft"
    assert adapter.base_model == f"hotlora/tiny-{family}"

    denoiser = getattr(fresh_pipeline(model_dir), family_named(family).denoiser)
    config = LoraConfig.from_pretrained(str(path))
    inject_adapter_in_model(config, denoiser, adapter_name="ref")
    weights = {k.removeprefix("base_model.model."): v for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
    set_peft_model_state_dict(denoiser, weights, adapter_name="ref")
    assert_same_deltas(canonical_deltas(adapter), loaded_deltas(denoiser, "ref"))


def test_state_dict_source_and_content_hash(tiny_models):
    from safetensors.torch import load_file

    path = tiny_models["flux"] / "adapters" / "identity-diffusers" / "pytorch_lora_weights.safetensors"
    from_file = load_adapter(path, family_named("flux"))
    from_dict = load_adapter(load_file(str(path)), family_named("flux"))
    again = load_adapter(load_file(str(path)), family_named("flux"))
    assert from_dict.sha256 == again.sha256 and len(from_file.sha256) == 64
    assert set(from_file.modules) == set(from_dict.modules)


def test_text_encoder_keys_are_split_out_under_their_encoder(tiny_models):
    """Older files name CLIP's modules under ``text_model.``; transformers' CLIP no longer has that
    level, and diffusers strips it: so does hotlora."""
    from safetensors.torch import load_file

    path = tiny_models["flux"] / "adapters" / "identity-diffusers" / "pytorch_lora_weights.safetensors"
    sd = load_file(str(path))
    sd["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.ones(2, 32)
    sd["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.ones(32, 2)
    adapter = load_adapter(sd, family_named("flux"))
    assert adapter.skipped_keys == []
    assert list(adapter.text_modules) == ["text_encoder"]
    assert list(adapter.text_modules["text_encoder"]) == ["encoder.layers.0.self_attn.q_proj"]
    assert not any(m.startswith("text_encoder") for m in adapter.modules)


def test_unreadable_inputs_fail_with_clear_errors(tmp_path):
    flux = family_named("flux")
    with pytest.raises(AdapterNotFound, match="does not exist"):
        load_adapter(tmp_path / "missing.safetensors", flux)
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(AdapterFormatError, match="only .safetensors"):
        load_adapter(tmp_path / "weights.bin", flux)
    (tmp_path / "broken.safetensors").write_bytes(len(b"{not json}").to_bytes(8, "little") + b"{not json}")
    with pytest.raises(AdapterFormatError, match="not a readable safetensors"):
        load_adapter(tmp_path / "broken.safetensors", flux)
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(AdapterFormatError, match="truncated"):
        load_adapter(tmp_path / "short.safetensors", flux)
    with pytest.raises(AdapterFormatError, match="no LoRA weights"):
        load_adapter({"unet.foo.lora_A.weight": torch.zeros(1, 2), "unet.foo.lora_B.weight": torch.zeros(2, 1)}, flux)


def test_declared_base_model_is_read_from_the_file_header(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from hotlora.adapters.format.validate import SlotCeiling, problems_with

    path = tiny_models["flux"] / "adapters" / "identity-diffusers" / "pytorch_lora_weights.safetensors"
    save_file(load_file(str(path)), str(tmp_path / "tagged.safetensors"), metadata={"base_model": "acme/other-model"})
    adapter = load_adapter(tmp_path / "tagged.safetensors", family_named("flux"))
    assert adapter.base_model == "acme/other-model"
    modules = {m: (w.down.shape[1], w.up.shape[0]) for m, w in adapter.modules.items()}
    ceiling = SlotCeiling(modules, 8, "flux", served_models=frozenset({"/models/tiny", "hotlora/tiny-flux"}))
    assert any("declares base model 'acme/other-model'" in p for p in problems_with(adapter, ceiling))
    ok = SlotCeiling(modules, 8, "flux", served_models=frozenset({"/models/other-model"}))
    assert problems_with(adapter, ok) == []


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_text_parts_and_embeddings_travel_through_the_disk_cache_and_convert(tiny_models, tmp_path, family):
    """A pivotal-tuning folder (LoRA file + ``<name>_emb.safetensors``): its text-encoder LoRA and
    embeddings survive the disk tier's format and ``adapters convert``, which plain diffusers loads."""
    from hotlora.adapters.store.diskcache import deserialize, serialize
    from hotlora.adapters.format.export import describe, save_as_diffusers
    from hotlora.testing import (
        denoiser_linears, random_embeddings, random_lora, save_pivotal_lora, text_encoder_linears,
    )

    pipeline = fresh_pipeline(tiny_models[family])
    fam = family_named(family)
    texts = {te: random_lora(text_encoder_linears(pipeline, te), 3, seed=i) for i, te in enumerate(fam.lora_text_encoders)}
    vectors = random_embeddings(pipeline, family, 3, seed=9)
    folder = save_pivotal_lora(tmp_path / "pivotal", family, random_lora(denoiser_linears(pipeline), 2, seed=5), texts,
                               alpha=2, embeddings=vectors)
    adapter = load_adapter(folder, fam)
    assert adapter.embeddings.tokens == ("<s0>", "<s1>", "<s2>")
    assert sorted(adapter.text_modules) == sorted(fam.lora_text_encoders)

    cached = deserialize(serialize(adapter))
    assert cached.key == adapter.key and cached.nbytes == adapter.nbytes

    out = save_as_diffusers(adapter, tmp_path / "converted")
    again = load_adapter(out.parent, fam)
    assert again.embeddings.tokens == adapter.embeddings.tokens
    for encoder, tensor in adapter.embeddings.vectors.items():
        assert torch.equal(again.embeddings.vectors[encoder], tensor)
    def deltas(modules):
        return {m: w.scaling * (w.up.float() @ w.down.float()) for m, w in modules.items()}

    for encoder, modules in adapter.text_modules.items():
        assert_same_deltas(deltas(again.text_modules[encoder]), deltas(modules))
    pipeline.load_lora_weights(str(out.parent), weight_name=out.name, adapter_name="converted")  # diffusers reads it
    report = describe(adapter)
    assert report["embeddings"]["tokens"] == ["<s0>", "<s1>", "<s2>"]
    assert set(report["text_encoders"]) == set(fam.lora_text_encoders)


@pytest.fixture(scope="module")
def wan_two_experts(tmp_path_factory):
    """Wan 2.2 A14B's tiny layout in memory and its trainer-layout samples (musubi-tuner's pair among them)."""
    from hotlora.testing import denoiser_linears

    wan = family_named("wan")
    pipeline = wan.build_tiny_variant("two-experts")
    out = tmp_path_factory.mktemp("wan-trainers")
    return pipeline, wan.write_trainer_samples(pipeline, denoiser_linears(pipeline), out, 2, [])


def _split_pair(deltas: dict) -> tuple[dict, dict]:
    return ({m: d for m, d in deltas.items() if not m.startswith("transformer_2.")},
            {m.removeprefix("transformer_2."): d for m, d in deltas.items() if m.startswith("transformer_2.")})


@pytest.mark.families
def test_musubi_expert_files_paired_equal_diffusers_loading_each_into_its_expert(wan_two_experts, tmp_path, monkeypatch):
    """Wan 2.2 A14B LoRAs ship as two musubi-tuner files: joined by ``pair_experts`` (and by
    ``hotlora adapters convert --low-noise``) they give per expert what diffusers loads with the high
    file into ``transformer`` and the low one with ``load_into_transformer_2=True``."""
    from hotlora.adapters.format.export import pair_experts
    from hotlora.cli import main

    _, samples = wan_two_experts
    wan = family_named("wan")
    pipeline = wan.build_tiny_variant("two-experts")  # its own: loading LoRA into the fixture's would change it
    high, low = samples["experts-musubi-high"], samples["experts-musubi-low"]
    pair = pair_experts(load_adapter(high, wan), load_adapter(low, wan))
    assert pair.layout == "kohya"
    pipeline.load_lora_weights(str(high), adapter_name="ref")
    pipeline.load_lora_weights(str(low), adapter_name="ref", load_into_transformer_2=True)
    theirs_high, theirs_low = loaded_deltas(pipeline.transformer, "ref"), loaded_deltas(pipeline.transformer_2, "ref")
    ours_high, ours_low = _split_pair(canonical_deltas(pair))
    assert theirs_high and theirs_low
    assert_same_deltas(ours_high, theirs_high)
    assert_same_deltas(ours_low, theirs_low)
    assert not any(torch.allclose(ours_high[m], ours_low[m]) for m in ours_high)  # two experts, two LoRAs

    monkeypatch.chdir(tmp_path)
    assert main(["adapters", "convert", str(high), str(tmp_path / "out"), "--family", "wan", "--low-noise", str(low),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    made_high, made_low = _split_pair(canonical_deltas(load_adapter(tmp_path / "out" / "pytorch_lora_weights.safetensors", wan)))
    assert_same_deltas(made_high, theirs_high)
    assert_same_deltas(made_low, theirs_low)


@pytest.mark.families
@pytest.mark.parametrize("case", ["attention-only", "later-blocks", "no-alphas"])
def test_musubi_files_diffusers_own_converter_fails_on_load(wan_two_experts, tmp_path, case):
    """musubi-tuner files of a subset of the blocks' Linears (its ``exclude_patterns`` /
    ``include_patterns``) or without alphas: diffusers' musubi converter raises on them (it reads
    blocks 0 .. n-1, every Linear and its alpha); hotlora reads them through diffusers' ComfyUI-name
    converter, and each module's delta is the file's ``alpha / rank * up @ down``. When diffusers
    fixes its converter the first assertion fails: the rename in ``Wan.prepare_raw_lora`` can go."""
    from safetensors.torch import save_file

    from hotlora.testing import denoiser_linears, random_lora
    from hotlora.trainer_layouts import musubi_wan_lora, wan_original_name

    pipeline, _ = wan_two_experts
    linears = denoiser_linears(pipeline)
    chosen = {"attention-only": [m for m in linears if ".attn" in m],
              "later-blocks": [m for m in linears if m.startswith("blocks.1.")],
              "no-alphas": None}[case]
    tensors, meta = musubi_wan_lora(random_lora(linears, 4, seed=21, modules=chosen), None if case == "no-alphas" else 3.0, 4, "wan")
    path = tmp_path / "musubi.safetensors"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises((KeyError, ValueError)):
        type(pipeline).lora_state_dict(str(path))
    adapter = load_adapter(path, family_named("wan"))
    assert set(adapter.modules) == {m for m in (chosen or linears) if m.startswith("blocks.")}
    for module, delta in canonical_deltas(adapter).items():
        key = "lora_unet_" + wan_original_name(module).replace(".", "_")
        down, up = tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"]
        alpha = float(tensors[f"{key}.alpha"]) if case != "no-alphas" else down.shape[0]
        torch.testing.assert_close(delta, alpha / down.shape[0] * (up @ down))


@pytest.mark.families
@pytest.mark.parametrize("patch", ["time_projection.1.diff_b", "blocks.1.cross_attn.norm_k.diff", "blocks.0.diff_m"])
def test_lightx2v_patches_that_change_the_model_are_refused_not_dropped(wan_two_experts, tmp_path, patch):
    """A non-zero lightx2v whole-tensor patch that diffusers drops: a norm's (``.diff``), a
    modulation (``.diff_m``), a bias of a layer without LoRA factors (diffusers loads a Linear's
    ``.diff_b`` beside its factors as a LoRA bias, which the slots serve: test_lora_bias.py). A LoRA
    slot holds none of them, so hotlora refuses the file naming the key. The same file with the
    patch zeroed is served."""
    from safetensors.torch import load_file, save_file

    pipeline, samples = wan_two_experts
    sd = load_file(str(samples["style-lightx2v"]))
    shape = (1, 6, 24) if patch.endswith("diff_m") else (24,)
    save_file({**sd, f"diffusion_model.{patch}": torch.full(shape, 0.1)}, str(tmp_path / "live.safetensors"))
    save_file({**sd, f"diffusion_model.{patch}": torch.zeros(shape)}, str(tmp_path / "zero.safetensors"))
    with pytest.raises(AdapterFormatError, match=rf"whole-tensor patches .*{patch.replace('.', '[.]')}"):
        load_adapter(tmp_path / "live.safetensors", family_named("wan"))
    served = load_adapter(tmp_path / "zero.safetensors", family_named("wan"))
    assert_same_deltas(canonical_deltas(served), canonical_deltas(load_adapter(samples["style-lightx2v"], family_named("wan"))))


@pytest.mark.families
def test_a_negative_wan_alpha_is_refused_not_looped_on(wan_two_experts, tmp_path):
    """diffusers' Wan converters halve and double until ``scale_down * 2 >= scale_up``, which a
    negative alpha never reaches: refused first. Run in a new process, so a regression fails
    instead of hanging the run."""
    from safetensors.torch import load_file, save_file

    _, samples = wan_two_experts
    sd = load_file(str(samples["style-musubi"]))
    key = "lora_unet_blocks_0_self_attn_q.alpha"
    save_file({**sd, key: torch.tensor(-1.0)}, str(tmp_path / "negative.safetensors"))
    (outcome,) = load_outcomes_in_a_new_process([tmp_path / "negative.safetensors"], "wan")
    assert outcome.startswith("REFUSED") and f"negative alpha in {key}" in outcome
