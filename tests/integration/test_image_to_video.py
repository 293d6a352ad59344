"""Wan image-to-video (``WanImageToVideoPipeline``, the task ``image-to-video``): the input image is
the first frame. An image-to-video checkpoint (Wan2.1-I2V: 36 channels in, a CLIP image encoder read
by ``add_k_proj`` / ``add_v_proj``) serves that task alone; served compiled with per-request LoRA,
equal to plain diffusers (``load_lora_weights`` into the image-to-video pipeline), no request
compiling; mixed batches, fused and auto modes too (eager). Wan 2.2 TI2V-5B's one transformer
serves text-to-video and image-to-video from one warm model, Wan2.2-I2V-A14B's two experts their
LoRA pair, and LTX-Video both tasks on its one checkpoint (``families``). Everything a request or a
start-up gets wrong is refused by name."""


import numpy as np
import pytest
import torch
from PIL import Image

from hotlora import Engine
from hotlora.engine.request import GenerationRequest, UnservedTask
from hotlora.errors import InvalidRequest
from hotlora.families import UnservedModel, family_named
from hotlora.testing import plain_diffusers_reference

from ..helpers import TARGET_RANK, recompiles_are_errors, sample_adapter as sample, served_frames

TOLERANCE = 1e-4
WAN = family_named("wan")
FRAMES = served_frames(WAN)[0]
TASK = ("image-to-video",)


def first_frame(seed: int, size=(24, 40)) -> Image.Image:
    """A random RGB image (width, height): not the served size, which the pipeline resizes it to."""
    return Image.fromarray((np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8))


def like_diffusers(engine, model_dir, adapters, image, num_images: int, given=None, size=None, last=None) -> torch.Tensor:
    """The engine's latents for ``adapters`` (or ``given``, the same adapters as the engine takes
    them) and ``image`` (and a ``last`` frame; two steps), checked against plain diffusers'
    image-to-video pipeline given the same images, within TOLERANCE."""
    size = size or (engine.height, engine.width)
    images = (image,) if last is None else (image, last)
    ours = engine.generate("a cat", adapters=adapters if given is None else given, num_images=num_images,
                           num_inference_steps=2, num_frames=FRAMES, output_type="latent", images=images, task=None,
                           height=size[0], width=size[1]).images
    # A prompt per video: diffusers' pipeline fails on Wan2.1-I2V at num_videos_per_prompt > 1 (Wan.call_prompts).
    theirs = plain_diffusers_reference(model_dir, adapters, prompt=["a cat"] * num_images, num_images=num_images,
                                       num_inference_steps=2,
                                       guidance_scale=engine.defaults["guidance_scale"], height=size[0], width=size[1],
                                       seed=0, num_frames=FRAMES, pipeline_class="WanImageToVideoPipeline",
                                       task_arguments={"image": image, **({} if last is None else {"last_image": last})})
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    return ours


@pytest.fixture(scope="module")
def i2v_model(tmp_path_factory):
    from hotlora.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("i2v") / "wan", "wan", target_rank=TARGET_RANK, variant="i2v")


@pytest.fixture(scope="module")
def i2v_engine(i2v_model):
    with torch._dynamo.config.patch(error_on_recompile=False):  # warm-up compiles by definition
        engine = Engine.from_pretrained(i2v_model, target_rank=TARGET_RANK, batch_size=2, compile=True,
                                        frames=(FRAMES,), tasks=TASK)
    with recompiles_are_errors():
        yield engine
    assert engine.recompiles == 0


