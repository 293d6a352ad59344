"""The playground's video mode in a real headless Chromium against a real ``hotlora serve`` of the
tiny Wan model (eager, batch 1, one size, two frame counts): where ``/readyz`` says the output is
frames, the page offers the served frame counts, submits a job (``Prefer: respond-async``), shows
its progress per step from the job's events, and plays the MP4 from a blob URL of its ``/content``;
the video it made equals a direct request's; an unserved frame count's 422 and a failed job are
shown. An image-to-video model's page takes the first frame (a picked file) and sends it with the task.
(Debian's Chromium decodes H.264: the element reports the video's size and duration.)"""

import base64
import io
import json

import av
import httpx
import numpy as np
import pytest

from hotlora.families import FAMILIES
from .test_playground import RECORD_POSTS, wait_for

FPS = FAMILIES["wan"].fps
SIDE = FAMILIES["wan"].tiny_size
FRAMES = (FAMILIES["wan"].tiny_frames, FAMILIES["wan"].tiny_frames + 4)  # served: the default, and one more
STEPS = 3

# Every text the progress line shows, in order (the page's own element, observed).
WATCH_PROGRESS = """
window.progressShown = [];
new MutationObserver(() => window.progressShown.push(document.getElementById("progress-text").textContent))
  .observe(document.getElementById("progress-text"), {childList: true, characterData: true, subtree: true});
"""

# The <video> element once its first frame is decoded (loadeddata), or its error: bounded.
VIDEO_FACTS = """
const done = arguments[arguments.length - 1];
const video = document.getElementById("video");
const facts = () => ({duration: video.duration, width: video.videoWidth, height: video.videoHeight,
                      readyState: video.readyState, error: video.error && video.error.code, src: video.src,
                      canPlay: video.canPlayType('video/mp4; codecs="avc1.42E01E"')});
if (video.readyState >= 2 || video.error) done(facts());
video.addEventListener("loadeddata", () => done(facts()), {once: true});
video.addEventListener("error", () => done(facts()), {once: true});
setTimeout(() => done(facts()), 20000);
"""

# The element's current frame (the first: nothing played it), as RGBA pixels at its own size.
FIRST_FRAME = """
const video = document.getElementById("video");
const canvas = document.createElement("canvas");
canvas.width = video.videoWidth; canvas.height = video.videoHeight;
const context = canvas.getContext("2d");
context.drawImage(video, 0, 0);
return Array.from(context.getImageData(0, 0, canvas.width, canvas.height).data);
"""

# The bytes behind the blob URL the page shows, as base64.
BLOB_BYTES = """
const done = arguments[arguments.length - 1];
fetch(arguments[0]).then((r) => r.arrayBuffer()).then((buffer) => {
  let text = "";
  for (const byte of new Uint8Array(buffer)) text += String.fromCharCode(byte);
  done(btoa(text));
}).catch((err) => done("failed: " + err));
"""


@pytest.fixture(scope="module")
def video_server(tiny_models, tmp_path_factory, start_server):
    adapters = tiny_models["wan"] / "adapters"
    return start_server(tiny_models["wan"], tmp_path_factory.mktemp("playground-video"), roots=(adapters,),
                        catalog=str(adapters / "catalog.toml"), compile=False, batch_size=1,
                        sizes=f"{SIDE}x{SIDE}", frames=",".join(map(str, FRAMES)),
                        store_overrides={"allow_http": True})  # a loopback source that fails only when fetched


def decode(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        duration = float(stream.duration * stream.time_base) if stream.duration else None
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return duration, frames


def open_video_page(browser, server):
    from selenium.webdriver.common.by import By

    browser.get(server.url)
    wait_for(lambda: browser.find_element(By.ID, "video-controls").is_displayed(), timeout_s=30)
    browser.execute_script(RECORD_POSTS + WATCH_PROGRESS)
    for element_id, value in (("prompt", "a cat walking"), ("steps", str(STEPS)), ("seed", "5")):
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)


