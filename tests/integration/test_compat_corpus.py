"""A compatibility corpus: adapters written the way real tools write them, each read by hotlora and
compared with what plain diffusers (or PEFT) loads from the same file.

The comparison is per module: ``scaling * B @ A`` as the library holds it after loading, against
hotlora's canonical deltas. Every refusal must name its reason. One fresh pipeline per family
serves the whole module; each case unloads its adapter again.
"""

import json

import pytest
import torch

from hotlora.families import family_named
from hotlora.adapters.format.convert import load_adapter
from hotlora.errors import AdapterFormatError
from hotlora.testing import denoiser_linears, random_lora

from ..helpers import assert_same_deltas, canonical_deltas, fresh_pipeline, loaded_deltas, family_params



@pytest.fixture(scope="module")
def pipelines(tiny_models):
    """family -> a fresh plain-diffusers pipeline, built once for the module."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = fresh_pipeline(tiny_models[family])
            built[family].set_progress_bar_config(disable=True)
        return built[family]

    return get


def denoiser_of(pipeline, family):
    return getattr(pipeline, family_named(family).denoiser)


def diffusers_deltas(pipeline, family, source, part=None):
    """What ``load_lora_weights`` loads into the denoiser (or the text encoder ``part``); the adapter
    is unloaded again after."""
    source = dict(source) if isinstance(source, dict) else str(source)
    model = denoiser_of(pipeline, family) if part is None else getattr(pipeline, part)
    try:
        pipeline.load_lora_weights(source, adapter_name="ref")
        return {m: d.detach().clone() for m, d in loaded_deltas(model, "ref").items()}
    finally:
        pipeline.unload_lora_weights()


def assert_same_text_deltas(adapter, pipeline, family, source, encoders):
    """hotlora's text-encoder parts are what diffusers loads into each text encoder."""
    assert sorted(adapter.text_modules) == sorted(encoders)
    for encoder in encoders:
        ours = {m: w.scaling * (w.up.float() @ w.down.float()) for m, w in adapter.text_modules[encoder].items()}
        # CLIPTextModelWithProjection still nests its layers under "text_model."; hotlora names them
        # relative to that level, for every CLIP (CLIPTextModel no longer has it).
        theirs = {m.removeprefix("text_model."): d for m, d in diffusers_deltas(pipeline, family, source, encoder).items()}
        assert_same_deltas(ours, theirs)


def hotlora_adapter(pipeline, family, source):
    return load_adapter(source, family_named(family), denoiser_config=denoiser_of(pipeline, family).config)


def targets(sd):
    return sorted({k.split(".lora_")[0] for k in sd})


def some_modules(linears, family):
    """Attention and MLP projections (transformers: of the first blocks; U-Nets: all): what trainers target by default."""
    wanted = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "ff.net.2", "proj_in", "proj_out")
    first_block = ("blocks.0.", "layers.0.")  # Z-Image names its main blocks ``layers``
    return [m for m in linears if m.endswith(wanted) and (any(b in m for b in first_block) or "mid_block" in m
                                                     or family_named(family).denoiser == "unet")]


# ----------------------------------------------------------------------------- diffusers' own files


def save_with_diffusers(tmp_path, family, sd, metadata=None, dtype=None):
    """What diffusers' training scripts do: ``save_lora_weights`` with ``*_lora_adapter_metadata``."""

    fam = family_named(family)
    layers = {k: (v.to(dtype) if dtype else v) for k, v in sd.items()}
    kwargs = {f"{fam.denoiser}_lora_layers": layers}
    if metadata is not None:
        kwargs[f"{fam.denoiser}_lora_adapter_metadata"] = metadata
    fam.pipeline_type.save_lora_weights(str(tmp_path), **kwargs)
    return tmp_path / "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("alpha", [4, 8])
