"""The playground in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium)
against a real ``hotlora serve`` on the tiny model; and the progress stream it reads. On a server
with image tasks: the task selector, the image drop zone (a picked file and a synthetic drop), the
strength slider and the mask brush, each request the page sends equal to the same one sent direct."""

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from ..helpers import sse_events


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, start_server):
    adapters = tiny_models["flux"] / "adapters"
    return start_server(tiny_models["flux"], tmp_path_factory.mktemp("playground"), roots=(adapters,),
                        catalog=str(adapters / "catalog.toml"), compile=False, batch_size=6)


@pytest.fixture(scope="module")
def tasks_server(tiny_models, tmp_path_factory, start_server):
    """Tiny Flux with the image tasks (as tests/e2e/test_tasks_server.py's), uncompiled, and batch 1:
    warm-up runs each task at the batch size, so a smaller one readies sooner (measured on 2 cores:
    ~25 s at batch 1, ~60 s at 3), and these tests ask for one image at a time."""
    return start_server(tiny_models["flux"], tmp_path_factory.mktemp("playground-tasks"), compile=False,
                        batch_size=1, tasks=("image-to-image", "inpaint", "edit"))


# Wraps the page's fetch (which it resolves at each call) to keep every POST it makes: what the
# page sent, read back as the server got it.
RECORD_POSTS = """
window.sentPosts = [];
const send = window.fetch;
window.fetch = (url, init) => {
  if (init && init.method === "POST") window.sentPosts.push({url: String(url), body: init.body});
  return send(url, init);
};
"""

# Selenium cannot drag an OS file: the drop a browser would make, from a data URL, on the zone.
DROP = """
const [dataURL, name, type] = arguments;
const bytes = Uint8Array.from(atob(dataURL.slice(dataURL.indexOf(",") + 1)), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], name, {type}));
const zone = document.getElementById("drop");
for (const kind of ["dragenter", "dragover", "drop"]) {
  zone.dispatchEvent(new DragEvent(kind, {dataTransfer: transfer, bubbles: true, cancelable: true}));
}
"""

PROMPT, STEPS = "the same portrait, at dusk", 3


def photo(height: int, width: int, seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def decoded(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def generate_posts(browser) -> list[dict]:
    return [json.loads(p["body"]) for p in browser.execute_script("return window.sentPosts")
            if p["url"].endswith("/v1/generate/stream")]


def open_with_tasks(browser, server):
    from selenium.webdriver.common.by import By

    engine = httpx.get(f"{server.url}/readyz").json()["engine"]
    browser.get(server.url)
    wait_for(lambda: browser.find_element(By.ID, "image-controls").is_displayed())
    assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#task option")] \
        == engine["tasks"] == ["text-to-image", "image-to-image", "inpaint", "edit"]
    browser.execute_script(RECORD_POSTS)
    for element_id, value in (("prompt", PROMPT), ("num", "1"), ("steps", str(STEPS)), ("seed", "0")):
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    return engine


def result_pixels(browser) -> np.ndarray:
    from selenium.webdriver.common.by import By

    images = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#grid img") or
                      browser.find_element(By.ID, "error").text)
    assert not isinstance(images, str), images  # the page showed an error instead
    assert len(images) == 1
    assert wait_for(lambda: browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0",
                                                   images[0]))
    return decoded(images[0].get_attribute("src"))


def direct(server, body: dict) -> np.ndarray:
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["images"][0]))))


