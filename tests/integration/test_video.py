"""A video family served at several frame counts: each warmed up (no request compiles), each equal to
plain diffusers, and every output type as diffusers' own post-processing makes it. The contract
(test_contract.py) covers Wan at its default frame count; this module adds what only video has."""

import dataclasses

import numpy as np
import pytest
import torch

from hotlora import Engine
from hotlora.adapters.format.convert import load_adapter
from hotlora.adapters.format.export import pair_experts, save_as_diffusers
from hotlora.engine.request import UnservedShape
from hotlora.errors import InvalidRequest, RequestError
from hotlora.families import REGISTERED, family_named
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK, recompiles_are_errors, served_frames

pytestmark = pytest.mark.families

TOLERANCE = 1e-4


# Each video family's tiny model, and each of its text-to-video variants (Wan 2.2's two experts), by
# name; the image-to-video checkpoints ("i2v", "ti2v" variants): test_image_to_video.py.
MODELS = [name for f in REGISTERED if f.video
          for name in (f.name, *(f"{f.name}:{v}" for v in f.tiny_variants if "i2v" not in v))]


@pytest.fixture(scope="module")
def video_models(tiny_models, tmp_path_factory):
    from hotlora.testing import save_tiny_model

    built = {}

    def model(name):
        if name not in built:
            family, _, variant = name.partition(":")
            built[name] = tiny_models[family] if not variant else save_tiny_model(
                tmp_path_factory.mktemp(variant) / family, family, target_rank=TARGET_RANK, variant=variant)
        return built[name]
    return model


@pytest.fixture(scope="module", params=MODELS)
def video(request, video_models):
    model_dir = video_models(request.param)
    with torch._dynamo.config.patch(error_on_recompile=False):  # warm-up compiles by definition
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        rank_buckets=(), frames=served_frames(family_named(request.param.partition(":")[0])))
    with recompiles_are_errors():
        yield model_dir, engine
    assert engine.recompiles == 0


def adapters(model_dir):
    return {"identity": (model_dir / "adapters" / "identity-diffusers", 0.9),
            "style": (model_dir / "adapters" / "style-diffusers", 0.6)}


def reference(engine, model_dir, frames, output_type="latent", num_images=3):
    return plain_diffusers_reference(model_dir, adapters(model_dir), prompt="a cat", num_images=num_images,
                                     num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"],
                                     height=engine.height, width=engine.width, seed=0, num_frames=frames,
                                     output_type=output_type)


def test_every_served_frame_count_is_warm_and_equals_plain_diffusers(video):
    model_dir, engine = video
    served = served_frames(engine.family)
    assert engine.rules.frames == served and engine.describe()["frames"] == list(served)
    # What the playground reads.
    assert (engine.describe()["output"], engine.describe()["fps"]) == ("frames", engine.family.fps)
    shapes = []
    for frames in served:
        ours = engine.generate("a cat", adapters=adapters(model_dir), num_images=3, num_inference_steps=2,
                               num_frames=frames, output_type="latent").images
        assert ours.shape[0] == 3
        torch.testing.assert_close(ours, reference(engine, model_dir, frames), atol=TOLERANCE, rtol=0)
        shapes.append(ours.shape[1:])
    assert shapes[0] != shapes[1]  # latents of more frames (Wan's (C, T, H, W); LTX's packed (tokens, C))
    assert engine.generate("a cat", num_inference_steps=2, output_type="latent").images.shape[1:] == shapes[0]
    assert engine.recompiles == 0


def test_a_frame_count_not_served_is_refused_before_running(video):
    model_dir, engine = video
    t = engine.family.frame_multiple
    first, second = served_frames(engine.family)
    with pytest.raises(UnservedShape, match=f"{3 * t + 1} frames is not served .* {first}, {second}"):
        engine.generate("a cat", num_frames=3 * t + 1)
    with pytest.raises(InvalidRequest, match=rf"{t}k \+ 1 .* got {t + 3}"):
        engine.generate("a cat", num_frames=t + 3)


