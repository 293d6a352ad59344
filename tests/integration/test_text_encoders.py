"""Text-encoder LoRA and pivotal-tuning embeddings, hot-swapped per request on the compiled mixed
engines (the session's ``mixed`` fixture): what plain diffusers gives with ``load_lora_weights`` +
``set_adapters`` + ``load_textual_inversion``, within 1e-4 (float32), with no recompile; and no
trace in the text encoders once a request without them runs."""

import hashlib
import random

import pytest
import torch

from hotlora.adapters.format.convert import load_adapter
from hotlora.families import family_named
from hotlora.errors import AdapterRejected, InvalidRequest
from hotlora.testing import (
    denoiser_linears, random_embeddings, random_lora, save_pivotal_lora, sd_scripts_metadata, sd_scripts_sdxl_lora,
    text_encoder_linears,
)

from ..helpers import TARGET_RANK, PackRequest, fresh_pipeline, generate_batch, recompiles_are_errors

TOLERANCE = 1e-4
STEPS = 2
PROMPT = "a photo of <s0><s1> in a garden"


@pytest.fixture(autouse=True)
def no_recompiles(mixed):
    with recompiles_are_errors():
        yield


@pytest.fixture(scope="session")
def pivotal(mixed, tmp_path_factory):
    """Adapters as diffusers' advanced training scripts write them, per family: denoiser and
    text-encoder LoRA in one file with their LoraConfig metadata, and ``<name>_emb.safetensors``
    holding the vectors of ``<s0>`` and ``<s1>``. Two users, the same token names; text-encoder
    ranks above the engine's target rank (text encoders take any rank)."""
    family, model_dir, engine, _ = mixed
    root = tmp_path_factory.mktemp(f"pivotal-{family}")
    reference = fresh_pipeline(model_dir)
    # The banks' layers (Qwen-Image 2.1's leave out its shared timestep rows: ``mixed_batch_shared_rows``).
    linears = {name: shape for name, shape in denoiser_linears(reference).items() if name in engine.ceiling.modules}
    made = []
    for user in range(2):
        denoiser = random_lora(linears, 4, seed=50 + user, modules=sorted(linears)[user::3])
        texts = {te: random_lora(_lora_targets(reference, te), TARGET_RANK * 2, seed=60 + 10 * user + i, strength=1.5)
                 for i, te in enumerate(family_named(family).lora_text_encoders)}
        embeddings = random_embeddings(reference, family, 2, seed=70 + user)
        folder = save_pivotal_lora(root / f"user{user}", family, denoiser, texts, alpha=4,
                                   embeddings=embeddings)
        made.append((folder, embeddings))
    return made


def _lora_targets(pipeline, encoder):
    """What the training scripts target, and CLIP-G's ``text_projection`` (outside its ``text_model``)."""
    linears = text_encoder_linears(pipeline, encoder)
    projection = getattr(getattr(pipeline, encoder), "text_projection", None)
    if projection is not None:
        linears["text_projection"] = (projection.in_features, projection.out_features)
    return linears


def _generate(engine, prompt, adapters, seed=0, images=1):
    return engine.generate(prompt, adapters=adapters, num_images=images, num_inference_steps=STEPS, seed=seed,
                           output_type="latent")


def _reference(engine, model_dir, prompt, adapters, embeddings=(), seed=0, images=1):
    from ..helpers import engine_reference

    return engine_reference(engine, model_dir, adapters, prompt=prompt, steps=STEPS, num_images=images, seed=seed,
                            embeddings=embeddings)


