"""Webhooks on a job's completion, as fal and Replicate send them: one POST to the URL the job
named, signed per the Standard Webhooks spec (``standardwebhooks``: ``webhook-id``,
``webhook-timestamp``, ``webhook-signature`` headers over ``id.timestamp.body``), so a receiver
verifies it with ``standardwebhooks.Webhook(secret).verify(body, headers)``.

Where a webhook may go is the adapter store's egress policy for client-given URLs (``EgressPolicy``
with ``exclusive``: https only unless ``allow_http``, public addresses only unless the host is in
``allowed_hosts``, every redirect hop re-checked, connections pinned to the vetted address): a
webhook URL is a client-chosen URL the server connects to, the same risk as an adapter URL
(server-side request forgery). No ``webhook_secret``, no webhooks: a job asking for one is refused.

Delivery runs on its own task and a worker thread (the egress client is synchronous), never on
the queue's path; failures are retried ``webhook_max_attempts`` times with exponential backoff,
the same message id each time (receivers de-duplicate on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from hotlora.adapters.store import egress
from hotlora.adapters.store.egress import EgressPolicy, EgressRefused
from hotlora.adapters.store.references import redact_reference
from hotlora.errors import InvalidRequest, UnsafeReference

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class Delivery:
    """How a webhook ended: delivered or not, after how many attempts, and why not (for the job's record)."""

    delivered: bool
    attempts: int
    error: str | None = None

    def as_dict(self) -> dict:
        return {"delivered": self.delivered, "attempts": self.attempts, "error": self.error}


class Webhooks:
    """Signs and sends webhooks under ``policy``; ``secret`` None: none are sent (``check`` refuses)."""

    def __init__(self, secret: str | None, policy: EgressPolicy, *, max_attempts: int = 5, backoff_s: float = 2.0,
                 timeout_s: float = 10.0):
        from standardwebhooks import Webhook

        self.signer = Webhook(secret) if secret else None
        self.policy = policy
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def of(cls, config, policy: EgressPolicy) -> "Webhooks":
        """``config``'s webhooks (``ServerConfig``) under ``policy`` (the store's for client URLs)."""
        return cls(config.webhook_secret, policy, max_attempts=config.webhook_max_attempts,
                   backoff_s=config.webhook_backoff_s, timeout_s=config.webhook_timeout_s)

    async def check(self, url: str) -> None:
        """Refuse a webhook URL before the job is accepted: 422 when this server sends none, 403
        (``EgressRefused``) for a scheme, host or address the policy does not allow. Resolving the
        name happens on a thread; delivery checks again (a name may resolve elsewhere by then)."""
        if self.signer is None:
            raise InvalidRequest("this server sends no webhooks (its operator set no webhook_secret)")
        try:
            await asyncio.to_thread(self.policy.check_endpoint, url)
        except EgressRefused as exc:
            log.warning("webhook %s refused: %s", redact_reference(url), exc)  # which address: the operator's
            raise UnsafeReference(f"webhook {redact_reference(url)!r}: {exc.shown}") from None
        except OSError:  # a name that does not resolve now: delivery will say so; the URL is not unsafe
            pass

    def send(self, url: str, event_type: str, data: dict, done: Callable[[Delivery], None] | None = None) -> None:
        """Deliver in the background; ``done(delivery)`` is called on the event loop once it ends."""
        message = {"type": event_type, "timestamp": _now().isoformat(), "data": data}
        task = asyncio.get_running_loop().create_task(self._deliver(url, message))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            task.add_done_callback(lambda t: None if t.cancelled() else done(t.result()))

    async def _deliver(self, url: str, message: dict) -> Delivery:
        msg_id = "msg_" + secrets.token_urlsafe(16)
        body = json.dumps(message)
        error = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                status = await asyncio.to_thread(self._post, url, msg_id, body)
            except EgressRefused as exc:  # permanent: no retry makes a refused destination allowed
                log.warning("webhook to %s refused: %s", redact_reference(url), exc)
                return Delivery(False, attempt, f"refused by the egress policy: {exc.shown}")
            except Exception as exc:  # a transport failure of any kind is worth another try
                status, error = None, f"{type(exc).__name__}"
            if status is not None:
                if 200 <= status < 300:
                    return Delivery(True, attempt)
                error = f"answered HTTP {status}"
            if attempt < self.max_attempts:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        log.warning("webhook to %s not delivered after %d attempts: %s", redact_reference(url), self.max_attempts,
                    error)
        return Delivery(False, self.max_attempts, error)

    def _post(self, url: str, msg_id: str, body: str) -> int:
        sent = _now()
        headers = {"content-type": "application/json", "webhook-id": msg_id,
                   "webhook-timestamp": str(int(sent.timestamp())),
                   "webhook-signature": self.signer.sign(msg_id, sent, body)}
        with egress.client(self.policy, self.timeout_s) as client:
            return client.post(url, content=body.encode(), headers=headers).status_code

    async def close(self) -> None:
        """Stop the deliveries still retrying (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _now() -> datetime:
    return datetime.now(tz=timezone.utc)