def test_output_types_are_diffusers_own(video):
    """"pil": one list of frames per video, the pixels diffusers' "pil" makes (compiled kernels may
    move a value across a rounding boundary: at most one level); "np" (B, T, H, W, C) floats;
    "uint8" what the engine process ships, the "pil" pixels as one tensor."""
    model_dir, engine = video
    frames = served_frames(engine.family)[0]

    def ours(output_type):
        return engine.generate("a cat", adapters=adapters(model_dir), num_images=2, num_inference_steps=2,
                               num_frames=frames, output_type=output_type).images

    pil, theirs = ours("pil"), reference(engine, model_dir, frames, "pil", num_images=2)
    assert [len(v) for v in pil] == [frames, frames] and pil[0][0].size == (engine.width, engine.height)
    ours_pixels = np.stack([[np.asarray(f, dtype=np.int16) for f in v] for v in pil])
    their_pixels = np.stack([[np.asarray(f, dtype=np.int16) for f in v] for v in theirs])
    assert np.abs(ours_pixels - their_pixels).max() <= 1
    arrays = ours("np")
    assert arrays.shape == (2, frames, engine.height, engine.width, 3)
    np.testing.assert_allclose(arrays, reference(engine, model_dir, frames, "np", num_images=2), atol=1e-3, rtol=0)
    # "uint8" is no request's output type: the engine process sets it on a prepared "pil" request.
    prepared = engine.prepare("a cat", adapters=adapters(model_dir), num_images=2, num_inference_steps=2,
                              num_frames=frames, output_type="pil")
    shipped = engine.run(dataclasses.replace(prepared, output_type="uint8")).images
    assert shipped.dtype == torch.uint8 and np.array_equal(shipped.numpy().astype(np.int16), ours_pixels)


def experts_of(engine) -> list[str]:
    return list(engine.warm.experts)


def like_diffusers_on_both_experts(engine, model_dir, slots):
    """The engine's latents for ``slots`` (slot -> (what the engine is given, what diffusers loads: a
    file or a (high-noise, low-noise) pair, scale)), checked against plain diffusers loading the
    high-noise file into ``transformer`` and the low-noise one with ``load_into_transformer_2``."""
    ours = engine.generate("a cat", adapters={s: (src, scale) for s, (src, _, scale) in slots.items()},
                           num_images=2, num_inference_steps=2, num_frames=5, output_type="latent").images
    theirs = plain_diffusers_reference(
        model_dir, {s: (ref, scale) for s, (_, ref, scale) in slots.items()}, prompt="a cat", num_images=2,
        num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"], height=engine.height,
        width=engine.width, seed=0, num_frames=5)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    return ours


def test_two_experts_each_get_their_own_lora_equal_to_plain_diffusers(video, tmp_path):
    """Wan 2.2 A14B: a pair adapter (``transformer.`` and ``transformer_2.`` keys in one file) at two
    scales, the low-noise expert's LoRA alone, and back to the pair, against diffusers loading the
    high-noise file and the low-noise one (``load_into_transformer_2=True``) into a fresh pipeline.
    Two steps of the tiny scheduler fall on both sides of the boundary, so both experts run; each
    part changes the output (the test would not see an expert left without its LoRA otherwise)."""
    model_dir, engine = video
    if len(experts_of(engine)) < 2:
        pytest.skip("a model of one transformer")
    samples = model_dir / "adapters"
    high, low = samples / "experts-high", samples / "experts-low"

    def both(slots):
        return like_diffusers_on_both_experts(engine, model_dir, slots)

    # Both experts compiled (regional: each block's forward), not the first alone.
    assert all(block._compiled_call_impl is not None for expert in engine.warm.experts.values() for block in expert.blocks)
    weights = {(name, n): p.detach().clone() for name, expert in engine.warm.experts.items()
               for n, p in expert.named_parameters() if "lora_" not in n}
    base = both({})
    pair = samples / "experts-pair"
    at_09 = both({"identity": (pair, (high, low), 0.9)})
    both({"identity": (pair, (high, low), 0.4), "style": (samples / "style-diffusers", samples / "style-diffusers", 0.6)})
    low_only = both({"style": (samples / "experts-low-only", (None, low), 0.7)})
    high_only = both({"identity": (high, high, 0.9)})
    # What users ship: musubi-tuner's two files, one per expert (its kohya names), joined as
    # ``hotlora adapters convert --low-noise`` joins them, against diffusers loading each file.
    musubi = (samples / "experts-musubi-high.safetensors", samples / "experts-musubi-low.safetensors")
    joined = save_as_diffusers(pair_experts(*(load_adapter(f, engine.family) for f in musubi)), tmp_path / "musubi").parent
    from_musubi = both({"style": (joined, musubi, 0.8)})
    assert both({"identity": (pair, (high, low), 0.9)}).equal(at_09)  # whatever ran before
    for made in (at_09, low_only, high_only, from_musubi):
        assert (made - base).abs().max() > 1e-2
    assert (at_09 - high_only).abs().max() > 1e-3  # the low-noise expert's part counts
    # The base restored bit for bit: the latents, and every base weight of both experts.
    assert both({}).equal(base)
    changed = [key for key, p in ((key, dict(engine.warm.experts[key[0]].named_parameters())[key[1]]) for key in weights)
               if not torch.equal(p, weights[key])]
    assert not changed and len(weights) > 0, changed[:5]
    assert engine.recompiles == 0
    assert set(engine.describe()["experts"]) == {"transformer", "transformer_2"}


