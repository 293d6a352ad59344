"""Hostile adapter files: whatever the bytes, ``load_adapter`` loads them or raises a RequestError
(422/404 to the client), never another exception, never a hang.

Bounded and derandomized, so CI sees the same examples every run. The module names are real tiny
Flux ones, but no model is built: reading an adapter needs none.
"""

import json
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hotlora.families import family_named
from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.format.lora_config import Patterns as _Patterns
from hotlora.errors import AdapterFormatError, RequestError

from ..helpers import load_outcomes_in_a_new_process

FLUX = family_named("flux")
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MODULES = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.proj_out"]
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "C64", "XX", ""]


def load_or_refuse(source):
    """The property: a loaded adapter, or a RequestError that says something."""
    try:
        adapter = load_adapter(source, FLUX)
    except RequestError as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return None
    event("loaded")
    return adapter


def write(tmp_path, data: bytes):
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(data)
    return path


def safetensors_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def lora_tensors(rank=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for module in MODULES:
        in_f = 64 if module.endswith("proj_out") else 32
        sd[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g).to(dtype)
        sd[f"transformer.{module}.lora_B.weight"] = torch.randn(32, rank, generator=g).to(dtype)
    return sd


# ----------------------------------------------------------------------------- strategies

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from([10**400, "None", "null", "", "(a+)+b", "((\\w+)+)+Q", "^to_q$", "to_q", "all-linear"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)
pattern_keys = st.one_of(
    st.sampled_from(["to_q", "^transformer_blocks.0.attn.to_k", "proj_out$", "attn.to_q", ".*", "(x+x+)+y", "to_[qk]", ""]),
    st.text(alphabet="ato_qk.^$()+*[]\\", max_size=12),
)
# Mostly the weights' true rank (2), so most examples get past the rank check to alphas and patterns.
ranks = st.one_of(st.just(2), st.just(2), st.just(2), st.integers(min_value=-2, max_value=10**30), json_values)
config_fields = st.fixed_dictionaries({"r": ranks}, optional={
    "lora_alpha": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**1100), 2**1100), json_values),
    "rank_pattern": st.one_of(st.dictionaries(pattern_keys, ranks, max_size=3), json_values),
    "alpha_pattern": st.one_of(st.dictionaries(pattern_keys, json_scalars, max_size=3), json_values),
    "target_modules": st.one_of(st.lists(st.sampled_from(MODULES + ["to_q", ".*"]), max_size=3), st.text(max_size=20),
                                json_values),
    "use_rslora": json_values, "use_dora": json_values, "lora_bias": json_values,
    "base_model_name_or_path": json_values, "init_lora_weights": json_values,
    "layers_to_transform": json_values, "layers_pattern": json_values, "exclude_modules": json_values,
    "peft_type": st.sampled_from(["LORA", "LOKR", "nonsense"]),
})


@st.composite
def lora_metadata(draw):
    """The ``lora_adapter_metadata`` header entry: usually prefixed LoraConfig fields, sometimes not
    JSON, not an object, or aimed at another component."""
    kind = draw(st.sampled_from(["config", "config", "config", "json", "text"]))
    if kind == "text":
        return draw(st.text(max_size=40))
    if kind == "json":
        return json.dumps(draw(json_values))
    fields = draw(config_fields)
    prefix = draw(st.sampled_from(["transformer.", "transformer.", "text_encoder.", ""]))
    return json.dumps({f"{prefix}{k}": v for k, v in fields.items()})


# ----------------------------------------------------------------------------- raw bytes


@FUZZ
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes(tmp_path, data):
    load_or_refuse(write(tmp_path, data))


