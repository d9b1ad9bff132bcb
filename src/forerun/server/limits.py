"""Connection limits of ``forerun serve``, enforced where uvicorn reads the socket.

uvicorn's HTTP/1.1 protocol (h11) closes idle keep-alive connections once a response has been
sent, and nothing else: a connection that never sends a request, a request head or body that
trickles in byte by byte, any number of open connections, all are held indefinitely, and a
request head over h11's buffer limit is cut off with a TCP reset. ``protocol_class`` returns a
subclass that adds, per connection:

- an idle limit (``keep_alive_s``) from the moment it opens, not only between requests;
- a read limit (``read_timeout_s``): a request's head and body must arrive within it from the
  request's first byte, else 408;
- a cap on open connections (``max_connections``): the next one gets 503 with Retry-After;
- a head size limit (``max_header_bytes``): 431.

Refusals are JSON errors in the API's format, counted in the metrics by ``on_refusal(status)``;
the connection is then closed after a short linger that reads and drops what the client is still
sending, so the client reads the answer instead of a reset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from forerun.errors import ForerunError
from forerun.server.requests import TIMED_OUT, ApiError

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


@dataclass(frozen=True)
class Limits:
    keep_alive_s: float = 5.0
    read_timeout_s: float = 30.0
    max_connections: int = 128
    max_header_bytes: int = 32 << 10
    linger_s: float = 2.0

    def check(self) -> Limits:
        for flag, v in (("--keep-alive-timeout", self.keep_alive_s), ("--read-timeout", self.read_timeout_s)):
            if not v > 0:
                raise ForerunError(f"{flag} must be > 0 seconds, got {v}")
        if self.max_connections < 1:
            raise ForerunError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ForerunError(f"--max-header-bytes must be >= 1024, got {self.max_header_bytes}")
        return self

    def uvicorn_kwargs(self, on_refusal=None) -> dict:
        """What ``uvicorn.Config`` takes to enforce these limits."""
        # h11's own limit sits above ours, so ours answers 431 first
        return {"http": protocol_class(self, on_refusal), "timeout_keep_alive": self.keep_alive_s,
                "h11_max_incomplete_event_size": 2 * self.max_header_bytes + 4096}


def refusal_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP answer carrying the API's error body, written straight to the socket."""
    error = ApiError(status, message, "invalid_request_error" if status < 500 else "server_error", code=code)
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if status == 503:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def protocol_class(limits: Limits, on_refusal=None) -> type:
    """uvicorn's h11 protocol with ``limits`` (see the module's text); ``on_refusal(status)`` is
    called for every refusal it answers itself."""

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._read_timer = None
            self._refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"too many open connections (this server's limit is {limits.max_connections})",
                             "too_many_connections")
                return
            # idle from the start: a connection that never sends a request is closed like an idle keep-alive one
            self.timeout_keep_alive_task = self.loop.call_later(limits.keep_alive_s, self.timeout_keep_alive_handler)

        def connection_lost(self, exc) -> None:
            self._stop_read_timer()
            super().connection_lost(exc)
            self._unset_keepalive_if_required()

        def data_received(self, data: bytes) -> None:
            if self._refused:  # lingering before the close: drop what still arrives
                return
            if self.conn.their_state is h11.IDLE:  # reading a request head
                pending = self.conn.trailing_data[0] + data
                if len(pending) > limits.max_header_bytes and b"\r\n\r\n" not in pending[: limits.max_header_bytes + 4]:
                    self._unset_keepalive_if_required()
                    self._refuse(431, f"the request head exceeds this server's limit of {limits.max_header_bytes} bytes",
                                 "request_header_too_large")
                    return
            super().data_received(data)
            if self._refused or self.transport.is_closing():
                return
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # bytes of a request that has not all arrived
                if self._read_timer is None:  # the request's first bytes: its head and body must follow in time
                    self._read_timer = self.loop.call_later(limits.read_timeout_s, self._read_timed_out)
            else:
                self._stop_read_timer()

        def on_response_complete(self) -> None:
            self._stop_read_timer()
            super().on_response_complete()

        def _stop_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing() or self._refused:
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and self.conn.their_state is h11.SEND_BODY:
                if cycle.response_started:  # the app answered already (e.g. 413): just end the connection
                    self.transport.close()
                    return
                self.scope[TIMED_OUT] = True  # the app's wait for the body ends as a disconnect, not counted again
                cycle.disconnected = True
                cycle.message_event.set()
            elif self.conn.their_state is not h11.IDLE:
                return
            self._refuse(408, f"the request was not received within {limits.read_timeout_s:g} s", "request_timeout")

        def _refuse(self, status: int, message: str, code: str) -> None:
            self._refused = True
            self._stop_read_timer()
            if on_refusal is not None:
                on_refusal(status)
            t = self.transport
            t.write(refusal_bytes(status, message, code))
            if t.can_write_eof():
                t.write_eof()
            self.loop.call_later(limits.linger_s, t.close)

    return LimitedH11Protocol
