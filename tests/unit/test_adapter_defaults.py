"""The inference defaults an adapter declares: reading them from the header, and the rules that merge
a request's adapters' declarations (hotlora.adapters.defaults)."""

import pytest

from hotlora.adapters.defaults import merge, read_declared
from hotlora.errors import AdapterFormatError, InvalidRequest

OPEN = {"num_inference_steps": None, "guidance_scale": None}


def test_declared_values_are_read_from_the_hotlora_keys_only():
    meta = {"hotlora.num_inference_steps": "4", "hotlora.guidance_scale": " 1.5 ", "ss_steps": "2000",
            "num_inference_steps": "8", "format": "pt"}
    assert read_declared(meta, "a") == {"num_inference_steps": 4, "guidance_scale": 1.5}
    assert read_declared({"hotlora.guidance_scale": "0"}, "a") == {"guidance_scale": 0.0}
    assert read_declared({"hotlora.shift": "5"}, "a") == {"shift": 5.0}
    assert read_declared({}, "a") == {} and read_declared(None, "a") == {}


@pytest.mark.parametrize("key, raw", [
    ("num_inference_steps", "four"), ("num_inference_steps", "0"), ("num_inference_steps", "4.5"),
    ("num_inference_steps", "9" * 40), ("guidance_scale", "nan"), ("guidance_scale", "-1"),
    ("guidance_scale", "inf"), ("guidance_scale", ""), ("shift", "0"), ("shift", "-3"), ("shift", "nan"),
])
def test_a_value_that_is_not_one_is_the_files_error_naming_its_key(key, raw):
    with pytest.raises(AdapterFormatError, match=f"a.safetensors: hotlora.{key} in the header is"):
        read_declared({f"hotlora.{key}": raw}, "a.safetensors")


def test_open_parameters_take_the_declared_values_with_the_slots_that_declared_them():
    applied = merge({"distill": {"num_inference_steps": 4, "guidance_scale": 1.0}, "style": {}}, OPEN)
    assert applied == {"num_inference_steps": {"value": 4, "slots": ["distill"]},
                       "guidance_scale": {"value": 1.0, "slots": ["distill"]}}


def test_a_value_the_request_sets_wins_and_settles_a_disagreement():
    declared = {"a": {"num_inference_steps": 4, "guidance_scale": 1.0}, "b": {"num_inference_steps": 8}}
    applied = merge(declared, {"num_inference_steps": 20, "guidance_scale": None})
    assert applied == {"guidance_scale": {"value": 1.0, "slots": ["a"]}}
    assert merge(declared, {"num_inference_steps": 20, "guidance_scale": 3.0}) == {}


def test_adapters_that_agree_are_both_named():
    applied = merge({"b": {"guidance_scale": 1}, "a": {"guidance_scale": 1.0}}, OPEN)
    assert applied == {"guidance_scale": {"value": 1, "slots": ["a", "b"]}}


def test_adapters_that_disagree_on_an_open_parameter_are_refused_with_both_values():
    declared = {"lightning": {"num_inference_steps": 4, "guidance_scale": 0.0},
                "hyper": {"num_inference_steps": 8, "guidance_scale": 1.0}}
    with pytest.raises(InvalidRequest) as caught:
        merge(declared, OPEN)
    message = str(caught.value)
    assert "different num_inference_steps ([hyper] 8, [lightning] 4); set num_inference_steps" in message
    assert "different guidance_scale ([hyper] 1, [lightning] 0); set guidance_scale" in message


def test_a_catalog_entry_declares_defaults_and_a_bad_one_is_a_start_up_error(tmp_path):
    from hotlora.adapters.store.catalog import CatalogError, load_catalog

    path = tmp_path / "catalog.toml"
    path.write_text('[adapters.turbo]\nref = "/x.safetensors"\nnum_inference_steps = 4\nguidance_scale = 0\n'
                    'shift = 5\n[adapters.plain]\nref = "/y.safetensors"\n')
    catalog = load_catalog(path)
    assert catalog["turbo"].declared == (("num_inference_steps", 4), ("guidance_scale", 0.0), ("shift", 5.0))
    assert catalog["plain"].declared == ()
    for bad in ('num_inference_steps = 0', 'num_inference_steps = 4.5', 'num_inference_steps = true',
                'guidance_scale = -1.0', 'guidance_scale = "1"', 'shift = 0', 'shift = nan'):
        path.write_text(f'[adapters.turbo]\nref = "/x.safetensors"\n{bad}\n')
        with pytest.raises(CatalogError, match="entry 'turbo' has"):
            load_catalog(path)
