"""Fixtures shared by the integration tests."""

import socket

import pytest


@pytest.fixture
def s3_endpoint(monkeypatch):
    import moto.s3.models
    from moto.server import ThreadedMotoServer

    # Real S3 wants 5 MiB parts; small parts let a tiny adapter be a genuine multipart object.
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    yield f"http://127.0.0.1:{port}"
    server.stop()
