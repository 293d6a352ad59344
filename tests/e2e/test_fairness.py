"""Fair fetching on a real server with loopback sources: one client's slow sources (a prefetch
flood of dripping downloads, requests naming them, a source that drips its HEAD) never make
another request wait longer than its own work, a fetch ends at its one deadline (queue, HEAD and
GET together), and a request's ``timeout_s`` covers its fetch wait. Every request here comes from
127.0.0.1 with keys off, so all of them are one client to the server: the lanes (requests before
prefetches, the last worker never a prefetch's) must do it on their own. Bounded: every client
call has a timeout, every source stops when the client hangs up.
"""

import hashlib
import http.server
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import drip, generate

STEPS = 2
DEADLINE_S = 6.0  # the store's whole-fetch deadline, as the independent harness runs it
FLOOD = 40  # dripping sources in one prefetch
SLACK_S = 4.0  # the tiny model's own work plus scheduling, on a busy 2-core machine


class Sources(http.server.BaseHTTPRequestHandler):
    """Loopback sources: ``/files/NAME`` serves a real adapter (HEAD with an ETag), ``/drip/NAME``
    drips its body one byte per 0.5 s (HEAD 405), ``/slowhead/NAME`` drips its HEAD's headers."""

    files: dict[str, bytes] = {}
    heads: dict[str, int] = {}

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        kind, _, name = self.path.lstrip("/").partition("/")
        if kind == "files" and name in self.files:
            data = self.files[name]
            if not body:
                Sources.heads[name] = Sources.heads.get(name, 0) + 1
            self.send_response(200)
            self.send_header("etag", f'"{hashlib.sha256(data).hexdigest()[:16]}"')
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
        elif kind == "drip":
            if not body:
                self.send_response(405)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-length", "4096")
            self.end_headers()
            self._drip(b"\0" * 4096)
        elif kind == "slowhead":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self._drip(b"x-slow: " + b"a" * 4096)
        else:
            self.send_response(404)
            self.end_headers()

    def _drip(self, data: bytes) -> None:
        drip(self.wfile, data, 0.5, self.server.stopping)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fair(tiny_models, tmp_path_factory, start_server):
    from diffusers import FluxTransformer2DModel

    tmp = tmp_path_factory.mktemp("fairness")
    root = tmp / "loras"
    transformer = FluxTransformer2DModel.from_pretrained(tiny_models["flux"] / "transformer")
    linears = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    for i in range(6):
        save_diffusers_lora(root / f"local-{i}", "flux", random_lora(linears, 4, seed=300 + i), rank=4, alpha=4)
    Sources.files["remote.safetensors"] = (root / "local-5" / "pytorch_lora_weights.safetensors").read_bytes()

    sources = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sources)
    sources.daemon_threads = True
    sources.stopping = threading.Event()
    threading.Thread(target=sources.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{sources.server_address[1]}"
    # Eager: fetching is what is under test, and an eager tiny model starts in seconds. revalidate
    # 0: a remote adapter in RAM still needs a HEAD on a fetch worker each time (the hard case).
    server = start_server(tiny_models["flux"], tmp, roots=(root,), compile=False, batch_size=2, max_queue=8,
                          store_overrides={"allow_http": True, "download_deadline_s": DEADLINE_S, "retries": 1,
                                           "revalidate_after_s": 0})
    yield server, root, url
    sources.stopping.set()
    sources.shutdown()


def timed(call):
    began = time.monotonic()
    response = call()
    return response, time.monotonic() - began


def test_a_slow_head_ends_within_one_deadline(fair):
    server, _, url = fair
    response, took = timed(lambda: generate(server.url, (f"{url}/slowhead/a.safetensors", 1.0), n=1,
                                            num_inference_steps=STEPS))
    assert response.status_code == 502, response.text
    assert f"within {DEADLINE_S:g} s" in response.json()["error"]
    print(f"fairness: slow HEAD ended {response.status_code} in {took:.2f} s")
    assert took < DEADLINE_S + SLACK_S, took


def test_a_prefetch_flood_starves_no_other_request(fair):
    server, root, url = fair
    remote = f"{url}/files/remote.safetensors"
    assert generate(server.url, (remote, 1.0), n=1, num_inference_steps=STEPS).status_code == 200  # now in RAM
    flood = httpx.post(f"{server.url}/v1/adapters/prefetch", timeout=30,
                       json={"refs": [f"{url}/drip/flood-{i}.safetensors" for i in range(FLOOD)]})
    assert flood.status_code == 202, flood.text
    time.sleep(1.0)  # the flood holds its workers now
    lanes = httpx.get(f"{server.url}/v1/adapters", timeout=30).json()["stats"]["remote"]["lanes"]
    assert lanes["prefetch"]["running"] >= 1 and lanes["prefetch"]["queued"] >= 1, lanes

    heads = Sources.heads.get("remote.safetensors", 0)
    with ThreadPoolExecutor(max_workers=3) as pool:
        uncached = pool.submit(timed, lambda: generate(server.url, (str(root / "local-0"), 1.0), n=1,
                                                       num_inference_steps=STEPS))
        bounded = pool.submit(timed, lambda: generate(server.url, (str(root / "local-1"), 1.0), n=1,
                                                      num_inference_steps=STEPS, timeout_s=5))
        in_ram = pool.submit(timed, lambda: generate(server.url, (remote, 1.0), n=1, num_inference_steps=STEPS))
        for name, future in (("uncached local", uncached), ("timeout_s=5", bounded), ("remote in RAM", in_ram)):
            response, took = future.result(timeout=120)
            print(f"fairness: during the flood, {name}: {response.status_code} in {took:.2f} s")
            assert response.status_code == 200, response.text
            assert took < SLACK_S + 2, took  # not behind the flood's 6 s deadlines, let alone 40 of them
    assert Sources.heads["remote.safetensors"] == heads + 1  # revalidated, on a request-lane worker


def test_requests_waiting_on_slow_sources_hold_no_admission_slot(fair):
    server, root, url = fair
    cached = (str(root / "local-2"), 1.0)
    assert generate(server.url, cached, n=1, num_inference_steps=STEPS).status_code == 200
    waiting = 2 * 8  # max_pending is 2 x max_queue: every slot, were they held during the fetch
    with ThreadPoolExecutor(max_workers=waiting) as pool:
        slow = [pool.submit(generate, server.url, (f"{url}/drip/wait-{i}.safetensors", 1.0), n=1,
                            num_inference_steps=STEPS) for i in range(waiting)]
        time.sleep(1.0)
        response, took = timed(lambda: generate(server.url, cached, n=1, num_inference_steps=STEPS))
        print(f"fairness: cached request while {waiting} wait on drips: {response.status_code} in {took:.2f} s")
        assert response.status_code == 200, response.text
        assert took < SLACK_S, took
        answers = [future.result(timeout=120).status_code for future in slow]
    # Each ended by its deadline, nothing hangs: cut mid-download (502), the request's own timeout
    # (504), or its deadline spent waiting for a worker behind the others (429, retry later).
    assert set(answers) <= {429, 502, 504}, answers


def test_timeout_s_covers_the_fetch_wait(fair):
    server, _, url = fair
    response, took = timed(lambda: generate(server.url, (f"{url}/drip/timeout.safetensors", 1.0), n=1,
                                            num_inference_steps=STEPS, timeout_s=2))
    print(f"fairness: timeout_s=2 waiting on a drip: {response.status_code} in {took:.2f} s")
    assert response.status_code == 504, response.text
    assert "fetched" in response.json()["error"]
    assert took < 2 + SLACK_S, took


def test_timeout_s_ends_a_request_that_runs_past_it(fair):
    """The deadline is when the request must have ended: a run past it stops at the next denoising
    step (504 naming the step), the server's worker free again, not after all 400 steps (2 chunks of
    2 images x 200 steps) nor at the end of a chunk (the engine process sends a message every step,
    and the server looks at the deadline on each)."""
    server, root, _ = fair
    response, took = timed(lambda: generate(server.url, (str(root / "local-3"), 1.0), n=4, num_inference_steps=200,
                                            timeout_s=1))
    print(f"fairness: timeout_s=1 on 4 images x 200 steps: {response.status_code} in {took:.2f} s")
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    stopped = re.search(r"deadline passed while it ran: stopped after step (\d+) of 400", error)
    assert stopped and int(stopped[1]) < 200, error
    assert took < 1 + SLACK_S, took
    assert generate(server.url, (str(root / "local-3"), 1.0), n=1, num_inference_steps=STEPS).status_code == 200