def test_a_lightx2v_pair_with_biases_gives_each_expert_its_own_equal_to_plain_diffusers(video, tmp_path):
    """Wan 2.2's distill LoRAs ship as a high-noise and a low-noise lightx2v file, each with a
    ``.diff_b`` for every block Linear: joined into one adapter, each expert's slots hold their own
    part's biases; equal to diffusers loading each file into its expert, at two scales, and the
    experts' LoRA biases zeros again without it."""
    from safetensors.torch import save_file

    from hotlora.families._tiny import random_lora
    from hotlora.trainer_layouts import lightx2v_wan_lora, wan_block_linear, wan_original_name

    model_dir, engine = video
    if len(experts_of(engine)) < 2:
        pytest.skip("a model of one transformer")
    linears = {n: (m.in_features, m.out_features) for n, m in engine.warm.experts["transformer"].named_modules()
               if wan_block_linear(n) and hasattr(m, "in_features")}
    files = []
    for seed, which in ((21, "high"), (22, "low")):
        g = torch.Generator().manual_seed(seed)
        biases = {f"{wan_original_name(n)}.diff_b": 0.1 * torch.randn(out, generator=g) for n, (_, out) in linears.items()}
        files.append(tmp_path / f"lightx2v-{which}.safetensors")
        save_file(lightx2v_wan_lora(random_lora(linears, 4, seed=seed), biases), str(files[-1]))
    joined = save_as_diffusers(pair_experts(*(load_adapter(f, engine.family) for f in files)), tmp_path / "pair").parent
    base = like_diffusers_on_both_experts(engine, model_dir, {})
    at_1 = like_diffusers_on_both_experts(engine, model_dir, {"style": (joined, tuple(files), 1.0)})
    like_diffusers_on_both_experts(engine, model_dir, {"style": (joined, tuple(files), 0.6)})
    assert (at_1 - base).abs().max() > 1e-2
    assert like_diffusers_on_both_experts(engine, model_dir, {}).equal(base)
    for expert in engine.warm.experts.values():
        biases = [m.lora_B["hotlora_slots"].bias for m in expert.modules() if hasattr(m, "lora_B")]
        assert biases and not any(b.any() for b in biases)
    assert engine.recompiles == 0