def wait_for(condition, timeout_s=120, every_s=0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("condition not met in time")


def test_progress_stream_counts_every_step_then_returns_the_pack(server):
    body = {"prompt": "a cat", "num_images": 8, "num_inference_steps": 5, "adapters": {"style": "style-kohya"}}
    with httpx.stream("POST", f"{server.url}/v1/generate/stream", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    steps = [data["step"] for name, data in events if name == "progress"]
    assert steps == list(range(1, 11))  # 8 images at batch 6: two chunks of 5 steps
    assert {data["total"] for name, data in events if name == "progress"} == {10}
    name, result = events[-1]
    assert name == "result" and len(result["images"]) == 8 and result["seeds"][0] == 0

    with httpx.stream("POST", f"{server.url}/v1/generate/stream", timeout=60,
                      json={"prompt": "x", "adapters": {"identity": "../../etc/passwd"}}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["status"] == 403 and "'..'" in error["error"]


def test_playground_generates_a_pack_with_two_adapters(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    assert "text/html" in httpx.get(server.url, headers={"accept": "text/html"}).headers["content-type"]
    assert httpx.get(server.url).json()["name"] == "hotlora"  # non-browsers get JSON; POST / stays the inference API

    browser.get(server.url)
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#known option"))
    options = {o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#known option")}
    assert {"identity-diffusers", "style-kohya"} <= options
    assert browser.find_element(By.CSS_SELECTOR, "dd[data-key='status']").text == "ready"
    served = httpx.get(f"{server.url}/readyz").json()["engine"]["sizes"]
    assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#sizes option")] == served
    # The model's defaults and what its family takes: flux takes guidance, not a negative prompt.
    engine = httpx.get(f"{server.url}/readyz").json()["engine"]
    assert wait_for(lambda: browser.find_element(By.ID, "steps").get_attribute("value")
                    == str(engine["defaults"]["num_inference_steps"]))
    assert browser.find_element(By.ID, "guidance").get_attribute("placeholder") == str(engine["defaults"]["guidance_scale"])
    assert browser.find_element(By.ID, "negative").get_attribute("disabled") and \
        not browser.find_element(By.ID, "guidance").get_attribute("disabled")
    assert engine["tasks"] == ["text-to-image"]
    assert not browser.find_element(By.ID, "image-controls").is_displayed()
    assert not browser.find_elements(By.CSS_SELECTOR, "#task option")
    browser.execute_script(RECORD_POSTS)

    def fill(element_id, value):
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)

    fill("identity", "identity-diffusers")
    fill("style", "style-kohya")
    fill("style-scale", "0.6")
    fill("num", "4")
    fill("steps", "6")
    fill("seed", "10")
    browser.find_element(By.ID, "generate").click()
    images = wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#grid img")) == 4 and
                      browser.find_elements(By.CSS_SELECTOR, "#grid img"))
    assert wait_for(lambda: browser.find_element(By.ID, "bar").get_attribute("aria-valuenow") == "100")
    assert browser.find_element(By.ID, "progress-text").text == "step 6 of 6 (100%)"
    captions = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#grid figcaption")]
    assert captions == [f"seed {s}, {served[0]}" for s in (10, 11, 12, 13)]  # each image: its seed and the size served
    assert all(browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", img)
               for img in images)
    stages = [row.get_attribute("data-stage") for row in browser.find_elements(By.CSS_SELECTOR, "#timings > div")]
    assert stages == ["queue", "fetch", "prepare", "swap", "generate", "encode"]
    assert browser.find_element(By.ID, "error").text == ""
    wait_for(lambda: browser.find_element(By.CSS_SELECTOR, "dd[data-key='recompiles since warm-up']").text == "0")
    (sent,) = generate_posts(browser)
    assert not {"task", "images", "mask", "strength"} & set(sent)  # the request a text-to-image page always sent
    browser.save_screenshot(str(tmp_path / "playground.png"))

    fill("identity", "../../etc/passwd")
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert "adapter path '../../etc/passwd' contains '..'" in message
    browser.save_screenshot(str(tmp_path / "playground-error.png"))


def test_playground_inpaints_a_picked_image_with_a_painted_mask(tasks_server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    engine = open_with_tasks(browser, tasks_server)
    Select(browser.find_element(By.ID, "task")).select_by_value("inpaint")
    assert browser.find_element(By.ID, "drop").is_displayed() and browser.find_element(By.ID, "strength").is_displayed()
    # Neither the size served nor square: the mask must be the input image's size, not the output's.
    height, width = engine["height"], 2 * engine["width"]
    picture = photo(height, width, 7)
    (tmp_path / "photo.png").write_bytes(picture)
    browser.find_element(By.ID, "image-file").send_keys(str(tmp_path / "photo.png"))  # the click-to-pick input
    wait_for(lambda: browser.find_element(By.ID, "mask-editor").get_attribute("data-ready"))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#thumbs img")) == 1
    canvas = browser.find_element(By.ID, "mask-canvas")
    assert (canvas.get_attribute("width"), canvas.get_attribute("height")) == (str(width), str(height))

    # Clicking Generate before painting: the page asks for a mask, and sends nothing.
    browser.find_element(By.ID, "generate").click()
    assert "needs a mask" in wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert generate_posts(browser) == []

    # One horizontal stroke through the middle, from a quarter to three quarters of the shown width
    # (the canvas is shown scaled: the page maps screen pixels to the image's).
    shown = browser.execute_script("return arguments[0].getBoundingClientRect().width", canvas)
    strokes = ActionChains(browser).move_to_element_with_offset(canvas, -round(shown / 4), 0).click_and_hold()
    for _ in range(4):
        strokes.move_by_offset(round(shown / 8), 0)
    strokes.release().perform()
    mask_url = browser.execute_script("return document.getElementById('mask-canvas').toDataURL('image/png')")
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(mask_url.split(",", 1)[1]))).convert("L"))
    assert mask.shape == (height, width)
    assert set(np.unique(mask).tolist()) == {0, 255}  # painted or not: no grey edge
    middle = mask[height // 2]
    assert middle[width // 2] == 255 and middle[int(width * 0.3)] == 255 and middle[int(width * 0.7)] == 255
    assert middle[int(width * 0.1)] == 0 and middle[int(width * 0.9)] == 0  # beyond the stroke's ends
    assert mask[0, 0] == 0 and mask[-1, -1] == 0 and mask[0, width // 2] == 0  # far from it

    strength = browser.find_element(By.ID, "strength")
    default = httpx.get(f"{tasks_server.url}/readyz").json()["engine"]["default_strengths"]["inpaint"]
    assert browser.find_element(By.ID, "strength-value").text == f"the server's default ({default:g})"
    strength.send_keys(Keys.LEFT, Keys.LEFT)  # 0.6 -> 0.5: moving the slider sets it
    assert browser.find_element(By.ID, "strength-value").text == "0.5"
    browser.find_element(By.ID, "generate").click()
    shown_result = result_pixels(browser)
    assert browser.find_element(By.ID, "error").text == ""
    browser.save_screenshot(str(tmp_path / "playground-inpaint.png"))

    (sent,) = generate_posts(browser)
    assert sent["task"] == "inpaint" and sent["strength"] == 0.5
    assert sent["images"] == [data_url(picture)] and sent["mask"] == mask_url  # the file's bytes; the canvas
    body = {"prompt": PROMPT, "num_images": 1, "num_inference_steps": STEPS, "seed": 0, "task": "inpaint",
            "images": [base64.b64encode(picture).decode()], "mask": mask_url, "strength": 0.5}
    assert np.array_equal(direct(tasks_server, body), shown_result)
    # Another mask, the same everything else: the mask is what the page's answer depended on.
    other = np.zeros((height, width), np.uint8)
    other[: height // 2] = 255
    out = io.BytesIO()
    Image.fromarray(other).save(out, "PNG")
    elsewhere = direct(tasks_server, {**body, "mask": data_url(out.getvalue())})
    assert np.abs(elsewhere.astype(int) - shown_result.astype(int)).max() > 8

    # Clear: black again, and Generate asks for a mask.
    browser.find_element(By.ID, "mask-clear").click()
    cleared = browser.execute_script("return document.getElementById('mask-canvas').toDataURL('image/png')")
    assert decoded(cleared)[..., :3].max() == 0  # RGB black (alpha opaque)
    browser.find_element(By.ID, "generate").click()
    assert "needs a mask" in wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert len(generate_posts(browser)) == 1


def test_playground_edits_a_dropped_image_and_sends_no_gif(tasks_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    engine = open_with_tasks(browser, tasks_server)
    Select(browser.find_element(By.ID, "task")).select_by_value("edit")
    assert not browser.find_element(By.ID, "strength").is_displayed()  # an edit takes no strength

    def thumbs():
        return browser.find_elements(By.CSS_SELECTOR, "#thumbs img")

    def drop(data: bytes, name: str, kind: str):
        browser.execute_script(DROP, data_url(data, kind.removeprefix("image/")), name, kind)

    # A GIF is refused in the page, by its bytes: named and typed as a PNG it is still a GIF.
    gif = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(gif, "GIF")
    for name, kind in (("anim.gif", "image/gif"), ("renamed.png", "image/png")):
        drop(gif.getvalue(), name, kind)
        message = wait_for(lambda: name in browser.find_element(By.ID, "image-message").text
                           and browser.find_element(By.ID, "image-message").text)
        assert f"{name}: not a PNG, JPEG or WebP image" in message
        assert thumbs() == []
    browser.find_element(By.ID, "generate").click()
    assert "edit needs an input image" in wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert generate_posts(browser) == []  # nothing sent: not the GIF, not a request without it

    # Dropped PNGs: as many as the engine's edits take, the one beyond refused in the page.
    limit = engine["max_reference_images"]
    references = [photo(engine["height"], engine["width"], 20 + i) for i in range(limit + 1)]
    for i, reference in enumerate(references):
        drop(reference, f"ref-{i}.png", "image/png")
        wait_for(lambda: len(thumbs()) == min(i + 1, limit) and (i < limit or
                 browser.find_element(By.ID, "image-message").text))
    assert f"at most {limit} reference image" in browser.find_element(By.ID, "image-message").text
    # A thumbnail's remove button takes its image out of what is sent.
    browser.find_element(By.CSS_SELECTOR, "#thumbs button").click()
    assert len(thumbs()) == limit - 1
    drop(references[-1], "last.png", "image/png")
    wait_for(lambda: len(thumbs()) == limit)
    browser.find_element(By.ID, "generate").click()
    shown_result = result_pixels(browser)
    assert browser.find_element(By.ID, "error").text == ""

    (sent,) = generate_posts(browser)
    sent_references = references[1:limit] + [references[-1]]
    assert sent["task"] == "edit" and sent["images"] == [data_url(r) for r in sent_references]
    assert "mask" not in sent and "strength" not in sent
    body = {"prompt": PROMPT, "num_images": 1, "num_inference_steps": STEPS, "seed": 0, "task": "edit",
            "images": [base64.b64encode(r).decode() for r in sent_references]}
    assert np.array_equal(direct(tasks_server, body), shown_result)

    # The server re-checks what the page let through: a JPEG cut short starts like one, and is
    # refused there; its words are shown as the page shows every error.
    while thumbs():
        browser.find_element(By.CSS_SELECTOR, "#thumbs button").click()
    jpeg = photo(64, 64, 5, "JPEG")
    drop(jpeg[: len(jpeg) // 2], "cut.jpg", "image/jpeg")
    wait_for(lambda: len(thumbs()) == 1)
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert any(word in message for word in ("truncated", "corrupt", "incomplete")), message
    assert len(generate_posts(browser)) == 2
    browser.save_screenshot(str(tmp_path / "playground-edit-refused.png"))
