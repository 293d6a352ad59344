"""What the ingress hands to Serve: the multiplexed model id is a hash of the identity reference
(Serve logs and exports model ids), and the reference itself travels only in the request. No cluster:
the ingress class runs against a recording handle."""

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")

from hotlora.adapters.store.references import reference_id  # noqa: E402
from hotlora.settings import ServerConfig, StoreConfig  # noqa: E402
from hotlora.scaleout.config import RayServeConfig  # noqa: E402
from hotlora.scaleout.ingress import Ingress  # noqa: E402
from hotlora.scaleout.replica import ForwardedReply  # noqa: E402

PRESIGNED = "https://bucket.example/u/42.safetensors?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=5ecret5ig"


class RecordingHandle:
    def __init__(self):
        self.model_ids, self.forwarded = [], []

    def options(self, multiplexed_model_id):
        self.model_ids.append(multiplexed_model_id)
        return self

    @property
    def handle(self):
        return self

    def remote(self, forwarded):
        self.forwarded.append(forwarded)

        async def reply():
            return ForwardedReply(200, [], b"{}")

        return asyncio.ensure_future(reply())


def test_serve_sees_a_hash_of_the_identity_never_its_url(tmp_path):
    from starlette.requests import Request

    config = RayServeConfig.from_dict({"models": {"flux": {"model": "org/flux"}}}, ServerConfig(),
                                      StoreConfig(cache_dir=tmp_path))
    recording = RecordingHandle()
    ingress = Ingress.func_or_class({"flux": recording}, config)
    body = json.dumps({"prompt": "x", "adapters": {"identity": PRESIGNED}}).encode()

    async def call():
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/generate", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")]}
        return await ingress(Request(scope, receive))

    response = asyncio.run(call())
    assert response.status_code == 200
    assert recording.model_ids == [reference_id(PRESIGNED)]
    assert "5ecret5ig" not in recording.model_ids[0] and len(recording.model_ids[0]) == 32
    assert recording.forwarded[0].identity == PRESIGNED  # the replica fetches by the reference itself


def test_a_multipart_edit_carries_its_identity_as_the_affinity_key(tmp_path):
    """``openai.images.edit`` sends a multipart form, its ``extra_body`` flattened into bracketed
    fields: the ingress reads the identity from ``adapters[identity][ref]`` (and the model from the
    form's ``model``) and forwards the body as it came."""
    import httpx
    from starlette.requests import Request

    config = RayServeConfig.from_dict({"models": {"flux": {"model": "org/flux"}, "sdxl": {"model": "org/sdxl"}}},
                                      ServerConfig(), StoreConfig(cache_dir=tmp_path))
    handles = {"flux": RecordingHandle(), "sdxl": RecordingHandle()}
    ingress = Ingress.func_or_class(handles, config)
    made = httpx.Request("POST", "http://ingress/v1/images/edits", files=[("image", ("a.png", b"\x89PNG...", "image/png"))],
                         data={"prompt": "x", "model": "sdxl", "adapters[identity][ref]": PRESIGNED,
                               "adapters[identity][scale]": "0.8", "adapters[style]": "watercolor"})
    body = made.read()

    async def call():
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in made.headers.items()]}
        return await ingress(Request(scope, receive))

    response = asyncio.run(call())
    assert response.status_code == 200
    assert handles["sdxl"].model_ids == [reference_id(PRESIGNED)] and not handles["flux"].forwarded
    assert handles["sdxl"].forwarded[0].identity == PRESIGNED and handles["sdxl"].forwarded[0].body == body


def test_a_body_over_every_models_cap_is_refused_at_the_ingress(tmp_path):
    """The ingress reads a body before it knows the model: past the largest cap of the models it serves
    (``max_body_bytes`` here; more on a server with image tasks) it answers 413 and forwards nothing,
    by the declared length before reading, or as the body arrives when none is declared."""
    from starlette.requests import Request

    config = RayServeConfig.from_dict({"models": {"flux": {"model": "org/flux", "server": {"max_body_bytes": 4096}},
                                                  "sdxl": {"model": "org/sdxl", "server": {"max_body_bytes": 8192}}}},
                                      ServerConfig(), StoreConfig(cache_dir=tmp_path))
    handles = {"flux": RecordingHandle(), "sdxl": RecordingHandle()}
    ingress = Ingress.func_or_class(handles, config)

    def call(size: int, declared: bool):
        body = json.dumps({"prompt": "x" * size}).encode()
        chunks = [body[i:i + 1000] for i in range(0, len(body), 1000)]

        async def run():
            async def receive():
                chunk = chunks.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

            headers = [(b"content-type", b"application/json")]
            if declared:
                headers.append((b"content-length", str(len(body)).encode()))
            scope = {"type": "http", "method": "POST", "path": "/v1/generate", "query_string": b"", "headers": headers}
            return await ingress(Request(scope, receive))

        return asyncio.run(run())

    for declared in (True, False):
        refused = call(9000, declared)
        assert refused.status_code == 413, refused.body
        assert b"8192-byte limit" in refused.body
    assert not handles["flux"].forwarded and not handles["sdxl"].forwarded
    assert call(6000, declared=False).status_code == 200  # over flux's cap, under sdxl's: the replica decides
    assert len(handles["flux"].forwarded) == 1