def test_an_image_to_video_checkpoint_serves_per_request_lora_equal_to_plain_diffusers(i2v_model, i2v_engine):
    """Wan2.1-I2V's layout, compiled: no adapter, diffusers' LoRA over every Linear (the image
    cross-attention's ``add_k_proj`` / ``add_v_proj`` among them), musubi-tuner's (``k_img`` names)
    beside it, lightx2v's with its LoRA biases, and back: each equal to plain diffusers given the same
    first frame, batches of 1 and 2, nothing compiled. The first frame matters."""
    engine, model = i2v_engine, i2v_model
    assert engine.rules.tasks == TASK and engine.describe()["tasks"] == list(TASK)
    diffusers_file = sample(model, "identity-diffusers")
    from safetensors import safe_open

    with safe_open(str(diffusers_file), "pt") as f:
        assert any("attn2.add_k_proj" in k for k in f.keys())  # the image cross-attention is adapted
    image = first_frame(1)
    base = like_diffusers(engine, model, {}, image, num_images=2)
    identity = like_diffusers(engine, model, {"identity": (diffusers_file, 0.9)}, image, num_images=1)
    like_diffusers(engine, model, {"identity": (diffusers_file, 0.9), "style": (sample(model, "style-musubi"), 0.7)},
                   image, num_images=2)
    like_diffusers(engine, model, {"style": (sample(model, "style-lightx2v"), 1.0)}, image, num_images=1)
    assert (identity - base[:1]).abs().max() > 1e-2
    assert like_diffusers(engine, model, {}, image, num_images=2).equal(base)
    other = like_diffusers(engine, model, {}, first_frame(2), num_images=1)
    assert (other - base[:1]).abs().max() > 1e-2
    assert engine.recompiles == 0


@pytest.mark.parametrize("mode", [{"mixed": True}, {"adapter_mode": "fused"}, {"adapter_mode": "auto"}],
                         ids=["mixed", "fused", "auto"])
def test_every_adapter_mode_serves_image_to_video(i2v_model, mode):
    """Mixed batches (the request alone in its batch: one first frame a call), fused and auto modes
    (eager): musubi-tuner's LoRA, then none, each equal to plain diffusers on the same first frame."""
    engine = Engine.from_pretrained(i2v_model, target_rank=TARGET_RANK, batch_size=2, compile=False,
                                    frames=(FRAMES,), tasks=TASK, **mode)
    image = first_frame(6)
    styled = like_diffusers(engine, i2v_model, {"style": (sample(i2v_model, "style-musubi"), 0.8)}, image, num_images=2)
    assert (styled - like_diffusers(engine, i2v_model, {}, image, num_images=2)).abs().max() > 1e-2


def test_what_an_image_to_video_engine_refuses(i2v_engine, i2v_model, tiny_models):
    """A request without the image (text-to-video: the checkpoint makes nothing from text alone),
    with two images, a mask or a strength: refused before any run. Start-up: an image-to-video
    checkpoint not started with the task, or with another task beside it; image-to-video asked of
    Wan 2.1's text-to-video model (its transformer takes no image)."""
    engine, image = i2v_engine, first_frame(3)
    with pytest.raises(UnservedTask, match=r"'text-to-image' is not served .* image-to-video \(this model makes "
                                           r"nothing from text alone: give an input image\)"):
        engine.check(GenerationRequest(prompt="a cat", num_frames=FRAMES))
    # The Python API's default task is text-to-image: given an image, the hint names the task.
    with pytest.raises(UnservedTask, match=r"name the task 'image-to-video' with the input image, or none to imply it"):
        engine.check(GenerationRequest(prompt="a cat", num_frames=FRAMES, images=(image,)))
    for wrong, message in (({"images": (image, image)}, r"takes one input image \(the first frame\), got 2 input image\(s\) "
                                                        r"\(a last frame is taken by Wan2.1-FLF2V-14B and Wan2.2-I2V-A14B"),
                           ({"images": (image,), "mask": image}, "image-to-video takes no mask"),
                           ({"images": (image,), "strength": 0.5}, "strength is taken by image-to-image and inpaint")):
        with pytest.raises(InvalidRequest, match=message):
            engine.check(GenerationRequest(prompt="a cat", num_frames=FRAMES, task="image-to-video", **wrong))
    with pytest.raises(UnservedModel, match=r"WanImageToVideoPipeline\) makes nothing from text alone: it serves "
                                            r"image-to-video only \(start it with tasks=image-to-video"):
        Engine.from_pretrained(i2v_model, target_rank=TARGET_RANK, compile=False, frames=(FRAMES,))
    with pytest.raises(UnservedModel, match=r"serves image-to-video only .* asked for: text-to-image, image-to-video, "
                                            r"inpaint"):
        Engine.from_pretrained(i2v_model, target_rank=TARGET_RANK, compile=False, frames=(FRAMES,),
                               tasks=("image-to-video", "inpaint"))
    with pytest.raises(UnservedModel, match=r"image-to-video needs a Wan image-to-video checkpoint .* takes no image "
                                            r"\(16 latent channels in"):
        Engine.from_pretrained(tiny_models["wan"], target_rank=TARGET_RANK, compile=False, frames=(FRAMES,), tasks=TASK)


