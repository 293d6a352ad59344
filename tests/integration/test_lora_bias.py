"""LoRA biases (PEFT's ``lora_B.bias``; what diffusers makes of lightx2v's ``.diff_b``, the Wan
step/CFG-distill LoRAs users run on nearly every Wan request): read as diffusers reads them, held
by the slots of a family that declares them (``ModelFamily.lora_biases``), served equal to plain
diffusers with the scale folded in, without compiling, and refused by name wherever no bias is
held (fused mode, other families, text encoders); mixed batches hold one bias row per bank entry."""

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

from ..helpers import PackRequest, TARGET_RANK, fresh_pipeline, generate_batch, recompiles_are_errors, served_frames

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
    # Another family's slots hold none (a PEFT file with lora_bias on Flux): fused mode is named.
    flux = SlotCeiling(modules=modules, target_rank=TARGET_RANK, family="flux")
    (problem,) = problems_with(type(adapter)(**{**adapter.__dict__, "family": "flux"}), flux)
    assert "the flux slots hold no LoRA bias" in problem and "adapter_mode='fused'" in problem
    # Fused mode merges into a layer's own bias: a Linear without one cannot take a LoRA bias.
    module = adapter.biased[0]
    (problem,) = problems_with(adapter, SlotCeiling(modules=modules, target_rank=TARGET_RANK, family="wan",
                                                    any_rank=True, biases=True, unbiased=frozenset({module})))
    assert "without a bias of their own" in problem and module in problem
    wrong = dict(adapter.modules)
    wrong[module] = type(wrong[module])(wrong[module].down, wrong[module].up, 1.0, torch.zeros(3))
    (problem,) = problems_with(type(adapter)(**{**adapter.__dict__, "modules": wrong}), held)
    assert "shape mismatch" in problem and "bias (3,)" in problem


def test_slots_over_a_quantized_base_hold_no_lora_bias_and_say_so(tiny_models):
    """An int8 base (torchao): PEFT's LoRA layer on a quantized weight takes no ``lora_bias``, so the
    Wan slots are built without (the engine starts, where it once failed inside PEFT), a bias-free
    LoRA is served, and lightx2v's is refused naming the quantized base, nothing run."""
    found, frames = samples(tiny_models), served_frames(WAN)[0]
    engine = Engine.from_pretrained(tiny_models["wan"], target_rank=TARGET_RANK, compile=False, frames=(frames,),
                                    base_quantization="int8_weight_only")
    assert engine.describe()["lora_biases"] is False

    def run(adapters):
        return engine.generate("a cat", adapters=adapters, num_inference_steps=2, num_frames=frames,
                               output_type="latent").images

    base = run({})
    assert (run({"identity": (found["identity-diffusers"], 0.9)}) - base).abs().max() > 1e-3
    with pytest.raises(AdapterRejected, match=r"the wan slots over a quantized base hold no LoRA bias .*\(mixed=True\)"):
        run({"style": (found["style-lightx2v"], 1.0)})
    assert run({}).equal(base)


def served_like_diffusers(engine, model_dir, adapters, num_images: int) -> torch.Tensor:
    """The engine's latents for ``adapters`` (two steps, the served frame count), checked against
    plain diffusers' (``load_lora_weights`` + ``set_adapters``) within TOLERANCE."""
    frames = served_frames(WAN)[0]
    ours = engine.generate("a cat", adapters=adapters, num_images=num_images, num_inference_steps=2,
                           num_frames=frames, output_type="latent").images
    theirs = plain_diffusers_reference(model_dir, adapters, prompt="a cat", num_images=num_images,
                                       num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"],
                                       height=engine.height, width=engine.width, seed=0, num_frames=frames)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    return ours


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

    def both(adapters):
        return served_like_diffusers(engine, model_dir, adapters, num_images=2)

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