def test_training_script_metadata_is_a_real_lora_config(pipelines, tmp_path, family, alpha):
    """A real ``LoraConfig(...).to_dict()`` has ``base_model_name_or_path: null`` and many null
    fields; null means "not declared", never the base model "None"."""
    from peft import LoraConfig

    from hotlora.adapters.format.validate import SlotCeiling, problems_with

    pipeline = pipelines(family)
    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 4, seed=1, modules=some_modules(linears, family))
    config = LoraConfig(r=4, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets(sd))
    path = save_with_diffusers(tmp_path, family, sd, metadata=config.to_dict())

    adapter = hotlora_adapter(pipeline, family, path)
    assert adapter.base_model is None
    assert {round(w.scaling, 6) for w in adapter.modules.values()} == {alpha / 4}
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, family, path))
    ceiling = SlotCeiling(linears, 8, family, served_models=frozenset({f"hotlora/tiny-{family}"}))
    assert problems_with(adapter, ceiling) == []


@pytest.mark.parametrize("family", family_params())
def test_training_script_file_without_metadata(pipelines, tmp_path, family):
    """Older scripts saved no metadata: alpha is lost and both sides apply a scaling of 1."""
    pipeline = pipelines(family)
    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 3, seed=2, modules=some_modules(linears, family))
    path = save_with_diffusers(tmp_path, family, sd)
    adapter = hotlora_adapter(pipeline, family, path)
    assert {w.scaling for w in adapter.modules.values()} == {1.0}
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, family, path))


@pytest.mark.parametrize("family", family_params())
def test_per_module_ranks_and_alphas_from_rank_and_alpha_patterns(pipelines, tmp_path, family):
    """A real LoraConfig with ``rank_pattern`` / ``alpha_pattern``: a suffix key (every ``to_k``), and
    ``^``-anchored full names, which PEFT matches with its regex lookup and hotlora without one."""
    from peft import LoraConfig

    pipeline = pipelines(family)
    linears = denoiser_linears(pipeline)
    chosen = some_modules(linears, family)
    to_k = [m for m in chosen if m.endswith(".to_k")]
    anchored = next(m for m in chosen if not m.endswith(".to_k"))
    plain = [m for m in chosen if m not in to_k and m != anchored]
    sd = {**random_lora(linears, 4, seed=3, modules=plain), **random_lora(linears, 2, seed=4, modules=to_k),
          **random_lora(linears, 6, seed=5, modules=[anchored])}
    config = LoraConfig(
        r=4, lora_alpha=4, target_modules=targets(sd), rank_pattern={"to_k": 2, f"^{anchored}": 6},
        alpha_pattern={"to_k": 3, f"^{anchored}": 1.5, plain[0]: 12},
    )
    path = save_with_diffusers(tmp_path, family, sd, metadata=config.to_dict())
    adapter = hotlora_adapter(pipeline, family, path)
    assert {adapter.modules[m].rank for m in to_k} == {2} and adapter.modules[anchored].rank == 6
    assert adapter.modules[to_k[0]].scaling == 1.5 and adapter.modules[anchored].scaling == 0.25
    assert adapter.modules[plain[0]].scaling == 3.0 and adapter.modules[plain[1]].scaling == 1.0
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, family, path))


