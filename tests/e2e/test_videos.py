"""OpenAI's videos API against a real ``hotlora serve`` of the tiny Wan model (eager, batch 1, one
size served), driven by the official openai client: create, poll, download the MP4 and decode it
with PyAV, delete; another key's video does not exist; bad input is refused before any job. Also a
video on hotlora's own /v1/generate (MP4 by default, formats checked against the output kind). An image
model's refusals need no engine run: tests/unit/test_app_routes.py."""

import base64
import io
import re
import time
from fractions import Fraction

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from hotlora.families import FAMILIES
from hotlora.server.auth import new_key

openai = pytest.importorskip("openai")
# The openai client marks its videos methods deprecated (OpenAI's own Sora service shuts down); the
# API shape they speak is what this server serves.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning")

ALICE, ALICE_LINE = new_key("alice")
BOB, BOB_LINE = new_key("bob")
STEPS = 2
FPS = FAMILIES["wan"].fps
FRAMES = FAMILIES["wan"].tiny_frames  # the tiny model's default frame count: the one served
SECONDS = f"{(FRAMES - 1) / FPS:g}"  # the videos API's rule: frames = seconds x fps + 1
SIZE = f"{FAMILIES['wan'].tiny_size}x{FAMILIES['wan'].tiny_size}"
# hotlora's extensions, as the openai client sends extra_body in its multipart form
EXTRA = {"num_inference_steps": STEPS, "seed": 7, "adapters": {"style": "style-diffusers"}}


@pytest.fixture(scope="module")
def declared(tiny_models, tmp_path_factory):
    """A step-distill adapter's stand-in: the tiny identity LoRA declaring the steps it was trained for."""
    from hotlora.testing import declare_defaults

    return declare_defaults(tiny_models["wan"] / "adapters" / "identity-diffusers",
                            tmp_path_factory.mktemp("declared") / "distill.safetensors", num_inference_steps=STEPS)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory, start_server, declared):
    tmp = tmp_path_factory.mktemp("videos")
    adapters = tiny_models["wan"] / "adapters"
    return start_server(tiny_models["wan"], tmp, roots=(adapters, declared.parent),
                        catalog=str(adapters / "catalog.toml"),
                        compile=False, batch_size=1, auth="on", api_keys=f"{ALICE_LINE}\n{BOB_LINE}",
                        sizes=SIZE)