def test_a_first_last_frame_checkpoint_serves_both_frames_equal_to_plain_diffusers(tmp_path_factory):
    """Wan2.1-FLF2V's layout (the I2V one whose image embedder takes both frames' CLIP features,
    ``pos_embed_seq_len``), compiled: first and last frame, with a LoRA and without, equal to plain
    diffusers given ``last_image``; another last frame makes another video; nothing compiled by a
    request. One image is refused by name (the checkpoint cannot run on one)."""
    from hotlora.testing import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("flf2v") / "wan", "wan", target_rank=TARGET_RANK,
                            variant="i2v-first-last")
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=1, compile=True, frames=(FRAMES,),
                                        tasks=TASK)
    assert engine.rules.input_frames == (2,)
    first, last, style = first_frame(8), first_frame(9), {"style": (sample(model, "style-musubi"), 0.8)}
    with recompiles_are_errors():
        base = like_diffusers(engine, model, {}, first, num_images=1, last=last)
        styled = like_diffusers(engine, model, style, first, num_images=2, last=last)
        other = like_diffusers(engine, model, {}, first, num_images=1, last=first_frame(10))
    assert (styled[:1] - base).abs().max() > 1e-2 and (other - base).abs().max() > 1e-2
    assert engine.recompiles == 0
    with pytest.raises(InvalidRequest, match=r"takes two input images \(the first and the last frame\), got 1 input "
                                             r"image\(s\) \(a first-last-frame checkpoint, Wan2.1-FLF2V"):
        engine.check(GenerationRequest(prompt="a cat", num_frames=FRAMES, task="image-to-video", images=(first,)))


@pytest.mark.families
def test_ti2v_serves_text_to_video_and_image_to_video_from_one_warm_model(tmp_path_factory):
    """Wan 2.2 TI2V-5B's layout (``expand_timesteps``, the Wan 2.2 VAE), compiled with both tasks: a
    LoRA and none, text-to-video and image-to-video in turn, each equal to plain diffusers (the
    text-to-video pipeline, and the image-to-video one on the same files), nothing compiled."""
    from hotlora.testing import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("ti2v") / "wan", "wan", target_rank=TARGET_RANK, variant="ti2v")
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=2, compile=True, frames=(FRAMES,),
                                        tasks=TASK, height=32, width=32)  # the 16x VAE: 32 pixels at least
    assert engine.rules.tasks == ("text-to-image", *TASK)
    image, style = first_frame(4), {"style": (sample(model, "style-musubi"), 0.8)}
    with recompiles_are_errors():
        for adapters in ({}, style, {}):
            like_diffusers(engine, model, adapters, image, num_images=2)
            ours = engine.generate("a cat", adapters=adapters, num_images=2, num_inference_steps=2, num_frames=FRAMES,
                                   output_type="latent").images
            theirs = plain_diffusers_reference(model, adapters, prompt="a cat", num_images=2, num_inference_steps=2,
                                               guidance_scale=engine.defaults["guidance_scale"], height=32, width=32,
                                               seed=0, num_frames=FRAMES)
            torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    assert engine.recompiles == 0
    with pytest.raises(InvalidRequest, match=r"takes one input image \(the first frame\), got 2"):  # else dropped
        engine.check(GenerationRequest(prompt="a cat", num_frames=FRAMES, task="image-to-video", images=(image, image)))


