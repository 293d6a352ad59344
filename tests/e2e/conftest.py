"""A real uvicorn server on 127.0.0.1 in a background thread, and a real HTTP client."""

import http.server
import shutil
import threading
import time

import httpx
import pytest
import uvicorn

from hotlora.settings import ServerConfig, StoreConfig
from hotlora.server.app import create_app
from hotlora.server.run import build_serving

from ..helpers import drip, free_port

READY_TIMEOUT_S = 600
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class RunningServer:
    def __init__(self, config: ServerConfig, store_config: StoreConfig):
        self.config = config
        self.serving = build_serving(config, store_config)
        self.worker = self.serving.worker
        app = create_app(self.serving, config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning",
                                                    timeout_graceful_shutdown=int(config.drain_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{config.port}"

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=5)
                if ready.status_code == 200:
                    return self
                if ready.json().get("failed"):  # the engine will not come: fail now, not in 10 minutes
                    raise RuntimeError(f"server did not start: {ready.json()['failed']}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)
        self.serving.discard_spare()


@pytest.fixture(scope="session")
def start_server():
    servers = []

    def start(model, tmp, *, roots=(), catalog=None, store_overrides=None, **overrides):
        # No spare engine process (~0.3 GB and its imports per server): test_engine_process.py has one.
        settings = dict(model=str(model), target_rank=8, batch_size=3, port=free_port(), max_queue=32,
                        drain_timeout_s=60, engine_spare_process=False)
        settings.setdefault("jobs_dir", str(tmp / "jobs"))  # each server its own: a start fails what it finds unfinished
        settings.update(overrides)
        store_overrides = dict(store_overrides or {})
        if store_overrides.get("allow_http"):  # the loopback test sources (drip_url): internal, so listed
            store_overrides.setdefault("allowed_hosts", ("127.0.0.1",))
        store = StoreConfig(cache_dir=tmp / "cache", local_roots=tuple(roots), catalog=catalog, **store_overrides)
        server = RunningServer(ServerConfig(**settings), store).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


class DripHandler(http.server.BaseHTTPRequestHandler):
    """A source that answers at once, then sends its body one byte per ``DRIP_S``: each read
    succeeds, so only a whole-download deadline ends the fetch."""

    DRIP_S = 0.5
    BYTES = 4096

    def do_HEAD(self):
        self.send_response(405)  # no cheap identity: the store must download
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", str(self.BYTES))
        self.end_headers()
        drip(self.wfile, b"\0" * self.BYTES, self.DRIP_S, self.server.stopping)  # bounded; ends on hang-up

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def drip_url():
    """http://127.0.0.1:PORT/ of a slow-drip source (plain http: the store needs allow_http)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DripHandler)
    server.daemon_threads = True
    server.stopping = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.stopping.set()
    server.shutdown()


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium driven by Selenium (the playground's tests)."""
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
