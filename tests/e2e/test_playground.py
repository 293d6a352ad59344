"""The playground in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium)
against a real ``hotlora serve`` on the tiny model; and the progress stream it reads."""

import json
import shutil
import time

import httpx
import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, start_server):
    adapters = tiny_models["flux"] / "adapters"
    return start_server(tiny_models["flux"], tmp_path_factory.mktemp("playground"), roots=(adapters,),
                        catalog=str(adapters / "catalog.toml"), compile=False, batch_size=6)


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), "make test installs chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


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
    events = []
    with httpx.stream("POST", f"{server.url}/v1/generate/stream", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
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
    browser.save_screenshot(str(tmp_path / "playground.png"))

    fill("identity", "../../etc/passwd")
    browser.find_element(By.ID, "generate").click()
    message = wait_for(lambda: browser.find_element(By.ID, "error").text)
    assert "adapter path '../../etc/passwd' contains '..'" in message
    browser.save_screenshot(str(tmp_path / "playground-error.png"))