@pytest.mark.parametrize("family", family_params())
def test_text_encoder_layers_saved_beside_the_denoiser(pipelines, tmp_path, family):
    """``save_lora_weights(..., text_encoder_lora_layers=...)`` with each part's metadata: every
    part equals what diffusers loads into the denoiser and the text encoders; nothing is skipped.
    Where diffusers cannot load the text-encoder part (Chroma's T5: its key conversion knows CLIP's
    layer names only), hotlora refuses the file too, rather than serving it without that part."""
    from peft import LoraConfig


    pipeline = pipelines(family)
    fam = family_named(family)
    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 4, seed=6, modules=some_modules(linears, family))
    encoders = {name: getattr(pipeline, name) for name in fam.lora_text_encoders}
    kwargs = {f"{fam.denoiser}_lora_layers": sd,
              f"{fam.denoiser}_lora_adapter_metadata": LoraConfig(r=4, lora_alpha=2, target_modules=targets(sd)).to_dict()}
    for name, encoder in encoders.items():  # with their metadata, as the training scripts save them
        layers = random_lora(linear_layers(encoder), 2, seed=7)
        kwargs[f"{name}_lora_layers"] = layers
        kwargs[f"{name}_lora_adapter_metadata"] = LoraConfig(r=2, lora_alpha=2, target_modules=targets(layers)).to_dict()
    if fam.model_lora_parts:  # LTX-2's save_lora_weights takes the transformer's layers only: the helper it calls
        parts = {name.removesuffix("_lora_layers"): layers for name, layers in kwargs.items() if name.endswith("_layers")}
        fam.pipeline_type._save_lora_weights(str(tmp_path), lora_layers=parts, lora_metadata={
            part: kwargs[f"{part}_lora_adapter_metadata"] for part in parts})
    else:
        fam.pipeline_type.save_lora_weights(str(tmp_path), **kwargs)
    path = tmp_path / "pytorch_lora_weights.safetensors"

    try:
        fresh_pipeline(pipeline.config._name_or_path).load_lora_weights(str(path))
    except ValueError:
        with pytest.raises(AdapterFormatError, match="diffusers cannot convert the text_encoder LoRA"):
            hotlora_adapter(pipeline, family, path)
        return
    adapter = hotlora_adapter(pipeline, family, path)
    assert adapter.skipped_keys == []
    assert {te: len(mods) for te, mods in adapter.text_modules.items()} == {
        name: len(linear_layers(e)) for name, e in encoders.items()}
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, family, path))
    assert_same_text_deltas(adapter, pipeline, family, path, encoders)


def linear_layers(model) -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# ----------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("variant", ["lora", "rslora"])
def test_peft_save_pretrained(pipelines, tmp_path, family, variant):
    """``get_peft_model(denoiser, LoraConfig)`` trained (random B here), then ``save_pretrained``:
    ``adapter_model.safetensors`` + ``adapter_config.json`` + a model card. Compared with the PEFT
    model's own ``scaling * B @ A`` (diffusers cannot read this layout)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from hotlora.adapters.format.validate import SlotCeiling, problems_with

    pipeline = pipelines(family)
    denoiser = copy.deepcopy(denoiser_of(pipeline, family))
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                        use_rslora=variant == "rslora", init_lora_weights="gaussian")
    model = get_peft_model(denoiser, config)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    model.save_pretrained(str(tmp_path))

    adapter = hotlora_adapter(pipeline, family, tmp_path)
    assert adapter.layout == "peft"
    theirs = {m.removeprefix("base_model.model."): d for m, d in loaded_deltas(model, "default").items()}
    assert_same_deltas(canonical_deltas(adapter), theirs)
    expected = 6 / 2 if variant == "rslora" else 6 / 4
    assert {round(w.scaling, 6) for w in adapter.modules.values()} == {expected}
    # The model card names the denoiser's own directory (<model dir>/<denoiser>): that is the model.
    model_dir = denoiser_of(pipeline, family).config._name_or_path.rsplit("/", 1)[0]
    assert adapter.base_model == model_dir
    ceiling = SlotCeiling(denoiser_linears(pipeline), 8, family, served_models=frozenset({model_dir}))
    assert problems_with(adapter, ceiling) == []


@pytest.mark.parametrize("declared, expected", [
    ("/root/.cache/huggingface/hub/models--black-forest-labs--FLUX.1-dev/snapshots/0ef5fff/transformer",
     "black-forest-labs/FLUX.1-dev"),
    ("/data/models/sdxl-base/unet", "/data/models/sdxl-base"),
    ("acme/other-model", "acme/other-model"),
    ("None", None), ("null", None), ("", None),
])
def test_declared_base_model_paths_name_their_model(tiny_models, tmp_path, declared, expected):
    from safetensors.torch import load_file, save_file

    path = tiny_models["flux"] / "adapters" / "identity-diffusers" / "pytorch_lora_weights.safetensors"
    save_file(load_file(str(path)), str(tmp_path / "tagged.safetensors"), metadata={"base_model": declared})
    assert load_adapter(tmp_path / "tagged.safetensors", family_named("flux")).base_model == expected


# ----------------------------------------------------------------------------- kohya sd-scripts


@pytest.mark.parametrize("naming", ["sgm", "diffusers"])
def test_kohya_sdxl_with_both_text_encoders(pipelines, tmp_path, naming):
    """sd-scripts' SDXL file (SGM block numbers, ``lora_te1_``/``lora_te2_``, ``.alpha``, ``ss_*``
    header), and the diffusers-named kohya file ``convert_state_dict_to_kohya`` writes. The U-Net
    part and both text encoders' parts equal what diffusers loads."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save_file

    from hotlora.testing import sd_scripts_metadata, sd_scripts_sdxl_lora

    pipeline = pipelines("sdxl")
    linears = denoiser_linears(pipeline)
    unet_sd = random_lora(linears, 4, seed=9, modules=[m for m in linears if ".attentions." in m])
    te = {"te1": random_lora(linear_layers(pipeline.text_encoder), 2, seed=10),
          "te2": random_lora(linear_layers(pipeline.text_encoder_2), 2, seed=11)}
    if naming == "sgm":
        sd = sd_scripts_sdxl_lora(unet_sd, pipeline.unet.config.layers_per_block, alpha=3.0, text_encoders=te)
    else:
        prefixed = {f"unet.{k}": v for k, v in unet_sd.items()}
        prefixed.update({f"text_encoder.{k}": v for k, v in te["te1"].items()})
        prefixed.update({f"text_encoder_2.{k}": v for k, v in te["te2"].items()})
        sd = {k: (torch.tensor(3.0) if k.endswith(".alpha") else v.contiguous())
              for k, v in convert_state_dict_to_kohya(prefixed).items()}
    path = tmp_path / "kohya.safetensors"
    save_file(sd, str(path), metadata=sd_scripts_metadata("sdxl_base_v1-0", 4, 3.0))

    adapter = hotlora_adapter(pipeline, "sdxl", path)
    assert adapter.layout == "kohya" and set(adapter.modules) == set(targets(unet_sd)) and len(adapter.modules) > 50
    assert {round(w.scaling, 6) for w in adapter.modules.values()} == {0.75}
    assert adapter.skipped_keys == []
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, "sdxl", path))
    assert_same_text_deltas(adapter, pipeline, "sdxl", path, ["text_encoder", "text_encoder_2"])