def fill(browser, element_id, value):
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def posts(browser) -> list[dict]:
    return [{"url": p["url"], **json.loads(p["body"])} for p in browser.execute_script("return window.sentPosts")]


def test_the_page_makes_a_video_job_shows_its_steps_and_plays_it(video_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    engine = httpx.get(f"{video_server.url}/readyz").json()["engine"]
    assert (engine["output"], engine["fps"], engine["frames"]) == ("frames", FPS, list(FRAMES))
    open_video_page(browser, video_server)
    offered = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#frame-counts option")]
    assert offered == [str(f) for f in FRAMES]
    assert browser.find_element(By.ID, "frames").get_attribute("value") == str(FRAMES[0])  # the default first
    assert not browser.find_element(By.ID, "num-field").is_displayed()  # one video per job
    assert browser.find_element(By.CSS_SELECTOR, "dd[data-key='output']").text.startswith(f"video (MP4, {FPS} fps")
    fill(browser, "frames", str(FRAMES[1]))
    assert browser.find_element(By.ID, "frames-seconds").text == \
        f"{FRAMES[1]} frames at {FPS} fps: {(FRAMES[1] - 1) / FPS:.2f} s"
    fill(browser, "style", "style-diffusers")
    browser.find_element(By.ID, "generate").click()

    wait_for(lambda: browser.find_element(By.ID, "video-result").is_displayed()
             or browser.find_element(By.ID, "error").text, timeout_s=60)
    assert browser.find_element(By.ID, "error").text == ""
    job_id = browser.find_element(By.ID, "video-result").get_attribute("data-job")
    # The progress shown: the job's steps, counted up to the step count, none beyond.
    shown = browser.execute_script("return window.progressShown")
    steps = [text for text in shown if text.startswith("step ")]
    assert steps and steps[-1] == f"step {STEPS} of {STEPS} (100%)", shown
    numbers = [int(text.split()[1]) for text in steps]
    assert numbers == sorted(numbers)  # counted up, never back
    assert set(steps) <= {f"step {i} of {STEPS} ({round(100 * i / STEPS)}%)" for i in range(1, STEPS + 1)}
    assert browser.find_element(By.ID, "progress-text").text == f"step {STEPS} of {STEPS} (100%)"

    (sent,) = posts(browser)
    assert sent["url"].endswith("/v1/generate")
    assert (sent["num_frames"], sent["num_images"], sent["seed"], sent["num_inference_steps"]) == \
        (FRAMES[1], 1, 5, STEPS)
    assert sent["adapters"] == {"style": {"ref": "style-diffusers", "scale": 0.8}}

    # The element plays it: Debian's Chromium decodes H.264 (its first frame decoded: loadeddata).
    facts = browser.execute_async_script(VIDEO_FACTS)
    url = browser.find_element(By.ID, "video-result").get_attribute("data-url")
    assert facts["src"] == url and url.startswith("blob:")
    assert facts["error"] is None and facts["readyState"] >= 2, facts
    assert (facts["width"], facts["height"]) == (SIDE, SIDE)
    link = browser.find_element(By.ID, "video-download")
    assert link.get_attribute("href") == url and link.get_attribute("download") == f"hotlora-{job_id}.mp4"
    caption = browser.find_element(By.ID, "video-caption").text
    assert caption == f"seed 5, {SIDE}x{SIDE}, {FRAMES[1]} frames at {FPS} fps"

    # The bytes the page shows are the job's, as a direct download of it gives them.
    page_mp4 = base64.b64decode(browser.execute_async_script(BLOB_BYTES, url))
    direct = httpx.get(f"{video_server.url}/v1/jobs/{job_id}/content", headers={"accept": "video/mp4"}, timeout=30)
    assert direct.headers["content-type"] == "video/mp4" and page_mp4 == direct.content
    duration, frames = decode(page_mp4)
    assert frames.shape == (FRAMES[1], SIDE, SIDE, 3) and frames.std() > 1
    assert facts["duration"] == pytest.approx(duration, abs=1e-3) == FRAMES[1] / FPS  # PyAV's stream duration
    # What Chromium decoded and shows (the first frame, drawn to a canvas) is that video's first frame,
    # up to the decoders' YUV -> RGB rounding.
    drawn = np.array(browser.execute_script(FIRST_FRAME), np.uint8).reshape(SIDE, SIDE, 4)[..., :3]
    difference = np.abs(drawn.astype(int) - frames[0].astype(int)).mean()
    assert difference < 3, difference  # measured: 0.9 (the second frame: 10)
    # ... and the video a direct request with the same seed makes, frame for frame.
    body = {k: v for k, v in sent.items() if k != "url"}
    again = httpx.post(f"{video_server.url}/v1/generate", json=body, timeout=120)
    assert again.status_code == 200, again.text
    assert np.array_equal(decode(base64.b64decode(again.json()["images"][0]))[1], frames)
    stages = [row.get_attribute("data-stage") for row in browser.find_elements(By.CSS_SELECTOR, "#timings > div")]
    assert stages == ["queue", "fetch", "prepare", "swap", "generate", "encode"]
    browser.save_screenshot(str(tmp_path / "playground-video.png"))


def test_an_unserved_frame_count_and_a_failed_job_are_shown(video_server, browser):
    from selenium.webdriver.common.by import By

    open_video_page(browser, video_server)
    unserved = FRAMES[1] + 4
    fill(browser, "frames", str(unserved))
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: browser.find_element(By.ID, "error").text, timeout_s=30)
    assert f"{unserved} frames is not served" in message and ", ".join(map(str, FRAMES)) in message, message
    assert not browser.find_element(By.ID, "video-result").is_displayed()
    refused = httpx.post(f"{video_server.url}/v1/generate", json={k: v for k, v in posts(browser)[-1].items()
                                                                  if k != "url"}, headers={"prefer": "respond-async"})
    assert refused.status_code == 422 and refused.json()["error"] == message  # the server's words, as they came

    # A name the store knows is missing is refused before any job is made: the 404's words shown.
    fill(browser, "frames", str(FRAMES[0]))
    fill(browser, "style", "no-such-adapter")
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: (lambda text: text if "no-such-adapter" in text else None)(
        browser.find_element(By.ID, "error").text), timeout_s=30)
    assert not message.startswith("job "), message
    assert not browser.find_element(By.ID, "video-result").is_displayed()

    # A job that is accepted, then fails (its source is found gone when fetched): its error shown.
    gone = "http://127.0.0.1:9/gone.safetensors"  # allowed by the policy; nothing listens there
    fill(browser, "style", gone)
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: (lambda text: text if text.startswith("job ") else None)(
        browser.find_element(By.ID, "error").text), timeout_s=90)
    job_id = browser.find_element(By.ID, "video-result").get_attribute("data-job")
    assert message.startswith(f"job {job_id} failed: "), message
    assert not browser.find_element(By.ID, "video-result").is_displayed()
    assert httpx.get(f"{video_server.url}/v1/jobs/{job_id}").json()["status"] == "failed"


