"""LoRA biases (PEFT's ``lora_B.bias``; what diffusers makes of lightx2v's ``.diff_b``, the Wan
step/CFG-distill LoRAs users run on nearly every Wan request): read as diffusers reads them, held
by the slots of a family that declares them (``ModelFamily.lora_biases``), served equal to plain
diffusers with the scale folded in, without compiling, and refused by name wherever no bias is
held (fused mode, mixed batches, other families, text encoders)."""

import pytest
import torch

from hotlora import Engine
from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.format.export import save_as_diffusers
from hotlora.adapters.format.validate import SlotCeiling, problems_with
from hotlora.adapters.store.diskcache import deserialize, serialize
from hotlora.errors import AdapterRejected
from hotlora.families import family_named
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK, fresh_pipeline, recompiles_are_errors, served_frames

TOLERANCE = 1e-4
WAN = family_named("wan")


def samples(tiny_models):
    import json

    folder = tiny_models["wan"] / "adapters"
    named = json.loads((folder / "README.json").read_text())
    return {name: folder / named[name] for name in ("style-lightx2v", "identity-diffusers")}


def diffusers_biases(model_dir, path) -> dict[str, torch.Tensor]:
    """module -> the ``lora_B.bias`` plain ``load_lora_weights`` gives it."""
    pipeline = fresh_pipeline(model_dir)
    pipeline.load_lora_weights(str(path), adapter_name="ref")
    return {name: module.lora_B["ref"].bias.detach().clone() for name, module in pipeline.transformer.named_modules()
            if hasattr(module, "lora_B") and "ref" in module.lora_B and module.lora_B["ref"].bias is not None}


def test_lightx2v_biases_are_read_as_diffusers_loads_them_and_survive_cache_and_export(tiny_models, tmp_path):
    model_dir = tiny_models["wan"]
    path = samples(tiny_models)["style-lightx2v"]
    adapter = load_adapter(path, WAN)
    theirs = diffusers_biases(model_dir, path)
    assert adapter.biased and set(adapter.biased) == set(theirs)
    for module in adapter.biased:
        w = adapter.modules[module]
        torch.testing.assert_close(w.scaling * w.bias, theirs[module], atol=0, rtol=0)
        assert w.bias.abs().max() > 0
    # The disk cache keeps them; an export loads back into diffusers with the same biases.
    again = deserialize(serialize(adapter))
    assert all(torch.equal(again.modules[m].bias, adapter.modules[m].bias) for m in adapter.biased)
    exported = save_as_diffusers(adapter, tmp_path / "exported")
    assert {m: b for m, b in diffusers_biases(model_dir, exported).items()}.keys() == theirs.keys()
    for module, bias in diffusers_biases(model_dir, exported).items():
        torch.testing.assert_close(bias, theirs[module], atol=1e-6, rtol=0)


def test_lora_biases_are_refused_by_name_where_no_bias_is_held(tiny_models):
    adapter = load_adapter(samples(tiny_models)["style-lightx2v"], WAN)
    modules = {m: (w.down.shape[1], w.up.shape[0]) for m, w in adapter.modules.items()}
    held = SlotCeiling(modules=modules, target_rank=TARGET_RANK, family="wan", biases=True)
    assert problems_with(adapter, held) == []
    fused = SlotCeiling(modules=modules, target_rank=TARGET_RANK, family="wan", any_rank=True)
    (problem,) = problems_with(adapter, fused)
    assert "LoRA biases" in problem and "adapter_mode='slots', mixed=False" in problem
    wrong = dict(adapter.modules)
    module = adapter.biased[0]
    wrong[module] = type(wrong[module])(wrong[module].down, wrong[module].up, 1.0, torch.zeros(3))
    (problem,) = problems_with(type(adapter)(**{**adapter.__dict__, "modules": wrong}), held)
    assert "shape mismatch" in problem and "bias (3,)" in problem
    # Another family's slots hold none: a PEFT file with lora_bias on Flux is refused as such.
    flux = SlotCeiling(modules=modules, target_rank=TARGET_RANK, family="flux")
    assert any("by no flux engine" in p for p in problems_with(type(adapter)(**{**adapter.__dict__, "family": "flux"}), flux))


@pytest.fixture(scope="module")
def wan_engine(tiny_models):
    with torch._dynamo.config.patch(error_on_recompile=False):  # warm-up compiles by definition
        engine = Engine.from_pretrained(tiny_models["wan"], target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        frames=served_frames(WAN)[:1])
    with recompiles_are_errors():
        yield engine
    assert engine.recompiles == 0


def test_a_lightx2v_lora_with_biases_is_served_equal_to_plain_diffusers(tiny_models, wan_engine):
    """The lightx2v file (a bias on every block Linear) at two scales, beside a LoRA without
    biases, then without it and with nothing: each equal to plain diffusers (``load_lora_weights``
    + ``set_adapters``), none compiling, and the model's LoRA biases zeros again at the end."""
    model_dir, engine = tiny_models["wan"], wan_engine
    found = samples(tiny_models)
    frames = served_frames(WAN)[0]

    def both(adapters):
        ours = engine.generate("a cat", adapters=adapters, num_images=2, num_inference_steps=2, num_frames=frames,
                               output_type="latent").images
        theirs = plain_diffusers_reference(model_dir, adapters, prompt="a cat", num_images=2, num_inference_steps=2,
                                           guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
                                           width=engine.width, seed=0, num_frames=frames)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        return ours

    base = both({})
    distilled = both({"style": (found["style-lightx2v"], 0.7)})
    both({"identity": (found["identity-diffusers"], 0.9), "style": (found["style-lightx2v"], 1.0)})
    both({"identity": (found["identity-diffusers"], 0.9)})
    assert both({"style": (found["style-lightx2v"], 0.7)}).equal(distilled)
    assert (distilled - base).abs().max() > 1e-2
    assert both({}).equal(base)
    biases = [m.lora_B["hotlora_slots"].bias for m in engine.warm.denoiser.modules() if hasattr(m, "lora_B")]
    assert biases and all(not b.any() for b in biases)
    assert engine.describe()["lora_biases"] is True
    assert engine.recompiles == 0


def test_fused_mode_refuses_lora_biases_and_auto_mode_serves_them_through_the_slots(tiny_models):
    model_dir = tiny_models["wan"]
    found = samples(tiny_models)
    frames = served_frames(WAN)[0]
    fused = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, compile=False, adapter_mode="fused",
                                   frames=(frames,))
    with pytest.raises(AdapterRejected, match=r"LoRA biases .* served by the slots \(adapter_mode='slots'"):
        fused.generate("a cat", adapters={"style": (found["style-lightx2v"], 0.7)}, num_inference_steps=2)
    auto = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, compile=False, adapter_mode="auto",
                                  frames=(frames,))
    adapters = {"style": (found["style-lightx2v"], 0.7)}
    result = auto.generate("a cat", adapters=adapters, num_images=1, num_inference_steps=2, num_frames=frames,
                           output_type="latent")
    theirs = plain_diffusers_reference(model_dir, adapters, prompt="a cat", num_images=1, num_inference_steps=2,
                                       guidance_scale=auto.defaults["guidance_scale"], height=auto.height,
                                       width=auto.width, seed=0, num_frames=frames)
    torch.testing.assert_close(result.images, theirs, atol=TOLERANCE, rtol=0)
    assert auto.describe()["batches"]["slots"] >= 1 and auto.describe()["lora_biases"]
    assert not fused.describe()["lora_biases"]
