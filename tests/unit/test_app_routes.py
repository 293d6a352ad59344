"""The HTTP app over a stand-in worker that is never ready: every route is there, and every
answer that needs no engine (refusals, validation, body limits, health, metrics, the playground)
has its status, headers and body. The e2e tests cover the answers that need a real engine."""

import inspect
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

import hotlora.scaleout
import hotlora.server
from hotlora.settings import ServerConfig
from hotlora.errors import InvalidRequest, NotAccepting
from hotlora.server.app import create_app
from hotlora.server.outputs import output_format
from hotlora.server.run import Serving

ROUTES = {
    ("get", "/healthz"), ("get", "/readyz"), ("get", "/metrics"), ("get", "/v1/adapters"),
    ("post", "/v1/adapters/prefetch"), ("post", "/v1/generate"), ("post", "/v1/generate/stream"), ("get", "/"),
    ("post", "/"), ("post", "/models/{model_id}"), ("post", "/v1/images/generations"), ("post", "/v1/images/edits"),
    ("get", "/v1/jobs/{job_id}"), ("get", "/v1/jobs/{job_id}/content"), ("get", "/v1/jobs/{job_id}/events"),
    ("delete", "/v1/jobs/{job_id}"),
    ("post", "/v1/videos"), ("get", "/v1/videos"), ("get", "/v1/videos/{video_id}"),
    ("get", "/v1/videos/{video_id}/content"), ("delete", "/v1/videos/{video_id}"),
}


class IdleWorker:
    """What the app reads of a worker, for a worker whose engine never came up."""

    def __init__(self, ready=True):
        self.engine = self.failed = None
        self.depth = self.rebuilds = self.batches = self.retired_recompiles = 0
        self.max_queue = 16
        self._ready = ready
        self.on_event = None
        self.faults = 0
        self.restarts, self.last_exit = {}, None

    crash_loop_delay_s = 0.0

    def why_not_ready(self):
        return "the engine is not ready (starting, rebuilding or shutting down)"

    def not_ready(self):
        return NotAccepting(self.why_not_ready())

    @property
    def ready(self):
        if isinstance(self._ready, Exception):
            raise self._ready
        return self._ready

    def inject_fault(self):
        self.faults += 1


def client(worker=None, store=None, **settings):
    app = create_app(Serving(worker=worker or IdleWorker(ready=False), store=store), ServerConfig(**settings),
                     start_worker=False)
    # A loopback server without keys answers only to loopback Host headers (not TestClient's "testserver").
    return TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1:8000")


def served_routes(app):
    return {(method, path) for path, item in app.openapi()["paths"].items() for method in item}


def metric(c, line_start) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_every_route_and_the_fault_hook_only_when_enabled():
    assert served_routes(client().app) == ROUTES
    enabled = client(enable_fault_injection=True)
    assert served_routes(enabled.app) == ROUTES | {("post", "/admin/fault")}
    assert client().post("/admin/fault").status_code == 404
    assert enabled.post("/admin/fault").json() == {"armed": True}
    assert enabled.app.state.service.worker.faults == 1


def test_a_worker_that_is_not_ready_is_a_503_in_each_apis_shape():
    c = client()
    generate = c.post("/v1/generate", json={"prompt": "x"})
    assert generate.status_code == 503 and generate.headers["retry-after"] == "5"
    assert generate.json()["type"] == "NotAccepting" and "not ready" in generate.json()["error"]
    openai = c.post("/v1/images/generations", json={"prompt": "x"})
    assert openai.status_code == 503 and openai.json()["error"]["type"] == "NotAccepting"
    for path in ("/", "/models/org/some-model"):
        inference = c.post(path, content="a dog", headers={"content-type": "text/x-prompt"})
        assert inference.status_code == 503 and inference.json()["type"] == "NotAccepting"
    assert metric(c, 'hotlora_requests_total{api="/v1/generate",outcome="rejected"}') == 1


