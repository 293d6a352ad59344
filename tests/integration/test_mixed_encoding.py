"""Mixed batches and the prompt encoding: a request merged into another's forward batch gets
exactly what it gets alone, whatever the other requests' prompts, negative prompts and text parts
(pivotal-tuning embeddings, text-encoder LoRA). SDXL encodes a missing negative prompt as zeros
(``force_zeros_for_empty_prompt``) and a given one, even "", through the text encoders; both kinds
in one batch must keep their own. On the session's compiled ``mixed`` engines, within 1e-4 (float32)."""

import pytest

from hotlora.families import family_named
from hotlora.errors import InvalidRequest
from hotlora.testing import denoiser_linears, random_embeddings, random_lora, save_pivotal_lora, text_encoder_linears

from ..helpers import PackRequest, fresh_pipeline, generate_batch, recompiles_are_errors

TOLERANCE = 1e-4
STEPS = 2
PIVOTAL_PROMPT = "a photo of <s0><s1> in a garden"


@pytest.fixture(autouse=True)
def no_recompiles(mixed):
    with recompiles_are_errors():
        yield


@pytest.fixture(scope="module")
def pivotal(mixed, tmp_path_factory):
    """One adapter with denoiser and text-encoder LoRA and embeddings for ``<s0>`` and ``<s1>``."""
    family, model_dir, _, _ = mixed
    reference = fresh_pipeline(model_dir)
    linears = denoiser_linears(reference)
    texts = {te: random_lora(text_encoder_linears(reference, te), 4, seed=91 + i, strength=1.5)
             for i, te in enumerate(family_named(family).lora_text_encoders)}
    return save_pivotal_lora(tmp_path_factory.mktemp(f"encoding-{family}") / "user", family,
                             random_lora(linears, 4, seed=90, modules=sorted(linears)[::3]), texts, alpha=4,
                             embeddings=random_embeddings(reference, family, 2, seed=92))


def _differences(engine, requests, **shared) -> list[float]:
    """Each request's largest difference from its answer alone."""
    results = generate_batch(engine, requests, num_inference_steps=STEPS, output_type="latent", **shared)
    diffs = []
    for request, result in zip(requests, results):
        alone = engine.generate(request.prompt, adapters=request.adapters, num_images=request.num_images,
                                seed=request.seed, negative_prompt=request.negative_prompt,
                                num_inference_steps=STEPS, output_type="latent", **shared)
        diffs.append((result.images - alone.images).abs().max().item())
    return diffs


@pytest.mark.parametrize("mixed", ["sdxl"], indirect=True)
@pytest.mark.parametrize("guidance", [None, 1.0], ids=["cfg", "no-cfg"])
def test_sdxl_negative_prompts_given_or_not_in_one_batch(mixed, pivotal, guidance):
    family, model_dir, engine, pool = mixed
    batches = [
        # Nothing but the negative prompt differs: the pipeline encodes the batch itself.
        [PackRequest("a cat", seed=1), PackRequest("a red house", seed=2, negative_prompt="blurry, dark")],
        # "" is a negative prompt (encoded), None is none (zeros).
        [PackRequest("a cat", num_images=2, seed=3), PackRequest("a cat", seed=5, negative_prompt="")],
        # One text state (the same pivotal adapter and scale), negative prompts given or not.
        [PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 1.0), "style": (pool[2], 0.5)}, seed=6,
                     negative_prompt="dark <s0>"),
         PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 1.0), "style": (pool[0], 1.2)}, num_images=2, seed=7)],
        # Several text states, one of them with and without negative prompts: encoded group by group.
        [PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 1.0)}, seed=8),
         PackRequest("a red house", {"style": (pool[1], 0.8)}, seed=9, negative_prompt="<s0> blurry"),
         PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 1.0)}, seed=10, negative_prompt="ugly <s1>")],
        # Text states that differ anyway (each group holds one kind of negative).
        [PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 0.7)}, seed=11, negative_prompt="dark <s0>"),
         PackRequest("an astronaut", {"identity": (pool[0], 1.2)}, num_images=2, seed=12)],
    ]
    diffs = [_differences(engine, requests, guidance_scale=guidance) for requests in batches]
    assert all(d <= TOLERANCE for batch in diffs for d in batch), diffs
    assert engine.recompiles == 0


@pytest.mark.parametrize("mixed", ["flux"], indirect=True)
def test_flux_prompts_and_text_parts_in_one_batch(mixed, pivotal):
    """Flux takes no negative prompt (refused); prompts and text states still mix."""
    family, model_dir, engine, pool = mixed
    diffs = _differences(engine, [PackRequest(PIVOTAL_PROMPT, {"identity": (pivotal, 0.9)}, seed=1),
                                  PackRequest("a red house", {"style": (pool[1], 0.8)}, seed=2),
                                  PackRequest("a cat", seed=3)])
    assert all(d <= TOLERANCE for d in diffs), diffs
    assert engine.recompiles == 0
    with pytest.raises(InvalidRequest, match="negative_prompt not taken by the flux family"):
        engine.prepare("a cat", negative_prompt="blurry")


