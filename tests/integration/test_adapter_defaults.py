"""A step-distilled adapter's declared steps and guidance, through the warm compiled engine: a request
that leaves them open runs at them and says so; one that sets them runs at its own; a declared value
the engine cannot serve is refused at prepare, and nothing of it compiles."""

import pytest
import torch

from hotlora import Engine
from hotlora.settings import RequestLimits
from hotlora.errors import AdapterFormatError, InvalidRequest
from hotlora.testing import declare_defaults

from ..helpers import TARGET_RANK, recompiles_are_errors

MAX_STEPS = 8


@pytest.fixture(scope="module")
def flux(tiny_models, tmp_path_factory):
    """A compiled tiny Flux (its model's default: 4 steps) and adapters declaring 2 steps, 3 steps,
    and an unservable 50."""
    model = tiny_models["flux"]
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        limits=RequestLimits(max_steps=MAX_STEPS))
    root = tmp_path_factory.mktemp("declared")
    samples = model / "adapters"
    adapters = {
        "two": declare_defaults(samples / "identity-diffusers", root / "two.safetensors",
                                num_inference_steps=2, guidance_scale=2.5),
        "three": declare_defaults(samples / "style-diffusers", root / "three.safetensors", num_inference_steps=3),
        "fifty": declare_defaults(samples / "style-diffusers", root / "fifty.safetensors", num_inference_steps=50),
        "plain": samples / "style-diffusers",
    }
    return engine, adapters


def steps_run(engine, **kwargs):
    """The result and how many denoising steps it ran (the progress callback's count)."""
    calls = []
    result = engine.generate("a cat", output_type="latent", progress=lambda done, total: calls.append((done, total)),
                             **kwargs)
    return result, calls


def test_declared_steps_are_used_and_reported_and_the_requests_own_win(flux):
    engine, adapters = flux
    with recompiles_are_errors():
        plain, calls = steps_run(engine, adapters={"style": str(adapters["plain"])})
        assert len(calls) == 4 and plain.adapter_defaults == {}  # the model's default

        declared, calls = steps_run(engine, adapters={"identity": str(adapters["two"]), "style": str(adapters["plain"])})
        assert calls == [(1, 2), (2, 2)]
        assert declared.adapter_defaults == {"num_inference_steps": {"value": 2, "slots": ["identity"]},
                                             "guidance_scale": {"value": 2.5, "slots": ["identity"]}}
        # The same request with those values set by hand gives the same latents: they were applied.
        explicit = engine.generate("a cat", output_type="latent", num_inference_steps=2, guidance_scale=2.5,
                                   adapters={"identity": str(adapters["two"]), "style": str(adapters["plain"])})
        torch.testing.assert_close(declared.images, explicit.images, atol=0, rtol=0)
        assert explicit.adapter_defaults == {}  # the request set both: nothing came from the adapter

        own, calls = steps_run(engine, num_inference_steps=3, adapters={"identity": str(adapters["two"])})
        assert len(calls) == 3
        assert own.adapter_defaults == {"guidance_scale": {"value": 2.5, "slots": ["identity"]}}
    assert engine.recompiles == 0


def test_disagreeing_or_unservable_declarations_are_refused_before_the_model(flux):
    engine, adapters = flux
    with recompiles_are_errors():
        with pytest.raises(InvalidRequest, match=r"different num_inference_steps \(\[identity\] 2, \[style\] 3\)"):
            engine.prepare("a cat", adapters={"identity": str(adapters["two"]), "style": str(adapters["three"])})
        settled, calls = steps_run(engine, num_inference_steps=1,
                                   adapters={"identity": str(adapters["two"]), "style": str(adapters["three"])})
        assert len(calls) == 1

        with pytest.raises(InvalidRequest, match=rf"num_inference_steps must be an integer in 1..{MAX_STEPS} "
                                                 r"\(with the adapters' declared defaults: num_inference_steps 50 "
                                                 r"from \[identity\]"):
            engine.prepare("a cat", adapters={"identity": str(adapters["fifty"])})
        # At scale 0 a slot writes nothing and declares nothing.
        off, calls = steps_run(engine, adapters={"identity": (str(adapters["fifty"]), 0.0)})
        assert len(calls) == 4 and off.adapter_defaults == {}
    assert engine.recompiles == 0


def test_a_malformed_declaration_is_the_files_error(flux, tmp_path):
    engine, adapters = flux
    bad = declare_defaults(adapters["plain"], tmp_path / "bad.safetensors", num_inference_steps="four")
    with pytest.raises(AdapterFormatError, match="hotlora.num_inference_steps in the header is 'four'"):
        engine.prepare("a cat", adapters={"style": str(bad)})


def test_a_catalog_entry_declares_defaults_over_its_files(flux, tmp_path):
    """Released distill LoRAs carry no such header: the operator's catalog entry declares them, and
    its word is over the file's; the same file by path keeps its own."""
    from hotlora.adapters.store import AdapterStore
    from hotlora.engine.request import GenerationRequest
    from hotlora.families import family_named
    from hotlora.settings import StoreConfig

    engine, adapters = flux
    (tmp_path / "catalog.toml").write_text(
        f'[adapters.turbo]\nref = "{adapters["plain"]}"\nnum_inference_steps = 3\nguidance_scale = 1.0\n'
        f'[adapters.two-as-one]\nref = "{adapters["two"]}"\nnum_inference_steps = 1\n')
    store = AdapterStore(StoreConfig(cache_dir=tmp_path / "cache",
                                     local_roots=(adapters["plain"].parent, adapters["two"].parent)),
                         family_named("flux"), catalog=tmp_path / "catalog.toml")
    try:
        def run(ref):
            calls = []
            request = GenerationRequest(prompt="a cat", output_type="latent", adapters={"identity": ref},
                                        progress=lambda done, total: calls.append(done))
            checked = engine.check(request, default_scale=store.default_scale)
            fetched = {slot: store.get(spec.ref) for slot, spec in checked.specs.items()}
            return engine.run(engine.prepare(checked, fetched=fetched)), calls

        with recompiles_are_errors():
            result, calls = run("turbo")
            assert len(calls) == 3 and result.adapter_defaults["guidance_scale"] == {"value": 1.0, "slots": ["identity"]}
            result, calls = run("catalog:two-as-one")  # the entry's steps over the header's, its guidance kept
            assert len(calls) == 1 and result.adapter_defaults == {
                "num_inference_steps": {"value": 1, "slots": ["identity"]},
                "guidance_scale": {"value": 2.5, "slots": ["identity"]}}
            result, calls = run(str(adapters["two"]))  # the file by path: its own header
            assert len(calls) == 2
            result, calls = run(str(adapters["plain"]))
            assert len(calls) == 4 and result.adapter_defaults == {}
        assert engine.recompiles == 0
    finally:
        store.close()
