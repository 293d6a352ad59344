"""Image-conditioned requests over HTTP: a tiny Flux server started with image-to-image, inpaint
and edit (Kontext), reached through the official ``openai`` client's ``images.edit`` (multipart),
``huggingface_hub``'s ``InferenceClient.image_to_image`` and the JSON API (base64 and URLs
fetched under the egress policy); each answer equal to plain diffusers' variant pipeline with the
same adapters; hostile input images refused before the engine."""

import base64
import io
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from hotlora.families import family_named

from ..helpers import pixels, reply, serving_app

STEPS = 3
STRENGTH = 0.5  # of 3 steps: the first step runs below sigma 1, so the input image still counts
PROMPT = "the same portrait, at dusk"
SCALES = {"identity": 0.9, "style": 0.6}
FAST_S = 3.0  # a refused input is answered in milliseconds; this only bounds a hang


def photo(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory, start_server):
    model = tiny_models["flux"]
    adapters = model / "adapters"
    server = start_server(model, tmp_path_factory.mktemp("tasks"), roots=(adapters,),
                          catalog=str(adapters / "catalog.toml"), compile=False,
                          tasks=("image-to-image", "inpaint", "edit"), store_overrides={"allow_http": True})
    ready = httpx.get(f"{server.url}/readyz").json()["engine"]
    return server, model, ready


def adapter_pair(model):
    root = model / "adapters"
    return {slot: root / f"{slot}-diffusers" for slot in SCALES}


def plain(model, ready, task, image, mask=None, seed=0):
    """Plain diffusers' variant pipeline with the same adapters, as uint8 pixels."""
    from hotlora.testing import plain_diffusers_reference

    family = family_named("flux")
    height, width = ready["height"], ready["width"]
    arguments = family.task_arguments(task, [image], None if mask is None else [mask],
                                      STRENGTH if task != "edit" else None, 1)
    out = plain_diffusers_reference(
        model, {slot: (path, SCALES[slot]) for slot, path in adapter_pair(model).items()}, prompt=PROMPT,
        num_images=1, num_inference_steps=STEPS, guidance_scale=ready["defaults"]["guidance_scale"], height=height,
        width=width, seed=seed, output_type="np", pipeline_class=family.task_pipelines[task], task_arguments=arguments)
    return (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)


def json_adapters(model):
    return {slot: {"ref": str(path), "scale": SCALES[slot]} for slot, path in adapter_pair(model).items()}


def close(served_pixels: np.ndarray, expected: np.ndarray) -> None:
    assert served_pixels.shape == expected.shape
    assert np.abs(served_pixels.astype(int) - expected.astype(int)).max() <= 1


def test_the_openai_clients_images_edit_equals_plain_diffusers(served):
    """``openai.images.edit``: one image is an edit (Kontext), an image and a mask an inpaint."""
    openai = pytest.importorskip("openai")
    server, model, ready = served
    height, width = ready["height"], ready["width"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=300)
    image = photo(height, width, 1)
    extra = {"adapters": json_adapters(model), "num_inference_steps": STEPS}
    edited = client.images.edit(image=("photo.png", png(image), "image/png"), prompt=PROMPT,
                                size=f"{width}x{height}", extra_body={**extra, "seed": 0})
    close(pixels_of(edited.data[0].b64_json), plain(model, ready, "edit", image))

    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, height // 2, width, height))
    inpainted = client.images.edit(image=("photo.png", png(image), "image/png"), prompt=PROMPT,
                                   mask=("mask.png", png(mask), "image/png"),
                                   extra_body={**extra, "seed": 0, "strength": STRENGTH})
    close(pixels_of(inpainted.data[0].b64_json), plain(model, ready, "inpaint", image, mask))


def pixels_of(b64_json: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64_json))).convert("RGB"))