@pytest.mark.families
def test_wan22_image_to_video_experts_serve_a_lora_pair_equal_to_plain_diffusers(tmp_path_factory):
    """Wan2.2-I2V-A14B's layout (two image-to-video experts, no image encoder), compiled: musubi-tuner's
    high-noise and low-noise files as one slot's pair, at two scales, each equal to diffusers loading
    each file into its expert, then with a last frame too (``last_image``); nothing compiled."""
    from hotlora.testing import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("i2v-experts") / "wan", "wan", target_rank=TARGET_RANK,
                            variant="i2v-two-experts")
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=2, compile=True, frames=(FRAMES,),
                                        tasks=TASK)
    assert len(engine.warm.experts) == 2
    high, low = sample(model, "experts-musubi-high"), sample(model, "experts-musubi-low")
    image = first_frame(5)
    with recompiles_are_errors():
        base = like_diffusers(engine, model, {}, image, num_images=1)
        for scale in (1.0, 0.6):
            paired = like_diffusers(engine, model, {"identity": ((high, low), scale)}, image, num_images=2,
                                    given={"identity": {"ref": str(high), "low_noise": str(low), "scale": scale}})
        assert (paired[:1] - base).abs().max() > 1e-2
        # A last frame too (no image encoder: it enters the condition latents alone), warmed up with one.
        assert engine.rules.input_frames == (1, 2)
        ending = like_diffusers(engine, model, {"identity": ((high, low), 0.6)}, image, num_images=1, last=first_frame(6),
                                given={"identity": {"ref": str(high), "low_noise": str(low), "scale": 0.6}})
        assert (ending - paired[:1]).abs().max() > 1e-3
    assert engine.recompiles == 0


@pytest.mark.families
def test_ltx_serves_image_to_video_on_its_text_to_video_weights(tiny_models):
    """LTX-Video's one checkpoint, compiled with both tasks: image-to-video (``LTXImageToVideoPipeline``
    through ``from_pipe``; its first frame given once per video, each sampled with that video's
    generator) at 1 and 3 videos (chunks of 2 and 1), with a LoRA and without, each equal to plain
    diffusers; text-to-video between them still equal, and another video than image-to-video's."""
    model = tiny_models["ltx"]
    frames = served_frames(family_named("ltx"))[0]
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(model, target_rank=TARGET_RANK, batch_size=2, compile=True, frames=(frames,),
                                        tasks=TASK)
    image, style = first_frame(7), {"style": (sample(model, "style-diffusers"), 0.8)}

    def both(adapters, count, task_arguments=None):
        ours = engine.generate("a cat", adapters=adapters, num_images=count, num_inference_steps=2, num_frames=frames,
                               output_type="latent", **({"images": (image,), "task": None} if task_arguments else {})).images
        theirs = plain_diffusers_reference(
            model, adapters, prompt="a cat", num_images=count, num_inference_steps=2,
            guidance_scale=engine.defaults["guidance_scale"], height=engine.height, width=engine.width, seed=0,
            num_frames=frames, task_arguments=task_arguments,
            pipeline_class="LTXImageToVideoPipeline" if task_arguments else None)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        return ours

    with recompiles_are_errors():
        for adapters in ({}, style):
            for count in (1, 3):
                from_image = both(adapters, count, {"image": [image] * count})
            from_text = both(adapters, 3)
            assert (from_image - from_text).abs().max() > 1e-2
    assert engine.recompiles == 0

