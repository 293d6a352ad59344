"""A LyCORIS LoKr file, as ai-toolkit writes one for Z-Image (``diffusion_model.`` keys, ``lokr_w1``
with ``lokr_w2_a``/``lokr_w2_b`` and an alpha), served equal to plain diffusers' ``load_lora_weights``
(PEFT's LoKr layers): by the slots when its exact low-rank form fits the target rank, by fused mode
at any rank, the slots' refusal of a larger one naming fused mode."""

import pytest
import torch
from safetensors.torch import save_file

from hotlora import Engine
from hotlora.errors import AdapterRejected
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK

TOLERANCE = 1e-4
MODULES = ("layers.0.attention.to_q", "layers.0.attention.to_k", "layers.0.attention.to_v",
           "layers.0.attention.to_out.0", "layers.1.feed_forward.w2")


def lokr_file(path, denoiser, rank: int, seed: int):
    """The factors PEFT's own LoKr layers make for ``MODULES`` (decompose factor 4, ``rank``; which
    factors are decomposed is PEFT's choice per layer shape), random, saved as ai-toolkit writes
    them: ``diffusion_model.`` keys and an alpha of 2 x rank per module."""
    import copy

    from peft import LoKrConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = inject_adapter_in_model(LoKrConfig(r=rank, alpha=rank, decompose_factor=4, target_modules=list(MODULES),
                                               init_weights=False), copy.deepcopy(denoiser))
    sd = {}
    for name, value in model.state_dict().items():
        if ".lokr_" in name:
            module, _, part = name.rpartition(".lokr_")
            sd[f"diffusion_model.{module.removesuffix('.base_layer')}.lokr_{part.removesuffix('.default')}"] = \
                value.detach().clone() * 0.5
    for module in MODULES:
        sd[f"diffusion_model.{module}.alpha"] = torch.tensor(2.0 * rank)
    save_file(sd, str(path))
    return path


@pytest.fixture(scope="module")
def zimage(tiny_models):
    return tiny_models["zimage"]


def generate(engine, adapters):
    return engine.generate("a lighthouse", adapters=adapters, num_images=2, num_inference_steps=2, seed=1,
                           output_type="latent").images


def reference(model, engine, adapters):
    return plain_diffusers_reference(model, adapters, prompt="a lighthouse", num_images=2, num_inference_steps=2,
                                     guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
                                     width=engine.width, seed=1)


def test_a_lokr_is_served_equal_to_plain_diffusers(zimage, tmp_path):
    slots = Engine.from_pretrained(zimage, target_rank=TARGET_RANK, compile=False)
    small = {"identity": (lokr_file(tmp_path / "small.safetensors", slots.denoiser, rank=2, seed=0), 0.8)}
    big = {"identity": (lokr_file(tmp_path / "big.safetensors", slots.denoiser, rank=4, seed=1), 0.7)}
    base = generate(slots, {})
    ours = generate(slots, small)
    theirs = reference(zimage, slots, small)
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (theirs - base).abs().max().item() > 100 * TOLERANCE  # the LoKr moved the output
    assert slots.load_adapter(str(small["identity"][0])).layout == "lycoris-lokr"
    with pytest.raises(AdapterRejected, match="exact low-rank form of a LyCORIS LoKr: fused mode"):
        generate(slots, big)  # rank 4 x 4 = 16 over the target rank 8

    fused = Engine.from_pretrained(zimage, target_rank=TARGET_RANK, compile=False, adapter_mode="fused")
    for adapters in (big, small):
        assert (generate(fused, adapters) - reference(zimage, fused, adapters)).abs().max().item() <= TOLERANCE
    torch.testing.assert_close(generate(fused, {}), base, atol=TOLERANCE, rtol=0)  # the base restored