@pytest.mark.parametrize("mode", ["fused", "auto"])
def test_fused_and_auto_modes_merge_lora_biases_equal_to_plain_diffusers(tiny_models, mode):
    """Fused mode merges each LoRA bias into its layer's bias (from a pristine copy): lightx2v, then a
    bias-free LoRA (the biases back to b0 where only the first touched them), then nothing, each equal
    to plain diffusers; the weights and biases are the base's bit for bit at the end. Auto mode
    (float32: every merge keeps its delta) serves it the same way."""
    model_dir = tiny_models["wan"]
    found = samples(tiny_models)
    frames = served_frames(WAN)[0]
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, compile=False, adapter_mode=mode,
                                    frames=(frames,))
    assert engine.describe()["lora_biases"]
    base = {n: p.detach().clone() for n, p in engine.warm.denoiser.named_parameters() if "lora_" not in n}

    def both(adapters):
        served_like_diffusers(engine, model_dir, adapters, num_images=1)

    both({"style": (found["style-lightx2v"], 0.7), "identity": (found["identity-diffusers"], 0.5)})
    both({"identity": (found["identity-diffusers"], 0.9)})
    both({"style": (found["style-lightx2v"], 1.3)})
    both({})
    changed = [n for n, p in engine.warm.denoiser.named_parameters() if n in base and not torch.equal(p, base[n])]
    assert not changed, changed[:5]
    if mode == "auto":
        assert engine.describe()["batches"]["fused"] >= 3


def test_a_mixed_batch_gives_each_request_its_own_lora_biases(tiny_models):
    """One forward batch of three requests (lightx2v at two scales, and a bias-free LoRA), in two
    orders, then batches whose adapters take the entries of earlier ones (the bank recycled: a
    bias-free adapter in an entry that held a bias): each equal to its own plain diffusers result."""
    model_dir = tiny_models["wan"]
    found = samples(tiny_models)
    frames = served_frames(WAN)[0]
    engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=3, compile=False, mixed=True,
                                    bank_entries=5, frames=(frames,))
    assert engine.describe()["lora_biases"]
    requests = [PackRequest("a cat", {"style": (found["style-lightx2v"], 0.7)}, seed=1),
                PackRequest("a dog", {"identity": (found["identity-diffusers"], 0.9)}, seed=2),
                PackRequest("a cat", {"style": (found["style-lightx2v"], 1.2), "identity": (found["identity-diffusers"], 0.5)},
                            seed=3)]
    # Four new bias-free adapter sets take every entry of the bank, the two that held lightx2v's biases among them.
    recycled = [PackRequest("a dog", {"identity": (found["identity-diffusers"], 0.2),
                                      "style": (found["identity-diffusers"], 0.3)}, seed=5),
                PackRequest("a cat", {"identity": (found["identity-diffusers"], 0.4),
                                      "style": (found["identity-diffusers"], 0.6)}, seed=4)]
    for order in (requests, requests[::-1], recycled, requests[:2]):
        results = generate_batch(engine, order, num_inference_steps=2, num_frames=frames, output_type="latent")
        for request, result in zip(order, results):
            theirs = plain_diffusers_reference(model_dir, request.adapters, prompt=request.prompt, num_images=1,
                                               num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"],
                                               height=engine.height, width=engine.width, seed=request.seed,
                                               num_frames=frames)
            torch.testing.assert_close(result.images, theirs, atol=TOLERANCE, rtol=0)
        if order is recycled:  # the bank's bias rows are zeros again
            assert all(not layer.lora_bias.any() for layer in engine.writer._layers.values())


def test_auto_mode_refuses_lora_biases_that_only_the_slots_of_another_family_would_have_to_hold(tiny_models):
    """Flux's slots hold no LoRA bias: in auto mode a biased Flux LoRA goes fused, and when the merge
    would keep too little for fused_min_kept it is refused by name, never served without its biases."""
    from safetensors.torch import load_file

    from hotlora.adapters.binding import Binding
    from hotlora.engine.writers.auto import AutoWriter

    flux = family_named("flux")
    path = tiny_models["flux"] / "adapters" / "identity-diffusers" / "pytorch_lora_weights.safetensors"
    raw = load_file(str(path))
    raw.update({k.replace(".weight", ".bias"): torch.full(v.shape[:1], 0.1) for k, v in list(raw.items())
                if ".lora_B." in k and k.startswith("transformer.")})
    denoiser = fresh_pipeline(tiny_models["flux"]).transformer
    adapter = load_adapter(raw, flux, denoiser_config=denoiser.config)
    assert adapter.biased
    auto = AutoWriter(denoiser, "flux", ("identity",), TARGET_RANK, min_kept=2.0)  # no merge keeps enough
    assert not auto.slots.ceiling.biases and problems_with(adapter, auto.ceiling) == []
    with pytest.raises(AdapterRejected, match="LoRA biases are held by no flux slot"):
        auto.prepare({"identity": Binding(adapter, 1.0)})
    auto.min_kept = 0.0
    auto.prepare({"identity": Binding(adapter, 1.0)})  # fused: served with its biases
    assert auto.bind([{"identity": Binding(adapter, 1.0)}]).fused["identity"]["mode"] == "fused"
