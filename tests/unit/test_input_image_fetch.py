"""Input images fetched by URL (hotlora.adapters.store.images) from real HTTP servers on 127.0.0.1:
the adapter store's egress policy at every hop, the byte budget before and while reading, the deadline."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from hotlora.adapters.store.egress import EgressPolicy
from hotlora.adapters.store.images import fetch_image, fetch_image_bytes
from hotlora.errors import InvalidRequest, RequestTooLarge, SourceUnavailable, UnsafeReference
from hotlora.images import ImageBudget
from hotlora.server.errors import status_of

from ..helpers import reply, serving_app as serving

PNG = (lambda out: (Image.fromarray(np.full((8, 8, 3), (10, 200, 30), np.uint8)).save(out, "PNG"), out.getvalue())[1])(
    io.BytesIO())


def allowing(server) -> EgressPolicy:
    return EgressPolicy(allowed_hosts=(f"127.0.0.1:{server.server_port}",), allow_http=True)


def test_an_image_is_fetched_and_decoded_with_its_content_type_as_declared():
    with serving(lambda h, m: reply(h, 200, PNG, {"Content-Type": "image/jpeg"})) as (server, url):
        fetched = fetch_image_bytes(f"{url}/cat.png", policy=allowing(server), budget=ImageBudget(), timeout_s=10)
        assert fetched.data == PNG and fetched.content_type == "image/jpeg"
        decoded = fetch_image(f"{url}/cat.png", policy=allowing(server), budget=ImageBudget(), timeout_s=10)
    assert decoded.format == "PNG" and (decoded.pixels == (10, 200, 30)).all()
    assert "declared as 'image/jpeg'" in decoded.notes[0]  # the content decided


def test_internal_hosts_are_refused_by_default_before_connecting():
    with serving(lambda h, m: reply(h, 200, PNG)) as (server, url):
        port = server.server_port
        public_only = EgressPolicy(allow_http=True)  # no allowed_hosts: public addresses only
        for target in (f"{url}/x.png", f"http://localhost:{port}/x.png", f"http://[::1]:{port}/x.png",
                       "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png"):
            with pytest.raises(UnsafeReference, match="not allowed") as info:
                fetch_image_bytes(target, policy=public_only, budget=ImageBudget(), timeout_s=5)
            assert status_of(info.value) == 403
        with pytest.raises(UnsafeReference, match="https only"):
            fetch_image_bytes(f"{url}/x.png", policy=EgressPolicy(), budget=ImageBudget(), timeout_s=5)
        assert server.seen == []


def test_every_redirect_hop_is_checked():
    with serving(lambda h, m: reply(h, 200, PNG)) as (inner, inner_url):
        targets = {"/to-loopback-name": f"http://localhost:{inner.server_port}/x.png",
                   "/to-unlisted-port": f"{inner_url}/x.png",
                   "/to-metadata": "http://169.254.169.254/latest/meta-data/iam",
                   "/to-private": "http://10.1.2.3/x.png",
                   "/to-file": "file:///etc/passwd"}

        def redirector(handler, method):
            reply(handler, 302, b"", {"Location": targets[handler.path]})

        with serving(redirector) as (outer, outer_url):
            for path in targets:
                with pytest.raises(UnsafeReference):
                    fetch_image_bytes(outer_url + path, policy=allowing(outer), budget=ImageBudget(), timeout_s=5)
            assert sorted(path for _, path, _ in outer.seen) == sorted(targets)
        assert inner.seen == []  # no hop reached the internal server


def test_a_declared_size_over_the_budget_is_refused_without_reading_the_body():
    budget = ImageBudget(max_bytes=64 * 1024)

    def huge(handler, method):
        handler.send_response(200)
        handler.send_header("Content-Length", str(1024**3))
        handler.end_headers()
        block = b"\0" * 65536
        while not handler.server.stop.is_set():
            handler.wfile.write(block)
            handler.server.sent += len(block)

    with serving(huge) as (server, url):
        with pytest.raises(RequestTooLarge, match=r"is 1,073,741,824 bytes \(its Content-Length\)") as info:
            fetch_image_bytes(f"{url}/big.png", policy=allowing(server), budget=budget, timeout_s=30)
        time.sleep(0.2)
        assert server.sent < 64 * 1024**2  # socket buffers' worth at most, never the gigabyte
    assert status_of(info.value) == 413


def test_an_undeclared_body_stops_being_read_past_the_budget():
    budget = ImageBudget(max_bytes=256 * 1024)

    def endless(handler, method):  # no Content-Length: the body runs until the connection closes
        handler.send_response(200)
        handler.send_header("Connection", "close")
        handler.end_headers()
        block = b"\x89PNG" + b"\0" * 65532
        while not handler.server.stop.is_set():
            handler.wfile.write(block)
            handler.server.sent += len(block)

    with serving(endless) as (server, url):
        with pytest.raises(RequestTooLarge, match=r"sent more than 262,144 bytes \(reading stopped there\)"):
            fetch_image_bytes(f"{url}/stream.png", policy=allowing(server), budget=budget, timeout_s=30)
        time.sleep(0.2)
        assert server.sent < 64 * 1024**2


def test_a_body_that_drips_is_ended_at_the_deadline():
    def drip(handler, method):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(PNG)))
        handler.end_headers()
        for byte in PNG:  # every read succeeds: only a total deadline ends it
            if handler.server.stop.is_set():
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.05)

    with serving(drip) as (server, url):
        began = time.monotonic()
        with pytest.raises(SourceUnavailable, match=r"did not finish within 0.5 s") as info:
            fetch_image_bytes(f"{url}/slow.png", policy=allowing(server), budget=ImageBudget(), timeout_s=0.5)
        assert time.monotonic() - began < 5  # 0.5 s and a little, not the ~5 s the drip would take
    assert status_of(info.value) == 502


def test_headers_that_never_come_are_ended_at_the_deadline():
    def silent(handler, method):
        handler.server.stop.wait(30)

    with serving(silent) as (server, url):
        began = time.monotonic()
        with pytest.raises(SourceUnavailable, match="did not finish within 0.5 s"):
            fetch_image_bytes(f"{url}/x.png", policy=allowing(server), budget=ImageBudget(), timeout_s=0.5)
        assert time.monotonic() - began < 5


def test_answers_other_than_success_and_malformed_urls_are_request_errors():
    with serving(lambda h, m: reply(h, 404, b"no")) as (server, url):
        with pytest.raises(InvalidRequest, match=r"not found or not allowed \(HTTP 404\)") as info:
            fetch_image_bytes(f"{url}/gone.png?sig=secret", policy=allowing(server), budget=ImageBudget(), timeout_s=5)
        assert "secret" not in str(info.value)  # a presigned URL's query is never shown
        assert status_of(info.value) == 422
    for bad in ("http://host/a b.png", "http://host/\r\nX-Injected: 1", "http://host\\@evil/x.png", "http://[::1/x"):
        with pytest.raises(InvalidRequest):
            fetch_image_bytes(bad, policy=EgressPolicy(allow_http=True), budget=ImageBudget(), timeout_s=5)
    with pytest.raises(UnsafeReference):
        fetch_image_bytes("ftp://127.0.0.1/x.png", policy=EgressPolicy(allow_http=True), budget=ImageBudget(),
                          timeout_s=5)