def test_a_runs_shift_and_the_low_noise_experts_guidance_compile_nothing(video):
    """Compiled: a request's scheduler shift (and, with two experts, ``guidance_scale_2``) runs on the
    warm graphs, equal to plain diffusers given the same values (tests/integration/test_run_options.py
    has the eager case and the effect of each)."""
    from hotlora.engine.shift import static_shift_key

    model_dir, engine = video
    two = len(experts_of(engine)) > 1
    frames = served_frames(engine.family)[0]
    if static_shift_key(engine.pipeline.scheduler) is None:  # LTX's scheduler shifts by the video's size
        with pytest.raises(InvalidRequest, match="shift"):
            engine.generate("a cat", num_frames=frames, shift=2.0)
        pytest.skip(f"{type(engine.pipeline.scheduler).__name__} here has no fixed shift to set")
    for shift, guidance_2 in ((2.0, 1.0 if two else None), (12.0, 8.0 if two else None), (None, None)):
        ours = engine.generate("a cat", adapters=adapters(model_dir), num_images=2, num_inference_steps=2,
                               num_frames=frames, output_type="latent", shift=shift, guidance_scale_2=guidance_2).images

        def at_shift(pipeline, shift=shift):
            if shift is not None:
                pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, shift=shift)

        theirs = plain_diffusers_reference(
            model_dir, adapters(model_dir), prompt="a cat", num_images=2, num_inference_steps=2,
            guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=0,
            num_frames=frames, prepare=at_shift, task_arguments={} if guidance_2 is None else {"guidance_scale_2": guidance_2})
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    assert engine.recompiles == 0


def test_a_second_experts_lora_is_refused_by_a_model_of_one_transformer(video, video_models):
    """Keys for transformer_2 given to Wan 2.1: plain diffusers would drop them without a word; the
    engine refuses the request (a 4xx) before touching a slot."""
    model_dir, engine = video
    if len(experts_of(engine)) > 1:
        pytest.skip("a model of two experts")
    family = engine.family.name
    variants = engine.family.tiny_variants
    if not variants:
        pytest.skip("no two-expert variant of this family")
    samples = video_models(f"{family}:{variants[0]}") / "adapters"
    before = engine.generate("a cat", num_inference_steps=2, num_frames=5, output_type="latent").images
    with pytest.raises(RequestError, match=r"LoRA for transformer_2 .* a second expert the served model does not have"):
        engine.generate("a cat", adapters={"identity": (samples / "experts-low-only", 1.0)}, num_frames=5)
    with pytest.raises(RequestError, match=r"LoRA for transformer_2"):
        engine.generate("a cat", adapters={"identity": (samples / "experts-pair", 1.0)}, num_frames=5)
    after = engine.generate("a cat", num_inference_steps=2, num_frames=5, output_type="latent").images
    assert after.equal(before)


def test_two_experts_run_their_own_rank_buckets_without_compiling(video_models):
    """With the default rank buckets (0, a quarter of the target rank, the target rank) each expert's
    slots run the smallest bucket that holds their part of the request: a pair of rank 8 (high) and
    rank 2 (low) runs buckets 8 and 2, the low-noise LoRA alone 0 and 2, no adapter 0 and 0. Warm-up
    compiled every bucket on both experts; no combination compiles anything."""
    name = next((m for m in MODELS if ":" in m), None)
    if name is None:
        pytest.skip("no two-expert variant")
    model_dir = video_models(name)
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model_dir, target_rank=TARGET_RANK, batch_size=1, compile=True, frames=(5,))
    samples = model_dir / "adapters"
    high, low = samples / "experts-high", samples / "experts-low"
    cases = [({"identity": (samples / "experts-pair", 0.8)}, {"identity": ((high, low), 0.8)}, [8, 2]),
             ({"identity": (samples / "experts-low-only", 1.1)}, {"identity": ((None, low), 1.1)}, [0, 2]),
             ({}, {}, [0, 0]),
             ({"style": (high, 0.5)}, {"style": (high, 0.5)}, [8, 0])]
    with recompiles_are_errors():
        for ours_adapters, their_adapters, buckets in cases:
            ours = engine.generate("a cat", adapters=ours_adapters, num_inference_steps=2, output_type="latent").images
            assert [w.bucket for w in engine.writer.writers.values()] == buckets
            theirs = plain_diffusers_reference(model_dir, their_adapters, prompt="a cat", num_images=1,
                                               num_inference_steps=2, guidance_scale=engine.defaults["guidance_scale"],
                                               height=engine.height, width=engine.width, seed=0, num_frames=5)
            torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    assert engine.recompiles == 0