def flux_double_block_count(linears):
    return sum(1 for m in linears if m.startswith("transformer_blocks.") and m.endswith("attn.to_out.0"))


@pytest.mark.parametrize("alpha", [6.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kohya_flux_double_blocks(pipelines, tmp_path, alpha, dtype):
    """sd-scripts' Flux file: fused ``img_attn_qkv`` (one down for q, k, v), ``.alpha`` present or
    absent (alpha = rank), CLIP-L ``lora_te1_`` keys, ``ss_*`` header; float32 and bfloat16."""
    from hotlora.testing import kohya_flux_lora, save_kohya_flux_lora_file

    pipeline = pipelines("flux")
    linears = denoiser_linears(pipeline)
    sd = kohya_flux_lora(linears, flux_double_block_count(linears), rank=4, alpha=alpha or 4.0, seed=12)
    te = random_lora(linear_layers(pipeline.text_encoder), 2, seed=13)
    for module in targets(te):
        name = "lora_te1_" + module.replace(".", "_")
        sd[f"{name}.lora_down.weight"] = te[f"{module}.lora_A.weight"]
        sd[f"{name}.lora_up.weight"] = te[f"{module}.lora_B.weight"]
        sd[f"{name}.alpha"] = torch.tensor(alpha or 2.0)
    t5 = "lora_te3_encoder_block_0_layer_0_SelfAttention_q"  # sd-scripts' T5: diffusers drops it silently
    sd.update({f"{t5}.lora_down.weight": torch.randn(4, 32), f"{t5}.lora_up.weight": torch.randn(32, 4)})
    path = save_kohya_flux_lora_file(tmp_path / "kohya-flux.safetensors", sd, rank=4, alpha=alpha, dtype=dtype)

    adapter = hotlora_adapter(pipeline, "flux", path)
    assert adapter.layout == "kohya" and "transformer_blocks.0.attn.add_k_proj" in adapter.modules
    assert adapter.skipped_keys == [f"{t5}.lora_down.weight", f"{t5}.lora_up.weight"]  # T5: diffusers drops it
    assert_same_text_deltas(adapter, pipeline, "flux", path, ["text_encoder"])
    ours = canonical_deltas(adapter)
    assert_same_deltas(ours, diffusers_deltas(pipeline, "flux", path))
    # Independent arithmetic: the fused qkv update, split by rows, is alpha / r * up @ down.
    from safetensors.torch import load_file

    raw = {k: v.float() for k, v in load_file(str(path)).items()}
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    scale = (alpha or 4.0) / 4
    fused = scale * raw[f"{key}.lora_up.weight"] @ raw[f"{key}.lora_down.weight"]
    q, k, v = fused.chunk(3)
    for part, module in zip((q, k, v), ("to_q", "to_k", "to_v")):
        # bf16: the file's weights are bf16, the converter scales them in bf16, this sum runs in float32.
        tolerance = {"rtol": 1e-2, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(ours[f"transformer_blocks.0.attn.{module}"], part, **tolerance)


# Full-size Flux.1 dims, which diffusers' kohya converter hard-codes for single blocks.
HIDDEN, MLP = 3072, 12288


@pytest.mark.parametrize("sparse", [False, True])
def test_kohya_flux_single_blocks_at_full_width(sparse):
    """``single_blocks_N_linear1`` (q, k, v and the MLP input fused, 3072 -> 21504) and ``linear2``,
    at Flux.1's real width, in memory: no model. Each canonical module's update, applied to probe
    vectors, equals the hand-split ``alpha / r * up @ down``. ``sparse``: the up matrix is block-diagonal
    (files converted from split q/k/v/mlp LoRAs), which the converter re-splits into rank r / 4 each."""
    g = torch.Generator().manual_seed(14)
    rank, alpha = (8, 4.0) if sparse else (4, 2.0)
    dims = [HIDDEN, HIDDEN, HIDDEN, MLP]
    down = torch.randn(rank, HIDDEN, generator=g) / HIDDEN**0.5
    up = torch.randn(sum(dims), rank, generator=g) * 0.1
    if sparse:
        up = torch.block_diag(*(block[:, 2 * i : 2 * i + 2] for i, block in enumerate(up.split(dims))))
    down2, up2 = torch.randn(rank, HIDDEN + MLP, generator=g) / 100, torch.randn(HIDDEN, rank, generator=g)
    sd = {}
    for name, (d, u) in {"linear1": (down, up), "linear2": (down2, up2)}.items():
        key = f"lora_unet_single_blocks_0_{name}"
        sd.update({f"{key}.lora_down.weight": d, f"{key}.lora_up.weight": u, f"{key}.alpha": torch.tensor(alpha)})
    adapter = load_adapter(sd, family_named("flux"))
    prefix = "single_transformer_blocks.0."
    assert set(adapter.modules) == {prefix + m for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")}
    assert {w.rank for m, w in adapter.modules.items() if not m.endswith("proj_out")} == {2 if sparse else 4}

    def applied(module, x):
        w = adapter.modules[prefix + module]
        return w.scaling * (w.up @ (w.down @ x))

    x = torch.randn(HIDDEN, 3, generator=g)
    expected = (alpha / rank) * (up @ (down @ x))
    for part, module in zip(expected.split(dims), ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
        torch.testing.assert_close(applied(module, x), part, rtol=1e-4, atol=1e-6)
    x2 = torch.randn(HIDDEN + MLP, 3, generator=g)
    torch.testing.assert_close(applied("proj_out", x2), (alpha / rank) * (up2 @ (down2 @ x2)), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- other trainers


def test_ai_toolkit_flux(pipelines, tmp_path):
    """ai-toolkit's Flux file: ``transformer.<diffusers module>.lora_A/B``, float16, no alphas,
    its JSON-string header fields. diffusers loads it as is; so does hotlora, with equal deltas."""
    from safetensors.torch import save_file

    from hotlora.testing import ai_toolkit_flux_lora

    pipeline = pipelines("flux")
    linears = denoiser_linears(pipeline)
    tensors, meta = ai_toolkit_flux_lora(random_lora(linears, 4, seed=15, modules=some_modules(linears, "flux")))
    path = tmp_path / "ai-toolkit.safetensors"
    save_file(tensors, str(path), metadata=meta)
    adapter = hotlora_adapter(pipeline, "flux", path)
    assert adapter.layout == "diffusers" and adapter.base_model is None
    assert {w.down.dtype for w in adapter.modules.values()} == {torch.float16}
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, "flux", path))


def test_comfyui_flux_with_bfl_names(pipelines, tmp_path):
    """ComfyUI-saved Flux LoRAs: BFL module names under ``diffusion_model.``, ``lora_down/lora_up``
    and ``.alpha``; diffusers maps them through its kohya converter."""
    from safetensors.torch import save_file

    from hotlora.testing import kohya_flux_lora

    pipeline = pipelines("flux")
    linears = denoiser_linears(pipeline)
    kohya = kohya_flux_lora(linears, flux_double_block_count(linears), rank=4, alpha=2.0, seed=16)
    comfy = {}
    for key, value in kohya.items():  # lora_unet_double_blocks_0_img_attn_qkv -> double_blocks.0.img_attn.qkv
        module, suffix = key.split(".", 1)
        block = module.removeprefix("lora_unet_double_blocks_")
        index, rest = block.split("_", 1)
        name = {"img_attn_qkv": "img_attn.qkv", "img_attn_proj": "img_attn.proj", "img_mlp_0": "img_mlp.0",
                "img_mlp_2": "img_mlp.2", "txt_attn_qkv": "txt_attn.qkv", "txt_attn_proj": "txt_attn.proj"}[rest]
        comfy[f"diffusion_model.double_blocks.{index}.{name}.{suffix}"] = value.contiguous()
    path = tmp_path / "comfy.safetensors"
    save_file(comfy, str(path))
    adapter = hotlora_adapter(pipeline, "flux", path)
    assert len(adapter.modules) == 10 * flux_double_block_count(linears)
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, "flux", path))


def test_xlabs_flux_in_half_precision(pipelines, tmp_path):
    from safetensors.torch import save_file

    from hotlora.testing import xlabs_flux_lora

    pipeline = pipelines("flux")
    linears = denoiser_linears(pipeline)
    sd = xlabs_flux_lora(linears, flux_double_block_count(linears), rank=4, seed=17)
    path = tmp_path / "xlabs.safetensors"
    save_file({k: v.half().contiguous() for k, v in sd.items()}, str(path))
    adapter = hotlora_adapter(pipeline, "flux", path)
    assert adapter.layout == "xlabs"
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, "flux", path))


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_diffusers_files(pipelines, tmp_path, family, dtype):
    from peft import LoraConfig

    pipeline = pipelines(family)
    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 4, seed=18, modules=some_modules(linears, family))
    metadata = LoraConfig(r=4, lora_alpha=8, target_modules=targets(sd)).to_dict()
    path = save_with_diffusers(tmp_path, family, sd, metadata, dtype)
    adapter = hotlora_adapter(pipeline, family, path)
    assert {w.up.dtype for w in adapter.modules.values()} == {dtype}
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas(pipeline, family, path))