def test_the_stream_ends_with_the_error_event_and_is_counted_by_it():
    c = client()
    response = c.post("/v1/generate/stream", json={"prompt": "x"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = [block.split("\n") for block in response.text.strip().split("\n\n")]
    assert events[0] == ["event: accepted", "data: {}"]
    assert events[-1][0] == "event: error"
    assert '"type": "NotAccepting"' in events[-1][1] and '"status": 503' in events[-1][1]
    # Counted as the 503 it ended in, not as the 200 that carried it.
    assert metric(c, 'hotlora_requests_total{api="/v1/generate/stream",outcome="rejected"}') == 1
    assert metric(c, 'hotlora_requests_total{api="/v1/generate/stream",outcome="ok"}') == 0


def test_schema_errors_are_422_with_the_field_named():
    c = client()
    bad = c.post("/v1/generate", json={"prompt": "x", "num_images": "many"})
    assert bad.status_code == 422 and bad.json()["type"] == "InvalidRequest"
    assert bad.json()["error"].startswith("invalid request: num_images: ")
    not_json = c.post("/v1/generate", content=b"{oops", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["error"].startswith("invalid request: ")
    openai = c.post("/v1/images/generations", json={"prompt": "x", "size": "huge"})
    assert openai.status_code == 422 and openai.json()["error"]["message"].startswith("invalid request: size: ")
    url = c.post("/v1/images/generations", json={"prompt": "x", "response_format": "url"})
    assert url.status_code == 422 and "b64_json" in url.json()["error"]["message"]
    raw = c.post("/", content=b"\xff\xfe", headers={"content-type": "text/plain", "lora": "x"})
    assert raw.status_code == 422 and raw.json()["error"].startswith("expected {\"inputs\": prompt")
    header = c.post("/", content=b"a dog", headers={"lora": "a" * 5000})
    assert header.status_code == 413 and header.json()["type"] == "RequestTooLarge"


def test_bodies_over_the_limit_are_413_and_close_the_connection():
    c = client(max_body_bytes=1000)
    big = c.post("/v1/generate", content=b"x" * 2000, headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.headers["connection"] == "close"
    assert big.json()["type"] == "RequestTooLarge" and "1000-byte limit" in big.json()["error"]
    openai = c.post("/v1/images/generations", content=b"x" * 2000)
    assert openai.status_code == 413 and openai.json()["error"]["type"] == "RequestTooLarge"
    assert metric(c, 'hotlora_requests_total{api="unmatched",outcome="client_error"}') == 2


def test_an_unexpected_exception_is_a_500_naming_only_its_type():
    c = client(IdleWorker(ready=RuntimeError("secret detail")))
    response = c.post("/v1/generate", json={"prompt": "x"})
    assert response.status_code == 500 and response.json() == {"error": "internal error: RuntimeError"}


def test_json_nested_too_deeply_and_unknown_routes_answer_in_the_apis_shape():
    c = client()
    deep = b'{"prompt": "x", "adapters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/generate", "/v1/images/generations", "/"):
        response = c.post(path, content=deep, headers={"content-type": "application/json"})
        assert response.status_code == 422 and "detail" not in response.json(), (path, response.text)
        error = response.json()["error"] if path.startswith("/v1/images") else response.json()
        assert error["type"] == "InvalidRequest", response.text
    missing = c.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json() == {"error": "Not Found", "type": "NotFound"}
    method = c.put("/v1/generate")
    assert method.status_code == 405 and method.json()["type"] == "MethodNotAllowed" and "allow" in method.headers
    assert c.get("/v1/images/nope").json() == {"error": {"message": "Not Found", "type": "NotFound"}}


class StandInStore:
    """What the prefetch route reads of a store; a fetch is recorded, never run."""

    catalog: dict = {}
    fetches_in_flight = 0

    def __init__(self):
        self.asked = []

    async def aget(self, ref, **kwargs):
        self.asked.append(ref)
        raise AssertionError("nothing may be fetched")


def test_prefetch_refuses_malformed_references_up_front():
    store = StandInStore()
    c = client(IdleWorker(ready=False), store)
    for ref in ("http://127.0.0.1:99999/x", "https://h.example/a\tb", "https://[::1/x", "s3://b:1/k"):
        response = c.post("/v1/adapters/prefetch", json={"refs": ["catalog:fine", ref]})
        assert response.status_code == 422 and response.json()["type"] == "InvalidReference", response.text
    assert store.asked == []  # nothing was scheduled, not even the well-formed reference


def test_on_a_real_server_a_500_closes_the_connection_cleanly_and_a_4xx_keeps_it():
    """uvicorn drops the connection after an unexpected exception's 500 (Starlette re-raises it to be
    logged): the answer says ``Connection: close``, so a keep-alive client opens a new one instead of
    writing its next request into a closed socket. A 4xx leaves the connection open for the next."""
    import socket
    import threading
    import time

    import uvicorn

    from ..helpers import free_port

    port = free_port()
    app = create_app(Serving(worker=IdleWorker(ready=RuntimeError("secret detail"))), ServerConfig(port=port),
                     start_worker=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        body = b'{"prompt": "x"}'
        request = (b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        bad = b"GET /v1/nothing-here HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(bad)  # a 4xx: the same connection serves the next request
            first = _response(sock)
            assert first.startswith(b"HTTP/1.1 404") and b"connection: close" not in first.lower()
            sock.sendall(request)
            answer = _response(sock)
            assert answer.startswith(b"HTTP/1.1 500"), answer
            assert b"connection: close" in answer.lower(), answer
            assert b"secret detail" not in answer
            assert sock.recv(1) == b""  # and the server did close it
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as keep_alive:
            for _ in range(3):  # each 500 followed by a request on the same client
                assert keep_alive.post("/v1/generate", json={"prompt": "x"}).status_code == 500
                assert keep_alive.get("/healthz").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)


def _response(sock) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, read off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(4096)
        assert chunk
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_a_worker_that_gave_up_rebuilding_fails_liveness_too():
    """Alive through restarts and rebuilds; once the worker gave up (``max_rebuild_attempts``) only a
    restart of the server helps, so /healthz says so and a liveness probe restarts it."""
    worker = IdleWorker(ready=False)
    assert client(worker).get("/healthz").status_code == 200
    worker.failed = "5 rebuilds failed in a row, the last with RuntimeError: CUDA error"
    health = client(worker).get("/healthz")
    assert health.status_code == 503 and health.json() == {"status": "engine down", "failed": worker.failed}
    assert client(worker).get("/readyz").json()["failed"] == worker.failed


def test_health_readiness_metrics_adapters_and_playground():
    c = client()
    assert c.get("/healthz").json() == {"status": "alive"}
    ready = c.get("/readyz")
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "rebuilds": 0, "queue_depth": 0, "engine": None, "failed": None,
                            "engine_restarts": {}, "last_engine_exit": None, "crash_loop_delay_s": 0.0}
    assert "hotlora_ready 0.0" in c.get("/metrics").text
    assert c.get("/v1/adapters").json() == {"slots": ["identity", "style"], "catalog": [], "cached": [],
                                            "stats": None}
    prefetch = c.post("/v1/adapters/prefetch", json={"refs": ["x"]})
    assert prefetch.status_code == 422 and prefetch.json()["error"] == "this server has no adapter store"
    assert c.get("/").json()["name"] == "hotlora"
    page = c.get("/", headers={"accept": "text/html"})
    assert page.headers["content-type"].startswith("text/html") and "<html" in page.text.lower()


def test_the_server_package_stays_small():
    """create_app only assembles; no module of the HTTP edge or the Ray deployment grows past 400 lines."""
    assert len(inspect.getsource(create_app).splitlines()) <= 60
    for package in (hotlora.server, hotlora.scaleout):
        for path in Path(package.__file__).parent.glob("*.py"):
            assert len(path.read_text().splitlines()) <= 400, path


def test_the_image_to_image_task_is_read_as_that_task_never_as_a_prompt():
    """``InferenceClient.image_to_image`` sends the image as base64 ``inputs`` and the prompt in
    ``parameters.prompt``: read as the image task whatever the input's length (here the worker is
    not ready: 503; a server without the task refuses it as such, tests/e2e/test_server.py)."""
    c = client()
    for inputs in ("aGVsbG8=", "A" * 20_000):
        answer = c.post("/", json={"inputs": inputs, "parameters": {"prompt": "a cat"}})
        assert answer.status_code == 503 and answer.json()["type"] == "NotAccepting"
    missing = c.post("/", json={"parameters": {"prompt": "a cat"}})
    assert missing.status_code == 422 and "image-to-image" in missing.json()["error"]
    raw = c.post("/", content=b"\x89PNG\r\n\x1a\n", headers={"content-type": "image/png"})
    assert raw.status_code == 422 and "parameters" in raw.json()["error"]
    # A text-to-image body with a prompt-like word in it is not mistaken for one.
    text = c.post("/", json={"inputs": 'a "prompt" sign', "parameters": {"seed": 1}})
    assert text.status_code == 503 and text.json()["type"] == "NotAccepting"


def test_the_generation_routes_take_input_images_only_where_tasks_are_served():
    """The body cap: 1 MiB everywhere on a text-to-image server; room for the images a request may
    give on the generation routes of one that serves image tasks (nothing else grows)."""
    big = b"x" * (2 * 2**20)
    files = {"image": ("p.png", big, "image/png")}
    assert client().post("/v1/images/edits", data={"prompt": "x"}, files=files).status_code == 413
    tasks = client(tasks=("image-to-image",))
    assert tasks.post("/v1/images/edits", data={"prompt": "x"}, files=files).status_code == 503
    assert tasks.post("/v1/adapters/prefetch", content=big, headers={"content-type": "application/json"}).status_code == 413


def test_an_image_model_answers_the_videos_api_with_a_422_in_openais_shape():
    worker = IdleWorker()
    worker.engine = SimpleNamespace(family=SimpleNamespace(output_kind="images", fps=None))
    refused = client(worker).post("/v1/videos", json={"prompt": "a cat", "seconds": "4"})
    assert refused.status_code == 422
    assert "makes images" in refused.json()["error"]["message"] and "/v1/images/generations" in refused.text


def test_output_formats_are_those_of_the_models_output_kind():
    images, frames = (SimpleNamespace(family=SimpleNamespace(output_kind=kind)) for kind in ("images", "frames"))
    assert (output_format(images, None), output_format(frames, None)) == ("png", "mp4")
    assert output_format(images, "jpeg") == "jpeg" and output_format(frames, "webp") == "webp"
    with pytest.raises(InvalidRequest, match="png, jpeg, webp"):
        output_format(images, "mp4")
    with pytest.raises(InvalidRequest, match="mp4, webp, png"):
        output_format(frames, "jpeg")
    with pytest.raises(InvalidRequest, match="POST /v1/videos"):
        output_format(frames, "png", kind="images")  # the OpenAI images routes on a video model