def test_text_encoder_lora_and_embeddings_equal_plain_diffusers(mixed, pivotal):
    family, model_dir, engine, pool = mixed
    rng = random.Random(f"te-{family}")
    (user, vectors), _ = pivotal
    for scale in (1.0, round(rng.uniform(0.3, 1.4), 2)):
        adapters = {"identity": (user, scale), "style": (pool[0], 0.7)}
        result = _generate(engine, PROMPT, adapters, seed=3, images=2)
        expected = _reference(engine, model_dir, PROMPT, adapters, [(vectors, ["<s0>", "<s1>"])], seed=3, images=2)
        assert (result.images - expected).abs().max().item() < TOLERANCE, scale
        served = result.adapters["identity"]
        # SD3 has no pivotal-tuning script in diffusers (no embedding keys): its files carry LoRA only.
        assert served["embedding_tokens"] == (["<s0>", "<s1>"] if family_named(family).embedding_keys else [])
        assert served["text_encoders"] == list(family_named(family).lora_text_encoders)
        assert served["skipped"] is None
    # CLIP's tokenizer lower-cases before it matches added tokens, T5's does not: "<S0>" is the
    # token for CLIP only, in diffusers and here.
    mixed_case = "a photo of <S0><s1>"
    adapters = {"identity": (user, 1.0)}
    result = _generate(engine, mixed_case, adapters, seed=4)
    expected_case = _reference(engine, model_dir, mixed_case, adapters, [(vectors, ["<s0>", "<s1>"])], seed=4)
    assert (result.images - expected_case).abs().max().item() < TOLERANCE
    # What the text parts change is far above the tolerance: without them diffusers differs.
    without = _reference(engine, model_dir, PROMPT, {"identity": (user, 1.0), "style": (pool[0], 0.7)}, seed=3,
                         images=2)
    assert (without - expected).abs().max().item() > 100 * TOLERANCE
    assert engine.recompiles == 0


@pytest.mark.parametrize("mixed", ["sdxl"], indirect=True)
def test_kohya_lora_te1_te2_equal_plain_diffusers(mixed, tmp_path):
    """sd-scripts' SDXL files carry ``lora_te1_*`` / ``lora_te2_*`` keys beside the U-Net's (its
    Flux files' T5 keys are dropped by diffusers too, and reported as skipped)."""
    _, model_dir, engine, _ = mixed
    reference = fresh_pipeline(model_dir)
    unet = {k: v for k, v in random_lora(denoiser_linears(reference), 4, seed=81).items() if ".attn" in k}
    texts = {name: random_lora(text_encoder_linears(reference, te), 4, seed=82 + i, strength=1.5)
             for i, (name, te) in enumerate((("te1", "text_encoder"), ("te2", "text_encoder_2")))}
    from safetensors.torch import save_file

    path = tmp_path / "kohya_te.safetensors"
    save_file(sd_scripts_sdxl_lora(unet, reference.unet.config.layers_per_block, alpha=2.0, text_encoders=texts),
              str(path), metadata=sd_scripts_metadata("sdxl_base_v1-0", 4, 2.0))
    adapters = {"identity": (path, 0.9)}
    result = _generate(engine, "a red house", adapters, seed=5)
    assert sorted(result.adapters["identity"]["text_encoders"]) == ["text_encoder", "text_encoder_2"]
    expected = _reference(engine, model_dir, "a red house", adapters, seed=5)
    assert (result.images - expected).abs().max().item() < TOLERANCE
    assert engine.recompiles == 0


