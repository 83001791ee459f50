"""Connections that send nothing are closed, and connections past the cap are answered at once.

uvicorn times out idle keep-alive connections (timeout_keep_alive) and answers 503 to requests past
limit_concurrency, but a connection that never sends its headers is kept forever, each holding a
file handle: enough of them and the server can accept nothing ("Too many open files"). The h11
protocol here adds a header-read timeout (from the connection's start, and again after each
response, until the next request's headers are whole) and answers a connection opened past twice
the cap with 503 and closes it before reading anything.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

_BUSY_BODY = b'{"error":{"message":"too many open connections","type":"ServiceUnavailableError","code":503}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def hardened_protocol(header_timeout_s: float, max_connections: int) -> type:
    """An H11Protocol class with the header-read timeout and the connection cap."""

    class HardenedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > 2 * max_connections:
                transport.write(BUSY)
                transport.close()
                return
            self._await_headers()

        def _await_headers(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers arrived whole
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._await_headers()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HardenedH11Protocol