def client(server, key=ALICE):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def decode(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        facts = (stream.codec_context.name, stream.average_rate, stream.width, stream.height)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return facts, np.stack(frames)


def until_finished(videos, video_id):
    for _ in range(600):  # bounded: a tiny eager video takes a second or two
        video = videos.retrieve(video_id)
        if video.status not in ("queued", "in_progress"):
            return video
        time.sleep(0.1)
    pytest.fail(f"video {video_id} never finished")


def test_a_video_made_polled_downloaded_and_deleted_with_the_openai_client(served):
    videos = client(served).videos
    created = videos.create(prompt="a cat walking", seconds=SECONDS, size=SIZE, model="tiny-wan", extra_body=EXTRA)
    assert created.object == "video" and created.status in ("queued", "in_progress") and created.id
    assert (created.seconds, created.size, created.model, created.prompt) == (SECONDS, SIZE, "tiny-wan",
                                                                                "a cat walking")
    done = until_finished(videos, created.id)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at is not None and done.expires_at > done.completed_at

    mp4 = videos.download_content(created.id)
    (codec, rate, width, height), frames = decode(mp4.read())
    assert (codec, rate, width, height) == ("h264", Fraction(FPS), 16, 16)
    assert frames.shape == (FRAMES, 16, 16, 3)
    assert frames.std() > 1  # not a blank video

    thumbnail = Image.open(io.BytesIO(videos.download_content(created.id, variant="thumbnail").read()))
    assert thumbnail.format == "WEBP" and thumbnail.size == (16, 16)
    with pytest.raises(openai.UnprocessableEntityError, match="spritesheet"):
        videos.download_content(created.id, variant="spritesheet")

    listed = videos.list()
    assert created.id in [v.id for v in listed.data]
    deleted = videos.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        videos.retrieve(created.id)


def test_the_same_request_makes_the_same_video_and_the_adapter_matters(served):
    """Seeded: the job's MP4 is the request's, not any video; another adapter changes it."""
    videos = client(served).videos

    def made(**extra):
        video = videos.create_and_poll(prompt="a cat walking", seconds=SECONDS, size=SIZE, poll_interval_ms=100,
                                       extra_body={**EXTRA, **extra})
        assert video.status == "completed", video.error
        return decode(videos.download_content(video.id).read())[1].astype(int)

    first, again = made(), made()
    other = made(adapters={"identity": "identity-diffusers"})
    assert np.array_equal(first, again)
    assert np.abs(first - other).mean() > 0.5
    # No seconds (the API's default): the model's default frame count, its seconds in the video object.
    default = videos.create_and_poll(prompt="a cat walking", size=SIZE, poll_interval_ms=100, extra_body=EXTRA)
    assert default.status == "completed" and default.seconds == SECONDS
    assert np.array_equal(decode(videos.download_content(default.id).read())[1].astype(int), first)


def test_a_video_at_the_steps_its_adapter_declared_says_so(served, declared):
    """No steps asked for: the adapter's declared ones are run, and the video object says so once
    the video is made (as images answer ``adapter_defaults``)."""
    videos = client(served).videos
    video = videos.create_and_poll(prompt="a cat walking", seconds=SECONDS, size=SIZE, poll_interval_ms=100,
                                   extra_body={"seed": 7, "adapters": {"identity": str(declared)}})
    assert video.status == "completed", video.error
    assert video.to_dict()["adapter_defaults"] == {"num_inference_steps": {"value": STEPS, "slots": ["identity"]}}
    own = videos.create_and_poll(prompt="a cat walking", seconds=SECONDS, size=SIZE, poll_interval_ms=100,
                                 extra_body={**EXTRA, "adapters": {"identity": str(declared)}})
    assert own.status == "completed" and "adapter_defaults" not in own.to_dict()  # the request's own steps won
    # Both ran 2 steps from one seed and adapter: the same video, whoever chose the steps.
    assert np.array_equal(decode(videos.download_content(video.id).read())[1],
                          decode(videos.download_content(own.id).read())[1])


def test_another_keys_video_does_not_exist(served):
    mine = client(served).videos.create(prompt="a cat", seconds=SECONDS, size=SIZE, extra_body=EXTRA)
    theirs = client(served, BOB).videos
    # No model asked for: the served one by its id, never its path on the server's disk.
    assert mine.model == "hotlora/tiny-wan"  # the tiny model's hotlora.json model_id
    with pytest.raises(openai.NotFoundError):
        theirs.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.download_content(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.delete(mine.id)
    assert mine.id not in [v.id for v in theirs.list().data]
    assert until_finished(client(served).videos, mine.id).status == "completed"  # Bob's delete touched nothing
    # A job id of the jobs resource is the video's: the same record, one mechanism.
    job = httpx.get(f"{served.url}/v1/jobs/{mine.id}", headers={"authorization": f"Bearer {ALICE}"}, timeout=30)
    assert job.status_code == 200 and job.json()["kind"] == "video" and job.json()["result"]["media_type"] == "video/mp4"


@pytest.mark.parametrize(("fields", "message"), [
    ({"seconds": "0.3"}, "not a whole number of frames"),
    ({"seconds": "0.5"}, re.escape(f"served: {SECONDS} ({FRAMES} frames)")),  # 9 frames: 4k + 1, but not the served count
    ({"seconds": "soon"}, "seconds must be a number"),
    ({"size": "32x32"}, "not served"),
    ({"size": "big"}, "WIDTHxHEIGHT"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
])
def test_bad_input_is_refused_before_any_job(served, fields, message):
    videos = client(served).videos
    before = {v.id for v in videos.list(limit=100).data}
    extra = {k: v for k, v in fields.items() if k not in ("seconds", "size")}
    with pytest.raises(openai.UnprocessableEntityError, match=message) as refused:
        videos.create(prompt="a cat", seconds=fields.get("seconds", SECONDS), size=fields.get("size", SIZE),
                      extra_body={**EXTRA, **extra})
    assert set(refused.value.body) == {"message", "type"}  # OpenAI's error shape (the client unwraps "error")
    assert {v.id for v in videos.list(limit=100).data} == before


def test_an_image_upload_and_a_body_without_a_prompt_are_refused(served):
    """A text-to-video engine: input_reference asks for image-to-video, which it does not serve; a file
    under another field name, and a body without a prompt."""
    headers = {"authorization": f"Bearer {ALICE}"}
    upload = httpx.post(f"{served.url}/v1/videos", data={"prompt": "a cat"}, headers=headers, timeout=30,
                        files={"input_reference": ("ref.png", b"\x89PNG", "image/png")})
    assert upload.status_code == 422
    assert "'image-to-video' is not served" in upload.json()["error"]["message"], upload.text
    other = httpx.post(f"{served.url}/v1/videos", data={"prompt": "a cat"}, headers=headers, timeout=30,
                       files={"reference": ("ref.png", b"\x89PNG", "image/png")})
    assert other.status_code == 422
    assert "the files taken are input_reference (image-to-video's first frame) and last_frame" in other.json()["error"]["message"]
    empty = httpx.post(f"{served.url}/v1/videos", json={"seconds": SECONDS}, headers=headers, timeout=30)
    assert empty.status_code == 422 and "prompt" in empty.json()["error"]["message"]


def test_generate_answers_a_video_as_mp4_by_default_and_checks_its_format(served):
    headers = {"authorization": f"Bearer {ALICE}"}
    body = {"prompt": "a cat", "num_inference_steps": STEPS, "seed": 7}
    mp4 = httpx.post(f"{served.url}/v1/generate", json=body, headers=headers, timeout=120)
    assert mp4.status_code == 200, mp4.text
    answer = mp4.json()
    assert (answer["format"], answer["frames"], answer["fps"]) == ("mp4", FRAMES, FPS)
    facts, frames = decode(base64.b64decode(answer["images"][0]))
    assert facts == ("h264", Fraction(FPS), 16, 16) and len(frames) == FRAMES

    webp = httpx.post(f"{served.url}/v1/generate", json={**body, "output_format": "webp"}, headers=headers, timeout=120)
    animated = Image.open(io.BytesIO(base64.b64decode(webp.json()["images"][0])))
    assert animated.format == "WEBP" and animated.n_frames == FRAMES
    pngs = httpx.post(f"{served.url}/v1/generate", json={**body, "output_format": "png"}, headers=headers, timeout=120)
    assert len(pngs.json()["images"]) == FRAMES  # one PNG per frame

    jpeg = httpx.post(f"{served.url}/v1/generate", json={**body, "output_format": "jpeg"}, headers=headers, timeout=30)
    assert jpeg.status_code == 422 and "mp4, webp, png" in jpeg.json()["error"]
    images = httpx.post(f"{served.url}/v1/images/generations", json={"prompt": "a cat"}, headers=headers, timeout=30)
    assert images.status_code == 422 and "/v1/videos" in images.json()["error"]["message"]


def test_a_video_job_from_generate_is_served_as_mp4_and_listed_as_a_video(served):
    headers = {"authorization": f"Bearer {ALICE}"}
    accepted = httpx.post(f"{served.url}/v1/generate", json={"prompt": "a cat", "num_inference_steps": STEPS},
                          headers={**headers, "prefer": "respond-async"}, timeout=30)
    assert accepted.status_code == 202 and accepted.json()["kind"] == "video"
    job_id = accepted.json()["id"]
    assert until_finished(client(served).videos, job_id).status == "completed"
    content = httpx.get(f"{served.url}/v1/jobs/{job_id}/content", headers={**headers, "accept": "video/mp4"},
                        timeout=30)
    assert content.headers["content-type"] == "video/mp4"
    assert decode(content.content)[1].shape == (FRAMES, 16, 16, 3)
    assert job_id in [v.id for v in client(served).videos.list().data]


@pytest.fixture(scope="module")
def two_experts(tmp_path_factory, start_server):
    """A Wan 2.2 A14B-shaped tiny model (two experts, ``boundary_ratio``), served eager."""
    from hotlora.testing import save_tiny_model

    tmp = tmp_path_factory.mktemp("two-experts")
    model = save_tiny_model(tmp / "wan", "wan", target_rank=8, variant="two-experts")
    return model, start_server(model, tmp, roots=(model / "adapters",), compile=False, batch_size=1)


def png_frames(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB"))
                     for f in response.json()["images"]])


def test_a_request_names_each_experts_file_and_gets_plain_diffusers_pair(two_experts):
    """What users ship for Wan 2.2: a high-noise and a low-noise LoRA file. Named per slot
    (``{"ref": high, "low_noise": low}``), they are served as diffusers loads them (the low one
    with ``load_into_transformer_2=True``), the same frames as the two in one pair file; the
    low-noise part counts; a low-noise file that is a pair itself is refused, nothing run."""
    from hotlora.testing import plain_diffusers_reference

    model, server = two_experts
    adapters = model / "adapters"
    high, low = adapters / "experts-high", adapters / "experts-low"
    # Two steps of the tiny scheduler fall on both sides of the boundary (test_video.py): both experts run.
    body = {"prompt": "a cat", "seed": 7, "num_inference_steps": STEPS, "guidance_scale": 5.0, "output_format": "png"}

    def frames(spec):
        return png_frames(httpx.post(f"{server.url}/v1/generate", json={**body, "adapters": {"identity": spec}},
                                     timeout=300))

    named = frames({"ref": str(high), "low_noise": str(low), "scale": 0.9})
    reference = plain_diffusers_reference(model, {"identity": ((high, low), 0.9)}, prompt="a cat", num_images=1,
                                          num_inference_steps=STEPS, guidance_scale=5.0, height=16, width=16, seed=7,
                                          num_frames=FRAMES, output_type="np")
    expected = (np.clip(reference[0], 0, 1) * 255).round().astype(np.uint8)
    assert named.shape == expected.shape == (FRAMES, 16, 16, 3)
    assert np.abs(named.astype(int) - expected.astype(int)).max() <= 1
    assert np.array_equal(named, frames({"ref": str(adapters / "experts-pair"), "scale": 0.9}))
    # The low-noise part counts: at this tiny model's 2 steps it moves a pixel by one level at scale
    # 0.9, so at scale 4 (the VAE maps small latent changes to nothing) it must move some by far more.
    louder = {"ref": str(high), "low_noise": str(low), "scale": 4.0}
    assert np.abs(frames(louder).astype(int) - frames({"ref": str(high), "scale": 4.0}).astype(int)).max() > 8

    refused = httpx.post(f"{server.url}/v1/generate", timeout=60, json={
        **body, "adapters": {"identity": {"ref": str(high), "low_noise": str(adapters / "experts-pair")}}})
    assert refused.status_code == 422 and "not one expert's LoRA" in refused.json()["error"], refused.text


def test_a_low_noise_file_on_a_model_of_one_transformer_is_refused_before_any_job(served):
    videos = client(served).videos
    before = {v.id for v in videos.list(limit=100).data}
    spec = {"ref": "identity-diffusers", "low_noise": "style-diffusers"}
    with pytest.raises(openai.UnprocessableEntityError, match="one denoiser"):
        videos.create(prompt="a cat", seconds=SECONDS, size=SIZE, extra_body={**EXTRA, "adapters": {"identity": spec}})
    assert {v.id for v in videos.list(limit=100).data} == before


def test_a_request_sets_the_shift_and_the_low_noise_experts_guidance(two_experts, served):
    """``shift`` and ``guidance_scale_2`` over HTTP: the frames plain diffusers makes with them (the
    shift as a diffusers user sets it, a scheduler ``from_config``); on a model of one transformer
    the openai client's ``guidance_scale_2`` is a 422 before any job."""
    from hotlora.testing import plain_diffusers_reference

    model, server = two_experts
    body = {"prompt": "a cat", "seed": 7, "num_inference_steps": STEPS, "guidance_scale": 5.0, "output_format": "png",
            "guidance_scale_2": 2.0, "shift": 3.0}
    made = png_frames(httpx.post(f"{server.url}/v1/generate", json=body, timeout=300))

    def at_shift(pipeline):
        pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, shift=3.0)

    reference = plain_diffusers_reference(model, {}, prompt="a cat", num_images=1, num_inference_steps=STEPS,
                                          guidance_scale=5.0, height=16, width=16, seed=7, num_frames=FRAMES,
                                          output_type="np", prepare=at_shift,
                                          task_arguments={"guidance_scale_2": 2.0})
    expected = (np.clip(reference[0], 0, 1) * 255).round().astype(np.uint8)
    assert np.abs(made.astype(int) - expected.astype(int)).max() <= 1
    own = {k: v for k, v in body.items() if k not in ("guidance_scale_2", "shift")}
    unshifted = png_frames(httpx.post(f"{server.url}/v1/generate", json=own, timeout=300))
    # They reached the pipeline: the same eager request without them is another video (the tiny VAE
    # maps even large latent changes to a level or so; test_run_options.py measures the latents).
    assert not np.array_equal(made, unshifted)

    videos = client(served).videos
    before = {v.id for v in videos.list(limit=100).data}
    with pytest.raises(openai.UnprocessableEntityError, match="guidance_scale_2 is taken by a model of two experts"):
        videos.create(prompt="a cat", seconds=SECONDS, size=SIZE, extra_body={**EXTRA, "guidance_scale_2": 3.0})
    with pytest.raises(openai.UnprocessableEntityError, match=r"shift must be a number in \(0, 100\]"):
        videos.create(prompt="a cat", seconds=SECONDS, size=SIZE, extra_body={**EXTRA, "shift": 0})
    assert {v.id for v in videos.list(limit=100).data} == before


@pytest.mark.families
@pytest.mark.parametrize("name", ["ltx", "ltx2"])
def test_an_ltx_video_through_the_openai_client(tiny_models, tmp_path_factory, start_server, name):
    """LTX-Video and LTX-2 served as Wan is: the job made, polled and downloaded, an MP4 of the tiny
    model's 8k + 1 frames at the family's rate (25 fps, 24); seconds that make another count are a 422
    before any job, as is one step where the family needs two (LTX-Video's scheduler)."""
    family = FAMILIES[name]
    model = tiny_models[name]
    side = family.tiny_size
    server = start_server(model, tmp_path_factory.mktemp(f"{name}-videos"), roots=(model / "adapters",),
                          compile=False, batch_size=1, sizes=f"{side}x{side}")
    videos = client(server).videos
    seconds = f"{(family.tiny_frames - 1) / family.fps:g}"
    extra = {"num_inference_steps": STEPS, "seed": 3, "adapters": {"style": "style-comfy.safetensors"}}
    created = videos.create(prompt="a cat walking", seconds=seconds, size=f"{side}x{side}", extra_body=extra)
    done = until_finished(videos, created.id)
    assert done.status == "completed", done.error
    content = videos.download_content(created.id).read()
    (codec, rate, width, height), frames = decode(content)
    assert (codec, rate, width, height) == ("h264", Fraction(family.fps), side, side)
    assert frames.shape == (family.tiny_frames, side, side, 3) and frames.std() > 1
    with av.open(io.BytesIO(content)) as container:  # LTX-2's sound track, at its tiny vocoder's rate
        sound = [(s.codec_context.name, s.rate, s.channels) for s in container.streams.audio]
    assert sound == ([("aac", 16000, 2)] if name == "ltx2" else [])
    with pytest.raises(openai.UnprocessableEntityError,
                       match=rf"\(5 frames at {family.fps} fps\) is not served; served: {seconds} "):
        videos.create(prompt="a cat", seconds=f"{4 / family.fps:g}", size=f"{side}x{side}")
    # No seconds: the default frame count, reported as its seconds.
    default = videos.create(prompt="a cat", size=f"{side}x{side}", extra_body=extra)
    assert default.seconds == seconds and until_finished(videos, default.id).status == "completed"
    if family.min_steps == 2:
        with pytest.raises(openai.UnprocessableEntityError, match=r"num_inference_steps must be an integer in 2\.\."):
            videos.create(prompt="a cat", seconds=seconds, size=f"{side}x{side}", extra_body={"num_inference_steps": 1})


@pytest.fixture(scope="module")
def image_to_video(tmp_path_factory, start_server):
    """A Wan2.1-I2V-shaped tiny model (its image encoder too), served eager with its one task."""
    from hotlora.testing import save_tiny_model

    tmp = tmp_path_factory.mktemp("i2v")
    model = save_tiny_model(tmp / "wan", "wan", target_rank=8, variant="i2v")
    return model, start_server(model, tmp, roots=(model / "adapters",), compile=False, batch_size=1,
                               tasks="image-to-video", sizes=SIZE)


def test_image_to_video_with_the_openai_client_and_on_generate_equal_to_plain_diffusers(image_to_video):
    """The openai client's ``input_reference`` upload makes a video from that first frame (the
    pipeline runs on none without it); /v1/generate with the image in JSON (its task implied) gives the
    frames plain diffusers' image-to-video pipeline gives (the tiny VAE maps the first frame's effect on
    the latents, test_image_to_video.py, to under a level: pixels cannot tell two first frames apart);
    a request without an image, or with one that is no image, is refused by name at create."""
    from hotlora.testing import plain_diffusers_reference

    model, server = image_to_video
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((24, 20, 3)) * 255).astype(np.uint8))]
    pngs = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    videos = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120).videos
    video = videos.create_and_poll(prompt="a cat walking", input_reference=("first.png", pngs[0], "image/png"),
                                   seconds=SECONDS, size=SIZE, poll_interval_ms=100,
                                   extra_body={"num_inference_steps": STEPS, "seed": 7})
    assert video.status == "completed", video.error
    facts, frames = decode(videos.download_content(video.id).read())
    assert facts[0] == "h264" and frames.shape == (FRAMES, 16, 16, 3)
    # An uploaded image is decoded when the job is created: one that is no image is a 415 (as on the
    # direct routes), and no job is made.
    listed = len(videos.list().data)
    with pytest.raises(openai.APIStatusError, match=r"not an accepted image; send PNG, JPEG or WebP") as refused:
        videos.create(prompt="a cat", input_reference=("first.png", b"not an image", "image/png"), seconds=SECONDS)
    assert refused.value.status_code == 415 and len(videos.list().data) == listed

    body = {"prompt": "a cat", "seed": 7, "num_inference_steps": STEPS, "output_format": "png",
            "images": [base64.b64encode(pngs[0]).decode()],
            "adapters": {"identity": {"ref": str(model / "adapters" / "identity-diffusers"), "scale": 0.9}}}
    frames = png_frames(httpx.post(f"{server.url}/v1/generate", json=body, timeout=300))
    reference = plain_diffusers_reference(model, {"identity": (model / "adapters" / "identity-diffusers", 0.9)},
                                          prompt="a cat", num_images=1, num_inference_steps=STEPS,
                                          guidance_scale=FAMILIES["wan"].default_guidance, height=16, width=16, seed=7,
                                          num_frames=FRAMES, output_type="np", pipeline_class="WanImageToVideoPipeline",
                                          task_arguments={"image": Image.open(io.BytesIO(pngs[0])).convert("RGB")})
    expected = (np.clip(reference[0], 0, 1) * 255).round().astype(np.uint8)
    assert frames.shape == expected.shape == (FRAMES, 16, 16, 3)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1

    text_only = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "seconds": SECONDS}, timeout=30)
    assert text_only.status_code == 422 and "give an input image" in text_only.json()["error"]["message"], text_only.text
    # A last frame (hotlora's ``last_frame`` file beside the first) reaches the engine, which says which
    # checkpoints take one; a last frame without a first is refused at the route.
    both = httpx.post(f"{server.url}/v1/videos", data={"prompt": "a cat", "seconds": SECONDS},
                      files={"input_reference": ("first.png", pngs[0], "image/png"),
                             "last_frame": ("last.png", pngs[0], "image/png")}, timeout=30)
    assert both.status_code == 422 and "a last frame is taken by Wan2.1-FLF2V-14B" in both.json()["error"]["message"]
    alone = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "last_frame": body["images"][0]}, timeout=30)
    assert alone.status_code == 422 and "last_frame needs a first frame" in alone.json()["error"]["message"], alone.text