@st.composite
def hand_made_files(draw):
    """A safetensors file assembled by hand: fuzzed entries, offsets, dtypes, shapes, header length."""
    header = {}
    for name in draw(st.lists(st.sampled_from([f"transformer.{m}.lora_{ab}.weight" for m in MODULES for ab in "AB"]
                                              + ["lora_unet_double_blocks_0_img_attn_proj.alpha", "x"]), max_size=4)):
        header[name] = {
            "dtype": draw(st.sampled_from(DTYPES)),
            "shape": draw(st.lists(st.integers(min_value=-1, max_value=2**40), max_size=3)),
            "data_offsets": draw(st.lists(st.integers(min_value=-1, max_value=2**62), min_size=0, max_size=3)),
        }
        if draw(st.booleans()):
            header[name] = draw(json_values)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3), json_values,
            st.fixed_dictionaries({"lora_adapter_metadata": lora_metadata()}),
        ))
    raw = json.dumps(header).encode()
    length = draw(st.one_of(st.just(len(raw)), st.integers(min_value=0, max_value=2**64 - 1)))
    body = draw(st.binary(max_size=64))
    return struct.pack("<Q", length) + raw + body


@FUZZ
@given(data=hand_made_files())
def test_hand_made_safetensors(tmp_path, data):
    load_or_refuse(write(tmp_path, data))


# ----------------------------------------------------------------------------- real tensors, fuzzed metadata


@FUZZ
@given(metadata=lora_metadata(), extra=st.dictionaries(
    st.sampled_from(["base_model", "base_model_name_or_path", "format", "ss_network_alpha", "software"]),
    st.one_of(st.text(max_size=30), st.sampled_from(["x" * 100_000, "None", " null ", "/m/models--a--b/snapshots/c/unet"])),
    max_size=3))
def test_fuzzed_lora_adapter_metadata(tmp_path, metadata, extra):
    header = {**extra, "lora_adapter_metadata": metadata}
    adapter = load_or_refuse(write(tmp_path, safetensors_bytes(lora_tensors(), header)))
    if adapter is not None:
        assert set(adapter.modules) == set(MODULES)
        assert adapter.base_model is None or (adapter.base_model.lower() not in ("none", "null", "")
                                              and len(adapter.base_model) <= 1024)
        assert all(isinstance(w.scaling, float) for w in adapter.modules.values())


@FUZZ
@given(alpha=st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-3, 3)),
       shape=st.sampled_from([(), (1,), (2,), (0,)]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       rank=st.integers(min_value=0, max_value=3))
def test_fuzzed_kohya_flux_alphas(alpha, shape, dtype, rank):
    """diffusers' kohya-Flux converter loops on alpha; a negative one used to never return."""
    key = "lora_unet_double_blocks_0_img_attn_proj"
    sd = {f"{key}.lora_down.weight": torch.randn(rank, 32), f"{key}.lora_up.weight": torch.randn(32, rank),
          f"{key}.alpha": torch.full(shape, alpha).to(dtype)}
    adapter = load_or_refuse(sd)
    if adapter is not None:
        assert set(adapter.modules) == {"transformer_blocks.0.attn.to_out.0"}


@FUZZ
@given(tensors=st.dictionaries(
    st.one_of(st.sampled_from([f"transformer.{m}.lora_{ab}.weight" for m in MODULES for ab in "AB"]
                              + [f"transformer.{MODULES[0]}.lora_B.bias", "transformer.a b.lora_A.weight",
                                 "transformer.x+.lora_B.weight", "text_encoder.q.lora_A.weight"]),
              st.text(max_size=30)),
    st.sampled_from([(), (0,), (2,), (2, 32), (32, 2), (0, 32), (32, 0), (2, 32, 1), (3, 32), (32, 3)]),
    max_size=6))
def test_fuzzed_keys_and_shapes(tensors):
    sd = {k: torch.ones(shape) for k, shape in tensors.items()}
    load_or_refuse(sd)


# ----------------------------------------------------------------------------- pattern keys


@FUZZ
@given(keys=st.lists(st.text(alphabet="ab._^$", min_size=1, max_size=6), max_size=6, unique=True),
       module=st.text(alphabet="ab._", min_size=1, max_size=8))
def test_pattern_lookup_is_what_peft_matches(keys, module):
    """For module-name keys, hotlora's lookup picks the key PEFT's regex lookup picks."""
    from peft.utils.other import get_pattern_key

    from hotlora.adapters.format.lora_config import PATTERN_KEY

    keys = [k for k in keys if PATTERN_KEY.fullmatch(k)]
    patterns = {k: i for i, k in enumerate(keys)}
    expected = patterns.get(get_pattern_key(patterns.keys(), module), "default")
    assert _Patterns(patterns, "rank_pattern", "t", 1).get(module, "default") == expected