# ----------------------------------------------------------------------------- refusals


def bfl_names_under_diffusion_model(linears):
    """Newer ai-toolkit models and some ComfyUI exports: ``lora_A``/``lora_B`` under ``diffusion_model.``."""
    g = torch.Generator().manual_seed(19)
    return {"diffusion_model.double_blocks.0.img_attn.proj.lora_A.weight": torch.randn(4, 32, generator=g),
            "diffusion_model.double_blocks.0.img_attn.proj.lora_B.weight": torch.randn(32, 4, generator=g)}


def diffusers_names_under_diffusion_model(linears):
    return {f"diffusion_model.{k}": v for k, v in random_lora(linears, 4, seed=20, modules=list(linears)[:4]).items()}


@pytest.mark.parametrize("layout, reason", [
    (bfl_names_under_diffusion_model, "no LoRA weights for the flux transformer or its text encoders"),
    (diffusers_names_under_diffusion_model, "no LoRA weights for the flux transformer or its text encoders"),
])
def test_layouts_diffusers_loads_nothing_from_are_refused(tiny_models, tmp_path, layout, reason):
    """diffusers warns and loads no module from these; hotlora says so instead of serving nothing."""
    from safetensors.torch import save_file

    from hotlora.testing import ai_toolkit_flux_lora

    pipeline = fresh_pipeline(tiny_models["flux"])
    _, meta = ai_toolkit_flux_lora({})
    path = tmp_path / "adapter.safetensors"
    save_file(layout(denoiser_linears(pipeline)), str(path), metadata=meta)
    assert diffusers_deltas(pipeline, "flux", path) == {}
    with pytest.raises(AdapterFormatError, match=reason):
        hotlora_adapter(pipeline, "flux", path)