def image_to_video_model_server(tmp_path_factory, start_server, variant: str):
    """A tiny Wan image-to-video checkpoint of ``variant`` served eager with its one task."""
    from hotlora.testing import save_tiny_model

    tmp = tmp_path_factory.mktemp(f"playground-{variant}")
    model = save_tiny_model(tmp / "wan", "wan", target_rank=8, variant=variant)
    return start_server(model, tmp, roots=(model / "adapters",), compile=False, batch_size=1, sizes=f"{SIDE}x{SIDE}",
                        tasks="image-to-video")


@pytest.fixture(scope="module")
def image_to_video_server(tmp_path_factory, start_server):
    """Wan2.1-I2V's layout: the first frame alone."""
    return image_to_video_model_server(tmp_path_factory, start_server, "i2v")


def test_an_image_to_video_models_page_takes_the_first_frame(image_to_video_server, browser, tmp_path):
    """The page of a model that makes videos from an image only: the task offered is image-to-video,
    its image a "First frame" without strength; Generate without one asks for it and sends nothing;
    with a picked file, the job carries the task and the image (a data URL) and its MP4 plays."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    open_video_page(browser, image_to_video_server)
    wait_for(lambda: browser.find_element(By.ID, "image-controls").is_displayed(), timeout_s=30)
    assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#task option")] == \
        ["image-to-video"]
    assert browser.find_element(By.ID, "image-label").text == "First frame"
    assert not browser.find_element(By.ID, "strength-row").is_displayed()
    browser.find_element(By.ID, "generate").click()
    assert "image-to-video needs an input image" in wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert posts(browser) == []

    rng = np.random.default_rng(3)
    Image.fromarray((rng.random((24, 20, 3)) * 255).astype(np.uint8)).save(tmp_path / "first.png")
    browser.find_element(By.ID, "image-file").send_keys(str(tmp_path / "first.png"))
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#thumbs img")) == 1, timeout_s=30)
    browser.find_element(By.ID, "generate").click()
    wait_for(lambda: browser.find_element(By.ID, "video-result").is_displayed()
             or browser.find_element(By.ID, "error").text, timeout_s=60)
    assert browser.find_element(By.ID, "error").text == ""
    (sent,) = posts(browser)
    assert sent["task"] == "image-to-video" and "strength" not in sent
    (image,) = sent["images"]
    assert image.startswith("data:image/png;base64,")
    assert base64.b64decode(image.split(",", 1)[1]) == (tmp_path / "first.png").read_bytes()
    facts = browser.execute_async_script(VIDEO_FACTS)
    assert facts["error"] is None and facts["readyState"] >= 2 and (facts["width"], facts["height"]) == (SIDE, SIDE)



@pytest.fixture(scope="module")
def first_last_server(tmp_path_factory, start_server):
    """Wan2.1-FLF2V's layout (its image features take both frames): a first and a last frame."""
    return image_to_video_model_server(tmp_path_factory, start_server, "i2v-first-last")