def test_the_hf_clients_image_to_image_equals_the_json_api_and_plain_diffusers(served, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # the suite's HF_HUB_OFFLINE: 127.0.0.1 too
    server, model, ready = served
    height, width = ready["height"], ready["width"]
    image = photo(height, width, 2)
    hf = InferenceClient(model=server.url, timeout=300).image_to_image(
        png(image), prompt=PROMPT, num_inference_steps=STEPS, strength=STRENGTH, task="image-to-image",
        adapters=json_adapters(model))
    expected = plain(model, ready, "image-to-image", image)
    close(np.asarray(hf.convert("RGB")), expected)
    body = {"prompt": PROMPT, "task": "image-to-image", "images": [f"data:image/png;base64,{b64(png(image))}"],
            "strength": STRENGTH, "num_inference_steps": STEPS, "adapters": json_adapters(model)}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    close(pixels(answer)[0], expected)
    # Another input image, the same everything else: the image is what changed the answer.
    other = httpx.post(f"{server.url}/v1/generate", json={**body, "images": [b64(png(photo(height, width, 9)))]},
                       timeout=300)
    assert np.abs(pixels(other)[0].astype(int) - expected.astype(int)).max() > 8


def test_an_input_image_by_url_is_fetched_under_the_egress_policy(served):
    server, model, ready = served
    height, width = ready["height"], ready["width"]
    data = png(photo(height, width, 3))
    with serving_app(lambda handler, method: reply(handler, 200, data, {"Content-Type": "image/png"})) as (_, url):
        body = {"prompt": PROMPT, "images": [f"{url}/photo.png"], "num_inference_steps": STEPS,
                "adapters": json_adapters(model)}
        by_url = httpx.post(f"{server.url}/v1/generate", json=body, timeout=300)
        assert by_url.status_code == 200, by_url.text
    inline = httpx.post(f"{server.url}/v1/generate", json={**body, "images": [b64(data)]}, timeout=300)
    assert np.array_equal(pixels(by_url), pixels(inline))  # no task named: one image without a mask is an edit
    for internal in ("http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data/"):
        refused = httpx.post(f"{server.url}/v1/generate", json={**body, "images": [internal]}, timeout=30)
        assert refused.status_code == 403 and refused.json()["type"] == "UnsafeReference", refused.text


def bomb() -> bytes:
    """A 13000 x 13000 one-bit PNG of ~30 KB: Pillow's default would only warn."""
    out = io.BytesIO()
    Image.new("1", (13000, 13000)).save(out, "PNG")
    return out.getvalue()


def test_hostile_input_images_are_refused_before_the_engine(served):
    server, model, ready = served
    good = png(photo(ready["height"], ready["width"], 4))
    jpeg = io.BytesIO()
    photo(64, 64, 5).save(jpeg, "JPEG")
    cases = {
        "bomb": (b64(bomb()), 413, "input_image_max_pixels|input_image_max_side"),
        "truncated": (b64(jpeg.getvalue()[: len(jpeg.getvalue()) // 2]), 422, "truncated|corrupt|incomplete"),
        "a GIF": (b64(b"GIF89a" + b"\x00" * 64), 415, "PNG, JPEG or WebP"),
        "not base64": ("%%%not-base64%%%", 422, "base64"),
    }
    before = httpx.get(f"{server.url}/readyz").json()
    for name, (image, status, message) in cases.items():
        began = time.monotonic()
        answer = httpx.post(f"{server.url}/v1/generate", json={"prompt": PROMPT, "images": [image]}, timeout=30)
        assert answer.status_code == status, (name, answer.text)
        assert any(word in answer.json()["error"] for word in message.split("|")), (name, answer.text)
        assert time.monotonic() - began < FAST_S, name
    # Two references where the engine warmed up one: refused as a shape nothing compiled.
    two = httpx.post(f"{server.url}/v1/generate", json={"prompt": PROMPT, "images": [b64(good)] * 2}, timeout=30)
    assert two.status_code == 422 and two.json()["type"] == "UnservedTask" and "max_reference_images" in two.text
    after = httpx.get(f"{server.url}/readyz").json()
    assert after["rebuilds"] == before["rebuilds"]
    assert after["engine"]["recompiles"] == before["engine"]["recompiles"]


def test_the_edits_route_takes_only_image_files_as_images(served):
    server, _, ready = served
    image = png(photo(ready["height"], ready["width"], 6))
    form = httpx.post(f"{server.url}/v1/images/edits", data={"prompt": PROMPT, "image": b64(image)},
                      files={"mask": ("m.png", image, "image/png")}, timeout=30)
    assert form.status_code == 422 and "must be a file" in form.json()["error"]["message"]
    for not_multipart in ({"json": {"prompt": PROMPT}}, {"data": {"prompt": PROMPT}}):
        assert httpx.post(f"{server.url}/v1/images/edits", timeout=30, **not_multipart).status_code == 415
    bad_size = httpx.post(f"{server.url}/v1/images/edits", data={"prompt": PROMPT, "size": "huge"},
                          files={"image": ("p.png", image, "image/png")}, timeout=30)
    assert bad_size.status_code == 422 and "size" in bad_size.json()["error"]["message"]


def test_what_decoding_did_to_an_input_image_is_said_in_the_answer(served):
    """An animated PNG's first frame is taken, a CMYK JPEG converted, a declared type the content
    contradicts overruled: served, and each said (the JSON body's and the OpenAI answer's
    ``input_notes``, the Hugging Face answer's header)."""
    server, _, ready = served
    height, width = ready["height"], ready["width"]
    frames = [photo(height, width, 7), photo(height, width, 8)]
    animated = io.BytesIO()
    frames[0].save(animated, "PNG", save_all=True, append_images=frames[1:])
    body = {"prompt": PROMPT, "num_inference_steps": 1, "images": [f"data:image/jpeg;base64,{b64(animated.getvalue())}"]}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    notes = answer.json()["input_notes"]
    assert any("first of 2 frames" in note for note in notes) and any("declared as 'image/jpeg'" in n for n in notes)
    cmyk = io.BytesIO()
    frames[0].convert("CMYK").save(cmyk, "JPEG")
    edit = httpx.post(f"{server.url}/v1/images/edits", data={"prompt": PROMPT, "num_inference_steps": "1"},
                      files={"image": ("c.jpg", cmyk.getvalue(), "image/jpeg")}, timeout=300)
    assert edit.status_code == 200, edit.text
    assert any("CMYK converted" in note for note in edit.json()["input_notes"])
    hf = httpx.post(f"{server.url}/", json={"inputs": b64(animated.getvalue()),
                                            "parameters": {"prompt": PROMPT, "num_inference_steps": 1}}, timeout=300)
    assert hf.status_code == 200 and "first of 2 frames" in hf.headers["x-hotlora-input-notes"]


@pytest.mark.families
def test_a_qwen_image_edit_of_two_photos_through_the_openai_client_equals_plain_diffusers(
        tiny_task_models, tmp_path_factory, start_server):
    """Qwen-Image-Edit-Plus over HTTP: the official client's ``images.edit`` with two images (its
    multipart ``image[]``) is one edit with two references, as plain diffusers' edit pipeline makes it
    from the same two photos fitted to the served size (``engine.inputs.fitted``, what the server does);
    a third photo is more than the server warmed up: a 422 listing what is served. The engine runs in
    the server's process here (``engine_process=False``): the tiny model's references are shrunk for
    these CPUs by patching the pipeline module (``small_edit_references``), which a spawned engine
    process would not see. The engine process itself is tested with Flux (test_engine_process.py)."""
    openai = pytest.importorskip("openai")
    from hotlora.engine.inputs import fitted
    from hotlora.testing import plain_diffusers_reference

    from ..helpers import small_edit_references

    family, model = family_named("qwenimage"), tiny_task_models["qwenimage"]
    adapters = model / "adapters"
    with small_edit_references():
        server = start_server(model, tmp_path_factory.mktemp("qwen-edit"), roots=(adapters,), compile=False,
                              engine_process=False, tasks=("edit",), max_reference_images=2, batch_size=1)
        ready = httpx.get(f"{server.url}/readyz").json()["engine"]
        height, width = ready["height"], ready["width"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=300)
        photos = [photo(48, 40, 1), photo(32, 32, 2)]  # neither at the served size: each is fitted to it
        files = [(f"photo{i}.png", png(p), "image/png") for i, p in enumerate(photos)]
        extra = {"adapters": json_adapters(model), "num_inference_steps": STEPS, "seed": 0}
        edited = client.images.edit(image=files, prompt=PROMPT, size=f"{width}x{height}", extra_body=extra)
        given = [Image.fromarray(fitted(np.asarray(p), height, width)) for p in photos]
        expected = plain_diffusers_reference(
            model, {slot: (path, SCALES[slot]) for slot, path in adapter_pair(model).items()}, prompt=PROMPT,
            num_images=1, num_inference_steps=STEPS, guidance_scale=ready["defaults"]["guidance_scale"],
            height=height, width=width, seed=0, output_type="np", pipeline_class=family.task_pipelines["edit"],
            task_arguments=family.task_arguments("edit", given, None, None, 2))
        close(pixels_of(edited.data[0].b64_json), (np.clip(expected[0], 0, 1) * 255).round().astype(np.uint8))
        one = client.images.edit(image=files[:1], prompt=PROMPT, size=f"{width}x{height}", extra_body=extra)
        assert not np.array_equal(pixels_of(one.data[0].b64_json), pixels_of(edited.data[0].b64_json))
        with pytest.raises(openai.UnprocessableEntityError, match=r"edit with 3 reference images is not served"):
            client.images.edit(image=files + files[:1], prompt=PROMPT, size=f"{width}x{height}", extra_body=extra)