@pytest.mark.parametrize("mixed", [pytest.param("sd15", marks=pytest.mark.families)], indirect=True)
def test_kohya_sd15_lora_te_equal_plain_diffusers(mixed, tmp_path):
    """sd-scripts' SD1.x files (``train_network.py``, networks/lora.py): ``lora_unet_*`` in diffusers'
    module names and ``lora_te_*`` for CLIP-L, a scalar alpha per module."""
    _, model_dir, engine, _ = mixed
    reference = fresh_pipeline(model_dir)
    unet = {k: v for k, v in random_lora(denoiser_linears(reference), 4, seed=81).items() if ".attn" in k}
    text = random_lora(text_encoder_linears(reference, "text_encoder"), 4, seed=82, strength=1.5)
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors.torch import save_file

    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in unet.items()})
    for module in sorted({k.split(".lora_")[0] for k in text}):
        name = "lora_te_" + module.replace(".", "_")
        kohya[f"{name}.lora_down.weight"] = text[f"{module}.lora_A.weight"]
        kohya[f"{name}.lora_up.weight"] = text[f"{module}.lora_B.weight"]
        kohya[f"{name}.alpha"] = torch.tensor(2.0)
    kohya = {k: (torch.tensor(2.0) if k.endswith(".alpha") else v.contiguous()) for k, v in kohya.items()}
    path = tmp_path / "kohya_te.safetensors"
    save_file(kohya, str(path), metadata=sd_scripts_metadata("sd_v1", 4, 2.0))
    adapters = {"identity": (path, 0.9)}
    result = _generate(engine, "a red house", adapters, seed=5)
    assert result.adapters["identity"]["text_encoders"] == ["text_encoder"]
    expected = _reference(engine, model_dir, "a red house", adapters, seed=5)
    assert (result.images - expected).abs().max().item() < TOLERANCE
    assert engine.recompiles == 0


def _weights_hash(pipeline, family):
    """Every text encoder's weights but the token table (it holds the engine's reserved rows; its
    base rows are compared through what the encoders make of an ordinary prompt)."""
    digest = hashlib.sha256()
    for te in family.text_encoders:
        for name, tensor in sorted(getattr(pipeline, te).state_dict().items()):
            if not any(table in name for table in ("token_embedding", "shared.weight", "embed_tokens")):
                digest.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _encoded(pipeline, family):
    """What the family's encoding of a prompt gives (its pipeline's own ``encode_prompt``)."""
    with torch.no_grad():
        return tuple(family_named(family).encode_prompts(pipeline, {"prompt": ["a cat on a wall"]}, cfg=False).values())


def test_requests_with_and_without_text_parts_leave_no_trace(mixed, pivotal):
    family, model_dir, engine, pool = mixed
    if not (family_named(family).lora_text_encoders or family_named(family).embedding_keys):
        pytest.skip(f"{family} adapters carry no text parts")
    fresh = fresh_pipeline(model_dir)
    base_hash, base_encoded = _weights_hash(fresh, engine.family), _encoded(fresh, family)
    rng = random.Random(f"trace-{family}")
    for _ in range(4):
        (user, _), = rng.sample(pivotal, 1)
        _generate(engine, PROMPT, {"identity": (user, round(rng.uniform(0.2, 1.5), 2))})
        _generate(engine, "a cat", {"style": (pool[rng.randrange(len(pool))], 0.5)})
        assert _weights_hash(engine.pipeline, engine.family) == base_hash
        for ours, theirs in zip(_encoded(engine.pipeline, family), base_encoded):
            assert torch.equal(ours, theirs)
    assert engine.recompiles == 0


def test_two_users_with_the_same_token_names_share_a_batch_and_keep_their_vectors(mixed, pivotal):
    family, model_dir, engine, pool = mixed
    if family_named(family).mixed_batch_shares:
        pytest.skip(f"{family}'s mixed batches hold only requests that share {family_named(family).mixed_batch_shares}")
    (first, first_vectors), (second, second_vectors) = pivotal
    requests = [PackRequest(PROMPT, {"identity": (first, 1.0)}, num_images=1, seed=11),
                PackRequest(PROMPT, {"identity": (second, 0.8), "style": (pool[1], 0.5)}, num_images=1, seed=12),
                PackRequest("a red house", {"style": (pool[2], 1.0)}, num_images=1, seed=13)]
    results = generate_batch(engine, requests, num_inference_steps=STEPS, output_type="latent")
    references = [
        _reference(engine, model_dir, PROMPT, {"identity": (first, 1.0)}, [(first_vectors, ["<s0>", "<s1>"])], 11),
        _reference(engine, model_dir, PROMPT, {"identity": (second, 0.8), "style": (pool[1], 0.5)},
                   [(second_vectors, ["<s0>", "<s1>"])], 12),
        _reference(engine, model_dir, "a red house", {"style": (pool[2], 1.0)}, seed=13),
    ]
    for result, expected in zip(results, references):
        assert (result.images - expected).abs().max().item() < TOLERANCE
    assert engine.recompiles == 0