def rank_declared_wrong(pipeline, family, tmp_path):
    from peft import LoraConfig

    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 4, seed=21, modules=some_modules(linears, family))
    return save_with_diffusers(tmp_path, family, sd, LoraConfig(r=8, lora_alpha=8, target_modules=targets(sd)).to_dict())


def kohya_alphas_and_metadata(pipeline, family, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_models_dir(pipeline) / "adapters" / "style-kohya.safetensors"
    out = tmp_path / "both.safetensors"
    metadata = {"lora_adapter_metadata": json.dumps({"unet.r": 4, "unet.lora_alpha": 4})}
    save_file(load_file(str(path)), str(out), metadata=metadata)
    return out


def kohya_flux_unknown_block(pipeline, family, tmp_path):
    from hotlora.testing import kohya_flux_lora, save_kohya_flux_lora_file

    linears = denoiser_linears(pipeline)
    sd = kohya_flux_lora(linears, flux_double_block_count(linears), rank=4, alpha=4.0, seed=22)
    sd.update({"lora_unet_img_attn_extra.lora_down.weight": torch.randn(4, 32),
               "lora_unet_img_attn_extra.lora_up.weight": torch.randn(32, 4)})
    return save_kohya_flux_lora_file(tmp_path / "unknown.safetensors", sd, rank=4, alpha=4.0)


def tiny_models_dir(pipeline):
    from pathlib import Path

    return Path(pipeline.config._name_or_path)


@pytest.mark.parametrize("family, make, reason", [
    ("sdxl", rank_declared_wrong, r"metadata declares rank 8 for .*, its weights have rank 4"),
    ("flux", rank_declared_wrong, r"metadata declares rank 8 for .*, its weights have rank 4"),
    ("sdxl", kohya_alphas_and_metadata, "carries both kohya-style alphas and lora_adapter_metadata"),
    ("flux", kohya_flux_unknown_block, r"diffusers cannot convert this LoRA for the flux family \(ValueError: Incompatible keys detected"),
])
def test_files_diffusers_refuses_are_refused_with_the_reason(tiny_models, tmp_path, family, make, reason):
    pipeline = fresh_pipeline(tiny_models[family])
    path = make(pipeline, family, tmp_path)
    with pytest.raises(Exception):
        pipeline.load_lora_weights(str(path), adapter_name="ref")
    with pytest.raises(AdapterFormatError, match=reason):
        hotlora_adapter(pipeline, family, path)


def test_a_peft_dora_adapter_is_refused_by_name(pipelines, tmp_path):
    """DoRA rescales the base weight's columns: no slot can hold that. diffusers loads it; hotlora
    refuses it with the reason rather than serving it as a plain LoRA."""
    import copy

    from peft import LoraConfig, get_peft_model

    pipeline = pipelines("flux")
    model = get_peft_model(copy.deepcopy(pipeline.transformer), LoraConfig(r=2, target_modules=["to_q"], use_dora=True))
    model.save_pretrained(str(tmp_path))
    with pytest.raises(AdapterFormatError, match="DoRA adapters cannot be hot-swapped"):
        hotlora_adapter(pipeline, "flux", tmp_path)


# ----------------------------------------------------------------------------- through the engine


def training_script_flux_file(pipeline, tmp_path):
    from peft import LoraConfig

    linears = denoiser_linears(pipeline)
    sd = random_lora(linears, 4, seed=23, modules=some_modules(linears, "flux"))
    path = save_with_diffusers(tmp_path, "flux", sd, LoraConfig(r=4, lora_alpha=8, target_modules=targets(sd)).to_dict())
    return path, str(path)


def sd_scripts_sdxl_file(pipeline, tmp_path):
    """sd-scripts' SDXL file with CLIP-L LoRA: the reference loads all of it, and so does the engine."""
    from safetensors.torch import save_file

    from hotlora.testing import sd_scripts_metadata, sd_scripts_sdxl_lora

    linears = denoiser_linears(pipeline)
    unet_sd = random_lora(linears, 4, seed=24, modules=[m for m in linears if ".attentions." in m])
    te = {"te1": random_lora(linear_layers(pipeline.text_encoder), 2, seed=25)}
    path = tmp_path / "kohya-te.safetensors"
    save_file(sd_scripts_sdxl_lora(unet_sd, pipeline.unet.config.layers_per_block, 2.0, te), str(path),
              metadata=sd_scripts_metadata("sdxl_base_v1-0", 4, 2.0))
    return path, str(path)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and far faster when other processes share the cores
    (OpenMP workers spin-wait for each other: 40x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family, make", [("flux", training_script_flux_file), ("sdxl", sd_scripts_sdxl_file)])
def test_engine_serves_real_tool_files_like_plain_diffusers(tiny_models, pipelines, tmp_path, one_thread, family, make):
    from hotlora import Engine
    from hotlora.testing import plain_diffusers_reference

    path, reference_source = make(pipelines(family), tmp_path)
    engine = Engine.from_pretrained(tiny_models[family], compile=False, target_rank=8, batch_size=2)
    served = engine.generate("a watercolor fox", adapters={"identity": (path, 0.9)}, num_images=1,
                             num_inference_steps=2, seed=3, output_type="latent").images
    expected = plain_diffusers_reference(
        tiny_models[family], {"identity": (reference_source, 0.9)}, prompt="a watercolor fox", num_images=1,
        num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
        width=engine.width, seed=3,
    )
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-4)


def test_hotlora_convert_output_reads_back_equal(pipelines, tmp_path):
    """``hotlora adapters convert`` writes ``^module$`` rank/alpha pattern keys for mixed ranks:
    anchored module names, which hotlora accepts and matches as PEFT does."""
    from hotlora.adapters.format.export import save_as_diffusers

    pipeline = pipelines("sdxl")
    linears = denoiser_linears(pipeline)
    chosen = some_modules(linears, "sdxl")
    source = hotlora_adapter(pipeline, "sdxl", {
        **{f"unet.{k}": v for k, v in random_lora(linears, 4, seed=26, modules=chosen[:-3]).items()},
        **{f"unet.{k}": v for k, v in random_lora(linears, 2, seed=27, modules=chosen[-3:]).items()},
    })
    path = save_as_diffusers(source, tmp_path)
    again = hotlora_adapter(pipeline, "sdxl", path)
    assert {m: w.rank for m, w in again.modules.items()} == {m: w.rank for m, w in source.modules.items()}
    assert_same_deltas(canonical_deltas(again), canonical_deltas(source))
    assert_same_deltas(canonical_deltas(again), diffusers_deltas(pipeline, "sdxl", path))
