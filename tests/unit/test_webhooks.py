"""Webhook delivery (server/webhooks.py) to a real loopback receiver, under the store's egress policy:
loopback is internal, so it is reached only when the policy lists it; a redirect is re-checked."""

import asyncio
import base64
import http.server
import threading

import pytest
from standardwebhooks import Webhook

from hotlora.adapters.store.egress import EgressPolicy
from hotlora.errors import InvalidRequest, UnsafeReference
from hotlora.server.webhooks import Webhooks

SECRET = "whsec_" + base64.b64encode(b"unit test webhook secret").decode()


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.deliveries.append((self.path, dict(self.headers), body))
        if self.path == "/moved":  # a redirect to a name the policy does not list
            self.send_response(307)
            self.send_header("location", f"http://localhost:{self.server.server_address[1]}/hook")
        else:
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.daemon_threads = True
    server.deliveries = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def deliver(webhooks, url):
    async def run():
        done = asyncio.get_running_loop().create_future()
        webhooks.send(url, "job.succeeded", {"id": "job_x", "status": "succeeded"}, done=done.set_result)
        return await done

    return asyncio.run(run())


def test_an_internal_address_is_refused_unless_the_policy_lists_it(receiver):
    server, url = receiver
    webhooks = Webhooks(SECRET, EgressPolicy(allow_http=True), max_attempts=3, backoff_s=0.01)
    with pytest.raises(UnsafeReference):
        asyncio.run(webhooks.check(f"{url}/hook"))
    delivery = deliver(webhooks, f"{url}/hook")  # checked again at delivery: nothing is sent, nothing retried
    assert not delivery.delivered and delivery.attempts == 1 and "egress" in delivery.error
    assert server.deliveries == []


def test_a_listed_receiver_gets_a_signed_message_and_a_redirect_is_checked_again(receiver):
    server, url = receiver
    webhooks = Webhooks(SECRET, EgressPolicy(("127.0.0.1",), allow_http=True), backoff_s=0.01)
    asyncio.run(webhooks.check(f"{url}/hook"))
    assert deliver(webhooks, f"{url}/hook").delivered
    (_, headers, body), = server.deliveries
    message = Webhook(SECRET).verify(body, headers)
    assert message["type"] == "job.succeeded" and message["data"] == {"id": "job_x", "status": "succeeded"}

    moved = deliver(webhooks, f"{url}/moved")  # 307 to localhost: not in allowed_hosts
    assert not moved.delivered and "egress" in moved.error
    assert [path for path, _, _ in server.deliveries] == ["/hook", "/moved"]


def test_no_secret_no_webhooks():
    with pytest.raises(InvalidRequest, match="webhook_secret"):
        asyncio.run(Webhooks(None, EgressPolicy()).check("https://example.com/hook"))
