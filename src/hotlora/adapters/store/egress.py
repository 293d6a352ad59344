"""Where the store may connect: one egress policy for every byte fetched for a client.

HTTPS references (every redirect hop), the S3 endpoint and the Hub endpoint all connect through
``client(policy)``: an httpx client whose connections are opened by ``PinnedBackend``. It resolves
the host once, refuses the connection unless every address is a public unicast one (or the host is
listed in ``allowed_hosts``), and connects to the address it vetted, so a name cannot resolve to a
public address for the check and to an internal one for the connection (DNS rebinding). TLS still
verifies the certificate against the host name: httpcore hands the name to ``start_tls`` apart
from the address it connected to.

Refusals are ``EgressRefused`` (an ``UnsafeReference``): the caller says "not allowed" with the
reference's display; the reason (which address, which rule) is for the operator's log only.

Written here by hand, because no library does it: the address vetting (``ipaddress`` decides what
is public) and the thin httpcore backend that connects to the vetted address.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from hotlora.adapters.store.references import UnsafeReference

log = logging.getLogger(__name__)


class EgressRefused(UnsafeReference):
    """A destination the egress policy does not allow. Its message is for logs; ``shown`` is what
    a client may read (a scheme rule, never which address a name resolved to)."""

    def __init__(self, message: str, shown: str = "not allowed"):
        super().__init__(message)
        self.shown = shown


# Non-public IPv6 space Python's ``ipaddress`` (3.11) counts as global: the deprecated site-local
# fec0::/10 (RFC 3879; still routed inside some sites; ``is_site_local``, not ``is_private``) and
# the documentation prefix 3fff::/20 (RFC 9637, 2024). The NAT64 prefixes (64:ff9b::/96,
# 64:ff9b:1::/48) and SIIT (::ffff:0:0/96) lie in ``is_reserved`` space and are refused as such.
_NOT_PUBLIC_V6 = (ipaddress.ip_network("3fff::/20"),)


def is_public(address: str) -> bool:
    """A global unicast address: not loopback, private, link-local, site-local, multicast, reserved,
    unspecified, shared (CGNAT) or documentation space; IPv4-mapped/-compatible IPv6 judged as
    the IPv4 address it carries (``::ffff:127.0.0.1`` is loopback)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if mapped is not None:
            return is_public(str(mapped))
        if ip.is_site_local or any(ip in network for network in _NOT_PUBLIC_V6):
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified or ip.is_loopback
                                 or ip.is_link_local or ip.is_private)


def _split_entry(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (host, port or None). A port that is
    not one (``host:http``, ``host:99999``) makes an entry that matches nothing, never any port."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, _entry_port(rest[1:], entry) if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _entry_port(port, entry)
    return entry, None


def _entry_port(text: str, entry: str) -> int:
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    log.warning("allowed_hosts entry %r has no valid port: it allows nothing", entry)
    return -1


def _port(parts) -> int:
    """The URL's port (the scheme's default when none); EgressRefused for one that is not a port."""
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise EgressRefused("malformed port in URL", shown="not allowed (malformed URL)")
    return port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class EgressPolicy:
    """``allowed_hosts``: names (or ``host:port``) allowed even when they resolve to internal
    addresses. ``exclusive``: when the list is not empty, nothing else is allowed (HTTPS references
    chosen by clients); operator-configured endpoints (S3, the Hub) and their CDN redirects use a
    non-exclusive policy: any public address, plus what is listed."""

    allowed_hosts: tuple[str, ...] = ()
    exclusive: bool = True
    allow_http: bool = False

    @classmethod
    def of(cls, config, exclusive: bool = True) -> "EgressPolicy":
        return cls(tuple(config.allowed_hosts), exclusive, config.allow_http)

    def listed(self, host: str, port: int | None) -> bool:
        host = host.lower().strip("[]")
        for entry in self.allowed_hosts:
            name, entry_port = _split_entry(entry)
            if name == host and (entry_port is None or entry_port == port):
                return True
        return False

    def check_url(self, url: str) -> None:
        """The scheme and the name of one request (each redirect hop); addresses are vetted at connect."""
        try:
            parts = urlsplit(str(url))
        except ValueError:  # a broken IPv6 literal
            raise EgressRefused("malformed URL", shown="not allowed (malformed URL)") from None
        if parts.scheme != "https" and not (parts.scheme == "http" and self.allow_http):
            raise EgressRefused(f"scheme {parts.scheme!r} is not allowed", shown="not allowed (https only)")
        host = parts.hostname or ""
        if not host:
            raise EgressRefused("URL without a host", shown="not allowed (malformed URL)")
        port = _port(parts)
        if self.exclusive and self.allowed_hosts and not self.listed(host, port):
            raise EgressRefused(f"host {host!r} is not in allowed_hosts")

    def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` that may be connected to; refused unless all of them may."""
        if self.exclusive and self.allowed_hosts and not self.listed(host, port):
            raise EgressRefused(f"host {host!r} is not in allowed_hosts")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise OSError(f"cannot resolve {host!r}") from exc
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        if not self.listed(host, port):
            internal = [a for a in addresses if not is_public(a)]
            if internal or not addresses:
                raise EgressRefused(f"host {host!r} resolves to non-public address(es) {internal}")
        return addresses

    def check_endpoint(self, url: str) -> None:
        """An endpoint checked without connecting (what a foreign client will connect to)."""
        self.check_url(url)
        parts = urlsplit(url)
        self.resolve(parts.hostname or "", _port(parts))


def _backend(policy: EgressPolicy):
    import httpcore

    class PinnedBackend(httpcore.SyncBackend):
        """Connects to an address ``policy`` vetted, never to whatever the name resolves to later."""

        def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            try:
                addresses = policy.resolve(host, port)
            except OSError as exc:  # a name that does not resolve: a connection error like any other
                raise httpcore.ConnectError(str(exc)) from None
            error: Exception | None = None
            for address in addresses:
                try:
                    return super().connect_tcp(address, port, timeout, local_address, socket_options)
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                    error = exc
            raise error

    return PinnedBackend()


def client(policy: EgressPolicy, timeout: float, **kwargs):
    """An httpx client under ``policy``: every request (redirects too) checked, every connection
    pinned to a vetted address. Environment proxies are ignored (``trust_env=False``): a proxy
    would connect on our behalf to addresses this policy never saw."""
    import httpcore
    import httpx

    def check(request):
        policy.check_url(str(request.url))

    hooks = kwargs.pop("event_hooks", {})
    hooks = {**hooks, "request": [check, *hooks.get("request", [])]}
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx 0.28 takes no network backend; its transport is a thin adapter around this pool, so
    # the pool is replaced by one built with the same defaults and our backend.
    transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                              network_backend=_backend(policy))
    return httpx.Client(transport=transport, timeout=timeout, follow_redirects=True, trust_env=False,
                        event_hooks=hooks, **kwargs)
