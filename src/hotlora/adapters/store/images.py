"""Input images named by URL: fetched under the adapter store's egress policy, bounded in bytes and time.

Here, in the store wing, because this is where the egress policy lives: an image URL is client
input aimed at this server's network exactly as an adapter URL is, so it goes through the same
``egress.client(policy)`` (public addresses only unless listed in ``allowed_hosts``, each
redirect hop checked, connections pinned to the vetted address) and the same deadline watchdog
as ``remote``. The layers allow it (``hotlora.images`` sits below, with errors and settings) and
keep it below the engine and the server, so both, and the Ray ingress, can call it. Decoding is
``hotlora.images``'s; this module only brings the bytes.

One attempt, no retries: the request waits on it, and its client can send again.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from hotlora.adapters.store import egress
from hotlora.adapters.store.egress import EgressPolicy, EgressRefused
from hotlora.adapters.store.references import redact_url
# The watchdog that shuts a dripping connection at the deadline: remote's, shared within the store wing.
from hotlora.adapters.store.remote import Deadline, _Watchdog, content_length
from hotlora.errors import InvalidRequest, RequestTooLarge, SourceUnavailable, UnsafeReference
from hotlora.images import ImageBudget, DecodedImage, decode_image

log = logging.getLogger(__name__)

ACCEPT = "image/png, image/jpeg, image/webp"


class FetchedImage(NamedTuple):
    data: bytes
    content_type: str | None  # as the server labelled it; the content decides (decode_image)


def fetch_image_bytes(url: str, *, policy: EgressPolicy, budget: ImageBudget, timeout_s: float,
                      label: str = "image") -> FetchedImage:
    """The bytes at ``url`` (http(s)), at most ``budget.max_bytes`` of them, within ``timeout_s``
    from the call (connect, redirects, headers and body together).

    Refusals: ``UnsafeReference`` (403) for a destination ``policy`` refuses, at any redirect hop;
    ``InvalidRequest`` (422) for a malformed URL or an answer other than 2xx; ``RequestTooLarge``
    (413) for a declared ``Content-Length`` over the budget (nothing of the body is read) or a body
    that grows past it (reading stops there); ``SourceUnavailable`` (502) when the host cannot be
    reached or the deadline passes. Errors name the URL without its query (``redact_url``)."""
    import httpx

    shown = _checked(url, policy, label)
    deadline = Deadline(timeout_s)
    headers = {"Accept": ACCEPT, "Accept-Encoding": "identity"}
    try:
        with (_Watchdog(deadline) as watchdog, egress.client(policy, max(deadline.left(), 0.001)) as client,
              client.stream("GET", url, headers=headers, extensions={"trace": watchdog.trace}) as response):
            if not 200 <= response.status_code < 300:
                log.warning("%s %s: answered HTTP %d", label, shown, response.status_code)
                raise InvalidRequest(f"{label} URL {shown}: not found or not allowed (HTTP {response.status_code})")
            declared = content_length(response)
            if declared is not None and declared > budget.max_bytes:
                raise _too_large(label, shown, budget, declared)
            body = bytearray()
            for chunk in response.iter_bytes():  # as each read arrives: the deadline is checked in between
                if deadline.passed:
                    raise _late(label, shown, timeout_s)
                body += chunk
                if len(body) > budget.max_bytes:
                    raise _too_large(label, shown, budget)
            if deadline.passed:
                raise _late(label, shown, timeout_s)
            return FetchedImage(bytes(body), response.headers.get("content-type"))
    except EgressRefused as exc:
        log.warning("%s %s: refused by the egress policy: %s", label, shown, exc)
        raise UnsafeReference(f"{label} URL {shown}: {exc.shown}") from None
    except httpx.TransportError as exc:  # the watchdog's shut socket reads as one too
        if deadline.passed:
            raise _late(label, shown, timeout_s) from None
        log.warning("%s %s: failed (%s)", label, shown, type(exc).__name__)
        raise SourceUnavailable(f"{label} URL {shown}: not available") from None
    except httpx.HTTPError as exc:  # too many redirects, an undecodable body
        log.warning("%s %s: failed (%s)", label, shown, type(exc).__name__)
        raise SourceUnavailable(f"{label} URL {shown}: not available") from None


def fetch_image(url: str, *, policy: EgressPolicy, budget: ImageBudget, timeout_s: float, label: str = "image",
                mode: str = "RGB") -> DecodedImage:
    """``fetch_image_bytes`` then ``decode_image``, the answer's ``Content-Type`` as its declared type."""
    fetched = fetch_image_bytes(url, policy=policy, budget=budget, timeout_s=timeout_s, label=label)
    return decode_image(fetched.data, label=label, budget=budget, mode=mode, declared_type=fetched.content_type)


def _checked(url: str, policy: EgressPolicy, label: str) -> str:
    """The URL as it may be shown; refused before any connection when it is malformed or its
    scheme or host is not allowed (each redirect is checked again by the client's hook)."""
    import httpx

    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url) or "\\" in url:
        raise InvalidRequest(f"{label} URL is malformed (whitespace, a control character or a backslash)")
    try:
        httpx.URL(url)
    except (httpx.InvalidURL, ValueError, UnicodeError):
        raise InvalidRequest(f"{label} URL is malformed") from None
    shown = redact_url(url)
    try:
        policy.check_url(url)
    except EgressRefused as exc:
        log.warning("%s %s: refused by the egress policy: %s", label, shown, exc)
        raise UnsafeReference(f"{label} URL {shown}: {exc.shown}") from None
    return shown


def _too_large(label: str, shown: str, budget: ImageBudget, declared: int | None = None) -> RequestTooLarge:
    size = f"is {declared:,} bytes (its Content-Length)" if declared is not None else \
        f"sent more than {budget.max_bytes:,} bytes (reading stopped there)"
    return RequestTooLarge(f"{label} URL {shown} {size}; input images may have at most {budget.max_bytes:,} "
                           "(input_image_max_bytes)")


def _late(label: str, shown: str, timeout_s: float) -> SourceUnavailable:
    return SourceUnavailable(f"{label} URL {shown}: did not finish within {timeout_s:g} s")