def test_a_first_last_frame_models_page_takes_both_frames_in_order(first_last_server, browser, tmp_path):
    """On a model that needs a first and a last frame the drop zone says so and adds the second image
    beside the first (a third is refused there); Generate with one asks for both and sends nothing;
    with both, the job carries them in order and its MP4 plays."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    open_video_page(browser, first_last_server)
    wait_for(lambda: browser.find_element(By.ID, "image-controls").is_displayed(), timeout_s=30)
    assert browser.find_element(By.ID, "image-label").text == "First and last frame"
    rng = np.random.default_rng(4)
    for name in ("first", "last", "third"):
        Image.fromarray((rng.random((24, 20, 3)) * 255).astype(np.uint8)).save(tmp_path / f"{name}.png")
    browser.find_element(By.ID, "image-file").send_keys(str(tmp_path / "first.png"))
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#thumbs img")) == 1, timeout_s=30)
    browser.find_element(By.ID, "generate").click()
    assert "image-to-video here takes a first and a last frame" in wait_for(
        lambda: browser.find_element(By.ID, "error").text)
    assert posts(browser) == []
    for name, count in (("last", 2), ("third", 2)):
        browser.find_element(By.ID, "image-file").send_keys(str(tmp_path / f"{name}.png"))
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#thumbs img")) == count, timeout_s=30)
    assert "third.png: a video here takes a first and a last frame" in wait_for(
        lambda: browser.find_element(By.ID, "image-message").text)
    browser.find_element(By.ID, "generate").click()
    wait_for(lambda: browser.find_element(By.ID, "video-result").is_displayed()
             or browser.find_element(By.ID, "error").text, timeout_s=60)
    assert browser.find_element(By.ID, "error").text == ""
    (sent,) = posts(browser)
    assert sent["task"] == "image-to-video"
    assert [base64.b64decode(image.split(",", 1)[1]) for image in sent["images"]] == \
        [(tmp_path / f"{name}.png").read_bytes() for name in ("first", "last")]
    facts = browser.execute_async_script(VIDEO_FACTS)
    assert facts["error"] is None and facts["readyState"] >= 2 and (facts["width"], facts["height"]) == (SIDE, SIDE)