def test_what_the_batch_cannot_mix_is_refused(mixed):
    """Guidance, steps, size and output type are one per forward batch: the worker never merges
    requests whose ``batch_key`` differs, and ``run`` refuses them."""
    family, model_dir, engine, pool = mixed
    first = engine.prepare("a cat", num_inference_steps=STEPS, output_type="latent")
    others = [engine.prepare("a cat", num_inference_steps=STEPS + 1, output_type="latent"),
              engine.prepare("a cat", num_inference_steps=STEPS, output_type="pt")]
    if family_named(family).takes_guidance:  # distilled klein takes none (a request that sets it is refused)
        others.append(engine.prepare("a cat", num_inference_steps=STEPS, output_type="latent",
                                     guidance_scale=engine.defaults["guidance_scale"] + 1.0))
    for other in others:
        assert other.batch_key() != first.batch_key()
        with pytest.raises(InvalidRequest, match="must share"):
            engine.run([first, other])
    # A negative prompt given or not is no reason to split a batch: it is encoded per group.
    if family == "sdxl":
        assert engine.prepare("a cat", negative_prompt="dark", num_inference_steps=STEPS,
                              output_type="latent").batch_key() == first.batch_key()


@pytest.mark.parametrize("mixed", [pytest.param(name, marks=pytest.mark.families)
                                   for name in ("qwenimage", "zimage", "krea2", "ernie-image")], indirect=True)
def test_prompts_of_unequal_lengths_in_one_batch(mixed):
    """Z-Image and Qwen-Image hand each prompt's own length to the denoiser (masked to the
    longest in a batch): a request merged with longer or shorter ones gets what it gets alone, at
    every guidance whose shapes differ, negative prompts given or not (encoded group by group under
    batch CFG: ``join_encoded``); so does ERNIE-Image, its MLPs sequence-first
    (``sequence_first_linears``). Krea 2 pads every prompt to one length, but its text fusion sees
    the samples' tokens packed (``packed_linears``); its batch never mixes a missing and a given
    negative prompt (``mixed_batch_texts``), so those run as batches of their own here."""
    family, model_dir, engine, pool = mixed
    fam = family_named(family)
    batches = [
        [PackRequest("a cat", seed=1), PackRequest("a red house on a hill under a violet sky, oil on canvas", seed=2)],
        [PackRequest("one two three", {"identity": (pool[0], 0.8)}, seed=3),
         PackRequest("x", {"style": (pool[1], 1.1)}, seed=4, negative_prompt="blurry, dark, low quality"),
         PackRequest(" ".join(["astronaut"] * 12), seed=5)],
    ]
    shareable: dict = {}  # the requests of each batch that may share one (the family's mixed_batch_texts)
    for i, requests in enumerate(batches):
        for request in requests:
            shareable.setdefault((i, fam.mixed_batch_texts(request.prompt, request.negative_prompt, ())), []).append(
                request)
    for guidance in fam.warmup_guidance_scales(engine.defaults["guidance_scale"]):
        diffs = [_differences(engine, requests, guidance_scale=guidance) for requests in shareable.values()]
        assert all(d <= TOLERANCE for batch in diffs for d in batch), (guidance, diffs)
    assert engine.recompiles == 0


@pytest.mark.parametrize("mixed", [pytest.param("qwenimage21", marks=pytest.mark.families)], indirect=True)
def test_a_family_that_mixes_the_same_texts_only(mixed, tmp_path):
    """Qwen-Image 2.1's rotary positions run from the prompt's tokens into the image's, padding
    included: a prompt padded to a longer one's length would give another image. Its requests share
    a batch only with the same prompt and negative prompt (a templated prompt with each user's
    adapters), each then what it is alone, under true CFG too; other texts never share one. Its
    timestep layers compute one t = 0 row every sample's prompt tokens share: an adapter there is
    refused by the mixed engine, saying which engine serves it."""
    from hotlora.errors import AdapterRejected
    from hotlora.testing import save_diffusers_lora

    family, model_dir, engine, pool = mixed
    linears = denoiser_linears(fresh_pipeline(model_dir))
    assert not [name for name in engine.ceiling.modules if name.startswith(("modulation.", "time_text_embed."))]
    shared = save_diffusers_lora(tmp_path / "shared", family, random_lora(linears, 4, seed=5, modules=[
        "modulation.1", "transformer_blocks.0.attn.to_q"]), rank=4, alpha=4)
    with pytest.raises(AdapterRejected, match=r"modulation\.1.* every sample of a mixed batch shares.*mixed=False"):
        engine.prepare("a cat", adapters={"identity": (shared, 1.0)})
    first = engine.prepare("a cat", adapters={"identity": (pool[0], 0.8)}, num_inference_steps=STEPS,
                           output_type="latent")
    same = engine.prepare("a cat", adapters={"style": (pool[1], 1.2)}, seed=3, num_inference_steps=STEPS,
                          output_type="latent")
    assert same.batch_key() == first.batch_key()
    for other in (engine.prepare("a red house", num_inference_steps=STEPS, output_type="latent"),
                  engine.prepare("a cat", negative_prompt="dark", num_inference_steps=STEPS, output_type="latent")):
        assert other.batch_key() != first.batch_key()
        with pytest.raises(InvalidRequest, match="must share .*prompt, negative prompt and text-encoder state"):
            engine.run([first, other])
    for guidance, negative in ((1.0, None), (2.0, "blurry, dark")):
        requests = [PackRequest("a cat on a hill", {"identity": (pool[0], 0.8)}, seed=1, negative_prompt=negative),
                    PackRequest("a cat on a hill", {"style": (pool[1], 1.2), "identity": (pool[2], 0.5)}, seed=2,
                                negative_prompt=negative),
                    PackRequest("a cat on a hill", seed=3, negative_prompt=negative)]
        diffs = _differences(engine, requests, guidance_scale=guidance)
        assert all(d <= TOLERANCE for d in diffs), (guidance, diffs)
    assert engine.recompiles == 0