def test_text_parts_that_cannot_be_served_are_refused_before_anything_runs(mixed, pivotal, tmp_path):
    family, model_dir, engine, _ = mixed
    if not family_named(family).embedding_keys:
        pytest.skip(f"{family} adapters carry no embeddings")
    (first, _), (second, _) = pivotal
    with pytest.raises(InvalidRequest, match="both define the embedding token <s0>"):
        engine.prepare(PROMPT, adapters={"identity": first, "style": second})
    with pytest.raises(InvalidRequest, match="reserved"):
        engine.prepare("a photo of <HOTLORA-1-0>", adapters={"identity": first})
    reference = fresh_pipeline(model_dir)
    narrow = {k: v[:, :-1] for k, v in random_embeddings(reference, family, 2, seed=1).items()}
    folder = save_pivotal_lora(tmp_path / "narrow", family, random_lora(denoiser_linears(reference), 2, seed=2), {},
                               alpha=2, embeddings=narrow)
    with pytest.raises(AdapterRejected, match="wide"):
        engine.prepare(PROMPT, adapters={"identity": folder})
    many = random_embeddings(reference, family, engine.config.embedding_rows + 1, seed=3)
    folder = save_pivotal_lora(tmp_path / "many", family, random_lora(denoiser_linears(reference), 2, seed=2), {},
                               alpha=2, embeddings=many)
    with pytest.raises(AdapterRejected, match="reserves"):
        engine.prepare(PROMPT, adapters={"identity": folder})
    # A word of the tokenizer's own vocabulary is not a token name (diffusers refuses it too).
    adapter = load_adapter(pivotal[0][0], engine.family)
    adapter.embeddings = adapter.embeddings.named(["a", "b"])
    with pytest.raises(AdapterRejected, match="vocabulary"):
        engine.prepare("a b", adapters={"identity": adapter})


def test_text_encoder_lora_runs_unfused_and_an_adapter_that_comes_back_is_not_planned_again(mixed, pivotal,
                                                                                            monkeypatch):
    """No pristine copy of the encoders, nothing merged (so nothing lost in low precision), and an
    adapter that comes back re-points the hooks to its cached factors; the text side's time is
    part of ``swap_ms``."""
    family, _, engine, _ = mixed
    if not family_named(family).lora_text_encoders:
        pytest.skip(f"diffusers loads no text-encoder LoRA into {family_named(family).pipeline_class}")
    (first, _), (second, _) = pivotal
    lora = engine.describe()["text_encoders"]["lora"]
    assert lora and all(d["mode"] == "unfused" and d["pristine_bytes"] == 0 for d in lora.values())
    plans = []
    for writer in engine.text.lora.values():
        real = writer._plan
        monkeypatch.setattr(writer, "_plan", lambda assignment, real=real: (plans.append(1), real(assignment))[1])
    one = _generate(engine, PROMPT, {"identity": (first, 1.0)})
    _generate(engine, PROMPT, {"identity": (second, 1.0)})
    planned = len(plans)
    again = _generate(engine, PROMPT, {"identity": (first, 1.0)})
    assert len(plans) == planned  # its factors were cached: nothing built, nothing merged
    assert torch.equal(again.images, one.images)
    assert again.swap.text_ms > 0 and again.timings.swap_ms >= again.swap.text_ms
    for described in engine.describe()["text_encoders"]["lora"].values():
        assert described["bound"]["identity"]["rank"] == TARGET_RANK * 2
    assert engine.recompiles == 0
