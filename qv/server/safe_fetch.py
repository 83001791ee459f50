"""HTTP(S) GETs of media URLs that cannot reach inside the server's network.

Every connection goes to an address that was checked, and to no other:

- httpcore (httpx's own transport layer) runs the HTTP with a network backend of qv's
  (`CheckedBackend`). Its `connect_tcp` gets the URL's host name, resolves it once
  (`loop.getaddrinfo`, off the event loop), keeps only the addresses the policy allows and opens
  the socket to one of those IPs itself, so nothing resolves the name a second time (no DNS
  rebinding between check and connect). TLS then starts on that socket with the URL's host name
  for SNI and certificate checks, and the Host header is the URL's.
- Redirects are followed here one hop at a time; each hop's host is checked against the domain
  allow-list and connects through the same backend, so it is checked again.
- `AddressPolicy` denies, for IPv4 and IPv6 alike: loopback, link-local (169.254/16,
  fe80::/10), private (RFC 1918, fc00::/7), CGNAT (100.64/10), multicast, unspecified,
  site-local, reserved and every other non-global range, and IPv6 forms that carry an IPv4
  address (IPv4-mapped ::ffff:a.b.c.d is judged as that IPv4 address; 6to4 is denied when its
  embedded address is). The `media_allowed_networks` lever (CIDRs) opens chosen ranges.
- Failures are a `FetchError` whose text is a cause class only ("address not allowed", "timed
  out", "HTTP error", ...): never the status, the port or what answered, so the error texts
  cannot serve as a port scanner.
- No proxies from the environment and no .netrc (httpcore reads neither); bodies are not
  decompressed (Accept-Encoding: identity), so the byte cap is the cap on what is held.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from typing import Awaitable, Callable

import httpcore
import httpx

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# IANA's not-globally-reachable ranges that some Python versions' is_global misses (3.11 knows
# neither 192.0.0.0/24 whole nor multicast as non-global); checked beside ipaddress's own flags.
NOT_GLOBAL = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24",
    "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
    "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001::/23",
    "2001:db8::/32", "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8")]
HEADERS = [(b"Accept", b"image/*, video/*;q=0.9, */*;q=0.5"), (b"Accept-Encoding", b"identity"),
           (b"User-Agent", b"qv-media-fetch")]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchError(Exception):
    """A fetch that failed; the message is the cause class, safe to show to the client."""


def _internal(ip: IPAddress) -> bool:
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
            or ip.is_unspecified or not ip.is_global or any(ip in n for n in NOT_GLOBAL if n.version == ip.version))


class AddressPolicy:
    """Which resolved addresses media may be fetched from: global ones, and `allowed_networks`."""

    def __init__(self, allowed_networks: str = ""):
        self.allowed = [ipaddress.ip_network(n.strip(), strict=False) for n in allowed_networks.split(",") if n.strip()]

    def allows(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])  # a zone id (fe80::1%eth0) marks link-local
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:  # the kernel connects to the IPv4 address itself
            ip = ip.ipv4_mapped
        if "%" in address:
            return any(ip in n for n in self.allowed)
        if any(ip in n for n in self.allowed):
            return True
        if ip.version == 6 and ip.sixtofour is not None and _internal(ip.sixtofour):
            return False
        return not _internal(ip)


async def resolve(host: str, port: int) -> list[str]:
    """Every address of `host` once, in the resolver's order (the default executor runs it)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _Refused(Exception):
    """Raised inside httpcore's connect; carries the cause class out of it."""


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend that resolves once, checks, and connects to a checked IP."""

    def __init__(self, policy: AddressPolicy, resolver: Resolver = resolve,
                 inner: httpcore.AsyncNetworkBackend | None = None):
        self.policy, self.resolver = policy, resolver
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError):
            raise _Refused("host not found") from None
        allowed = [a for a in addresses if self.policy.allows(a)]
        if not allowed:
            raise _Refused("address not allowed (media_allowed_networks)" if addresses else "host not found")
        error: Exception | None = None
        for address in allowed:  # in the resolver's order, as a plain connect would try them
            try:
                stream = await self.inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            return stream
        raise error

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise _Refused("address not allowed")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def default_ssl_context() -> ssl.SSLContext:
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


class SafeFetcher:
    """GET one http(s) URL's body under the address policy, the domain allow-list, a byte cap
    and one overall timeout (resolving, connecting, redirects and the body together)."""

    def __init__(self, max_bytes: int, timeout_s: float, allowed_domains: str = "", allowed_networks: str = "",
                 resolver: Resolver = resolve, ssl_context: ssl.SSLContext | None = None):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.domains = {d.strip().lower().strip(".") for d in allowed_domains.split(",") if d.strip()}
        self.policy = AddressPolicy(allowed_networks)
        self.resolver = resolver
        self.ssl_context = ssl_context or default_ssl_context()

    async def get(self, url: str) -> bytes:
        """The body of a 200 answer, or FetchError naming the cause class."""
        try:
            return await asyncio.wait_for(self._get(url), self.timeout_s)
        except asyncio.TimeoutError:
            raise FetchError("timed out (media_timeout_s)") from None
        except _Refused as exc:
            raise FetchError(str(exc)) from None
        except httpcore.TimeoutException:
            raise FetchError("timed out (media_timeout_s)") from None
        except httpcore.ConnectError:
            raise FetchError("could not connect") from None
        except (httpcore.ProtocolError, httpcore.NetworkError, httpcore.UnsupportedProtocol, ssl.SSLError, OSError):
            raise FetchError("connection failed") from None

    def _check_url(self, url: httpx.URL) -> None:
        if url.scheme not in ("http", "https"):
            raise FetchError("unsupported URL scheme (http or https)")
        host = url.raw_host.decode("ascii").lower().strip(".")
        if not host:
            raise FetchError("invalid URL")
        if self.domains and not any(host == d or host.endswith("." + d) for d in self.domains):
            raise FetchError("domain not allowed (media_allowed_domains)")

    async def _get(self, text: str) -> bytes:
        try:
            url = httpx.URL(text)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise FetchError("invalid URL") from None
        backend = CheckedBackend(self.policy, self.resolver)
        timeout = {"connect": self.timeout_s, "read": self.timeout_s, "write": self.timeout_s, "pool": self.timeout_s}
        async with httpcore.AsyncConnectionPool(ssl_context=self.ssl_context, network_backend=backend, retries=0) as pool:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_url(url)
                target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
                async with pool.stream("GET", target, headers=HEADERS, extensions={"timeout": timeout}) as resp:
                    location = _header(resp.headers, b"location")
                    if resp.status in REDIRECTS and location:
                        try:
                            url = url.join(location.decode("latin-1"))
                        except (httpx.InvalidURL, ValueError):
                            raise FetchError("invalid redirect") from None
                        continue
                    if resp.status != 200:
                        raise FetchError("HTTP error")
                    return await self._body(resp)
        raise FetchError(f"too many redirects (more than {MAX_REDIRECTS})")

    async def _body(self, resp: httpcore.Response) -> bytes:
        too_large = FetchError(f"too large (over the {self.max_bytes}-byte limit, media_max_bytes)")
        length = _header(resp.headers, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            raise too_large
        body = bytearray()
        async for chunk in resp.aiter_stream():
            body += chunk
            if len(body) > self.max_bytes:
                raise too_large
        return bytes(body)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None
