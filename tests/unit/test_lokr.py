"""LyCORIS LoKr as exact low-rank updates: the delta PEFT's LoKr layer computes, to float32 rounding,
for full and decomposed factors, with and without a LoKrConfig, and split exactly over a fused
projection."""

import pytest
import torch

from hotlora.adapters.format.lokr import lokr_modules
from hotlora.errors import AdapterFormatError


def peft_lokr(in_features, out_features, r, alpha, decompose_both, factor, seed):
    from peft import LoKrConfig, get_peft_model

    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("lin", torch.nn.Linear(in_features, out_features))
    config = LoKrConfig(r=r, alpha=alpha, target_modules=["lin"], decompose_both=decompose_both,
                        decompose_factor=factor, init_weights=False)
    wrapped = get_peft_model(model, config)
    layer = wrapped.base_model.model.lin
    factors = {f"lin.{name}": getattr(layer, name)["default"].detach().clone()
               for name in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
               if "default" in getattr(layer, name)}
    return factors, layer.get_delta_weight("default").detach(), config


@pytest.mark.parametrize("r, decompose_both, factor", [(2, False, 4), (2, True, 4), (64, False, 4), (3, False, -1)])
def test_the_exact_low_rank_form_is_peft_s_lokr_delta(r, decompose_both, factor):
    factors, expected, config = peft_lokr(48, 32, r, alpha=2 * r, decompose_both=decompose_both, factor=factor, seed=r)
    weights = lokr_modules(factors, {"r": config.r, "alpha": config.alpha}, "test")["lin"]
    ours = weights.scaling * weights.up @ weights.down
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    assert weights.rank == weights.down.shape[0] <= min(48, 32) * 2


def test_without_a_config_the_baked_factors_are_taken_at_scale_one():
    factors, expected, config = peft_lokr(48, 32, 2, alpha=2, decompose_both=False, factor=4, seed=0)
    weights = lokr_modules(factors, None, "test")["lin"]
    assert weights.scaling == 1.0
    torch.testing.assert_close(weights.up @ weights.down, expected, atol=1e-6, rtol=1e-5)


def test_a_fused_projection_splits_into_its_parts_exactly():
    g = torch.Generator().manual_seed(0)
    factors = {"blocks.0.attn.to_qkv.lokr_w1": torch.randn(3, 2, generator=g),
               "blocks.0.attn.to_qkv.lokr_w2_a": torch.randn(8, 2, generator=g),
               "blocks.0.attn.to_qkv.lokr_w2_b": torch.randn(2, 8, generator=g)}
    delta = torch.kron(factors["blocks.0.attn.to_qkv.lokr_w1"],
                       factors["blocks.0.attn.to_qkv.lokr_w2_a"] @ factors["blocks.0.attn.to_qkv.lokr_w2_b"])
    modules = lokr_modules(factors, None, "test")
    assert sorted(modules) == ["blocks.0.attn.to_k", "blocks.0.attn.to_q", "blocks.0.attn.to_v"]
    parts = [modules[f"blocks.0.attn.to_{p}"] for p in "qkv"]
    torch.testing.assert_close(torch.cat([w.up @ w.down for w in parts]), delta, atol=1e-6, rtol=1e-5)


def test_what_is_not_a_linear_lokr_is_refused():
    with pytest.raises(AdapterFormatError, match="conv or Tucker"):
        lokr_modules({"m.lokr_w1": torch.randn(2, 2), "m.lokr_w2": torch.randn(2, 2, 3, 3)}, None, "test")
    with pytest.raises(AdapterFormatError, match="matching rank"):
        lokr_modules({"m.lokr_w1": torch.randn(2, 2), "m.lokr_w2_a": torch.randn(4, 3)}, None, "test")
    with pytest.raises(AdapterFormatError, match="not LoKr factors"):
        lokr_modules({"m.lokr_w1": torch.randn(2, 2), "m.hada_w1_a": torch.randn(4, 3)}, None, "test")


def test_factors_that_would_expand_past_the_bound_are_refused_before_expanding(monkeypatch):
    """Small full factors expand to layer-sized matrices: the total is bounded before any kron."""
    import hotlora.adapters.format.lokr as lokr

    monkeypatch.setattr(lokr, "MAX_LOKR_ELEMENTS", 10_000)
    many = {f"m{i}.{part}": torch.randn(8, 8) for i in range(8) for part in ("lokr_w1", "lokr_w2")}
    called = []
    monkeypatch.setattr(torch, "kron", lambda *a: called.append(a))
    with pytest.raises(AdapterFormatError, match="expand to"):
        lokr.lokr_modules(many, None, "test")
    assert not called
