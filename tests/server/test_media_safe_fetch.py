"""The address policy and the checked connection of qv/server/safe_fetch.py.

The policy over a table of addresses (IPv4 and IPv6, mapped and 6to4 forms, the lever's ranges).
Then DNS rebinding with a resolver the test controls and real HTTP servers on two loopback
addresses: 127.0.0.2 stands for a public host (opened by media_allowed_networks) and 127.0.0.1 for
the inside. The resolver answers the public address first and the inside one afterwards, so a
fetcher that resolved a second time to connect would reach the inside server: the body, the
resolver's call count and the inside server's hits show where each connection went. HTTPS with a
test CA: the connection goes to the IP while SNI and the certificate check use the host name.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qv.server.safe_fetch import AddressPolicy, FetchError, SafeFetcher

DENIED = ["127.0.0.1", "127.255.0.9", "0.0.0.0", "0.1.2.3", "10.0.0.5", "172.16.0.1", "172.31.255.254", "192.168.1.1",
          "169.254.169.254", "100.64.0.1", "100.127.255.254", "224.0.0.1", "239.255.255.250", "255.255.255.255",
          "240.0.0.1", "192.0.0.8", "198.18.0.1", "192.0.2.1",
          "::1", "::", "fe80::1", "fe80::1%2", "febf::1", "fec0::1", "fc00::1", "fd12:3456::1", "ff02::1", "ff0e::1",
          "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.5", "::ffff:0:a00:5", "::127.0.0.1",
          "64:ff9b::a9fe:a9fe", "2002:7f00:1::1", "2002:a9fe:a9fe::", "2001:0:4136:e378:8000:63bf:3fff:fdd2",
          "2001:db8::1", "100::1", "not an address", ""]
ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "100.128.0.1", "172.32.0.1", "2606:4700:4700::1111",
           "2a00:1450:4001:80b::200e", "::ffff:8.8.8.8", "2002:808:808::1"]


def test_policy_table():
    p = AddressPolicy()
    assert [a for a in DENIED if p.allows(a)] == []
    assert [a for a in ALLOWED if not p.allows(a)] == []
    opened = AddressPolicy(" 10.0.0.0/8, 169.254.169.254/32 ,fd00::/8,fe80::/10")
    assert opened.allows("10.0.0.5") and opened.allows("::ffff:10.1.2.3") and opened.allows("169.254.169.254")
    assert opened.allows("fd00::5") and opened.allows("fe80::1%2") and opened.allows("8.8.8.8")
    assert not opened.allows("169.254.169.253") and not opened.allows("172.16.0.1") and not opened.allows("::1")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        srv = self.server
        srv.hits.append((self.path, self.headers.get("Host")))
        if self.path == "/hop":  # a redirect to the same name: the next hop resolves again
            body, code, extra = b"", 302, {"Location": f"http://rebind.test:{srv.server_port}/img"}
        else:
            body, code, extra = srv.body, 200, {}
        self.send_response(code)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(host: str, port: int, body: bytes, tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads, srv.block_on_close = True, False
    srv.hits, srv.body = [], body
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@pytest.fixture()
def pair():
    """(public server on 127.0.0.2, inside server on 127.0.0.1), one port."""
    for _ in range(20):
        probe = socket.socket()
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
        probe.close()
        try:
            public = serve("127.0.0.2", port, b"PUBLIC")
        except OSError:
            continue
        try:
            inside = serve("127.0.0.1", port, b"SECRET")
        except OSError:
            public.shutdown()
            public.server_close()
            continue
        break
    yield public, inside
    for s in (public, inside):
        s.shutdown()
        s.server_close()


class Rebinder:
    """A resolver that answers `first` once, then `then` (a DNS server changing its answer)."""

    def __init__(self, first: list[str], then: list[str]):
        self.first, self.then, self.calls = first, then, []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        return self.first if len(self.calls) == 1 else self.then


def fetch(url: str, resolver, **kw) -> bytes:
    f = SafeFetcher(1 << 16, 10.0, allowed_networks="127.0.0.2/32", resolver=resolver, **kw)
    return asyncio.run(f.get(url))


def refused(url: str, resolver, cause: str, **kw) -> None:
    with pytest.raises(FetchError) as e:
        fetch(url, resolver, **kw)
    assert str(e.value) == cause


def test_connects_to_the_checked_address(pair):
    public, inside = pair
    port = public.server_port
    r = Rebinder(["127.0.0.2"], ["127.0.0.1"])
    assert fetch(f"http://rebind.test:{port}/img", r) == b"PUBLIC"
    assert r.calls == ["rebind.test"] and inside.hits == []  # resolved once; never reached the inside
    assert public.hits == [("/img", f"rebind.test:{port}")]  # the URL's Host header, not the IP
    # an answer with both: only the allowed address is connected to, whatever its order
    assert fetch(f"http://rebind.test:{port}/img", Rebinder(["127.0.0.1", "127.0.0.2"], [])) == b"PUBLIC"
    assert inside.hits == []


def test_every_hop_is_resolved_and_checked_again(pair):
    public, inside = pair
    r = Rebinder(["127.0.0.2"], ["127.0.0.1"])
    refused(f"http://rebind.test:{public.server_port}/hop", r, "address not allowed (media_allowed_networks)")
    assert r.calls == ["rebind.test", "rebind.test"] and [p for p, _ in public.hits] == ["/hop"]
    assert inside.hits == []
    both = Rebinder(["127.0.0.2"], ["127.0.0.2"])
    assert fetch(f"http://rebind.test:{public.server_port}/hop", both) == b"PUBLIC"


def test_resolver_failures_and_empty_answers(pair):
    async def broken(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def empty(host, port):
        return []

    refused("http://nowhere.test/x", broken, "host not found")
    refused("http://nowhere.test/x", empty, "host not found")
    refused("http://inside.test/x", Rebinder(["10.0.0.5", "::1"], []), "address not allowed (media_allowed_networks)")


def test_https_verifies_the_host_name_on_the_checked_ip(pair):
    """TLS to 127.0.0.2 for https://rebind.test: SNI and the certificate are the host name's."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    port = pair[0].server_port + 1 if pair[0].server_port < 65000 else 40001
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("rebind.test").configure_cert(tls)
    names = []
    tls.sni_callback = lambda sock, name, ctx: names.append(name)
    try:
        srv = serve("127.0.0.2", port, b"TLS", tls)
    except OSError:
        pytest.skip("port taken")
    try:
        client = ssl.create_default_context()
        ca.configure_trust(client)
        assert fetch(f"https://rebind.test:{port}/img", Rebinder(["127.0.0.2"], []), ssl_context=client) == b"TLS"
        assert names == ["rebind.test"]
        # the same server under another name: its certificate does not match, so no body
        refused(f"https://other.test:{port}/img", Rebinder(["127.0.0.2"], []), "could not connect", ssl_context=client)
        assert [p for p, _ in srv.hits] == ["/img"]
    finally:
        srv.shutdown()
        srv.server_close()