@pytest.mark.parametrize("key", ["(a+)+b", "((\\w+)+)+Q", "to_[qk]", ".*to_q", "a|b", "x{1,9}", "^", "a" * 300])
def test_pattern_keys_that_are_not_module_names_are_refused(key):
    with pytest.raises(AdapterFormatError, match="is not a module name"):
        _Patterns({key: 4}, "rank_pattern", "t", 1)


def test_too_many_pattern_keys_are_refused():
    with pytest.raises(AdapterFormatError, match="key-module pairs"):
        _Patterns({f"m{i}": 1 for i in range(4000)}, "alpha_pattern", "t", 4000)


# A regex PEFT would run against every module name: it never returns on names like Flux's.
CATASTROPHIC = "((\\w+)+)+Q"


def test_a_catastrophic_metadata_regex_is_never_run(tmp_path):
    """One file per field PEFT would run as a regex."""
    from peft import LoraConfig

    paths = []
    for field in ("rank_pattern", "alpha_pattern", "target_modules"):
        value = CATASTROPHIC if field == "target_modules" else {CATASTROPHIC: 2}
        config = LoraConfig(r=2, lora_alpha=2, **{"target_modules": MODULES, field: value}).to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        header = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
        paths.append(tmp_path / f"{field}.safetensors")
        paths[-1].write_bytes(safetensors_bytes(lora_tensors(), header))
    rank, alpha, targets = load_outcomes_in_a_new_process(paths, "flux")
    for line, field in ((rank, "rank_pattern"), (alpha, "alpha_pattern")):
        assert line.startswith("REFUSED") and f"{field} key" in line and "is not a module name" in line
    assert targets.startswith("LOADED")  # target_modules is never used: the modules are the ones the weights name


def test_alpha_values_that_are_not_numbers_are_refused(tmp_path):
    header = {"lora_adapter_metadata": json.dumps({"transformer.r": 2, "transformer.lora_alpha": "two"})}
    with pytest.raises(AdapterFormatError, match="lora_alpha of .* is 'two', not a finite number"):
        load_adapter(write(tmp_path, safetensors_bytes(lora_tensors(), header)), FLUX)
    header = {"lora_adapter_metadata": json.dumps({"transformer.r": 2, "transformer.lora_alpha": 10**400})}
    with pytest.raises(AdapterFormatError, match="not a finite number"):
        load_adapter(write(tmp_path, safetensors_bytes(lora_tensors(), header)), FLUX)
    assert math.isfinite(load_adapter(lora_tensors(), FLUX).modules[MODULES[0]].scaling)


def test_a_negative_kohya_flux_alpha_is_refused_not_looped_on(tmp_path):
    """diffusers' kohya-Flux converter halves and doubles until ``scale_down * 2 >= scale_up``:
    with a negative alpha that never happens (it used to hang this call forever)."""
    key = "lora_unet_double_blocks_0_img_attn_proj"
    sd = {f"{key}.lora_down.weight": torch.randn(2, 32), f"{key}.lora_up.weight": torch.randn(32, 2),
          f"{key}.alpha": torch.tensor(-1.0)}
    path = write(tmp_path, safetensors_bytes(sd, {"ss_network_alpha": "-1.0"}))
    (outcome,) = load_outcomes_in_a_new_process([path], "flux")
    assert outcome.startswith("REFUSED") and f"negative alpha in {key}.alpha" in outcome


def test_made_up_sgm_block_numbers_are_refused_before_diffusers_scans_them():
    """diffusers' SGM block mapping is quadratic in distinct block numbers (4000 took 9 s)."""
    from diffusers import UNet2DConditionModel

    config = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=1,
                                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32).config
    sd = {}
    for i in range(4000):
        key = f"lora_unet_input_blocks_{i + 1}_1_proj_in"
        sd.update({f"{key}.lora_down.weight": torch.zeros(0), f"{key}.lora_up.weight": torch.zeros(0)})
    with pytest.raises(AdapterFormatError, match="4000 distinct SGM U-Net block numbers"):
        load_adapter(sd, family_named("sdxl"), denoiser_config=config)
