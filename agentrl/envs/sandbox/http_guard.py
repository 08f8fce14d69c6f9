"""Connection-level limits for ``agentrl serve sandbox``, as a uvicorn HTTP protocol (httptools-based).

uvicorn bounds idle keep-alive connections, but not a client that opens a connection and then sends its request
headers (or body) slowly, never, or without end: such connections pile up until the server runs out of file
descriptors or memory. This protocol adds, per connection:

- a deadline for the request's headers, from the connection's first byte (or, on a kept-alive connection,
  from the next request's first byte), and a deadline for the body once the headers are in; and a minimum byte
  rate in both phases (after a one-second grace): a connection that misses either is closed (the application
  never sees the request, so no execution is started);
- a cap on header bytes: more than ``max_header_bytes`` before the headers end gets HTTP 431 and the connection
  is closed, before anything (the token check included) looks at them;
- caps on connections open at once, per client and in total. A client is an address, except that all of
  loopback (127.0.0.0/8, ::1) is one client and an IPv6 client is its /64, so that many addresses of one host
  count together. At a cap, the oldest connection that is not being served (still sending its request, or idle
  between requests) is closed to make room; only when every connection is being served is the new one refused.

The time an application takes to answer is not limited here (the sandbox's own timeouts bound it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

_TOO_LARGE_BODY = b"request headers exceed this server's cap (max_header_bytes)\n"
_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)
#: Seconds a phase may run before its byte rate is checked.
_RATE_GRACE_S = 1.0


@dataclass
class ConnectionLimits:
    """Limits shared by all connections of one server, and the live state they are checked against."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_client: int = 64
    max_header_bytes: int = 64 * 1024
    min_bytes_per_s: float = 256.0
    #: Which client an address counts as (:func:`client_key`; e.g. the address itself behind a trusted proxy
    #: that gives each user an address of its own).
    key: Callable[[str], str] = field(default_factory=lambda: client_key)
    open_total: int = 0
    open_per_client: Counter[str] = field(default_factory=Counter)
    #: Connections not being served (sending a request, or idle), oldest first: the ones a cap may close.
    idle: dict[Any, None] = field(default_factory=dict)


def client_key(address: str) -> str:
    """The client an address counts as: itself, but all of loopback as one and an IPv6 address as its /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """A uvicorn protocol class (pass as ``uvicorn.Config(http=...)``) that enforces ``limits``."""

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        pass

    GuardedHttpToolsProtocol.limits = limits
    return GuardedHttpToolsProtocol


class _Guard:
    """Mixin over uvicorn's protocol: see the module docstring."""

    limits: ConnectionLimits
    transport: asyncio.Transport
    client: tuple[str, int] | None
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_timer: asyncio.TimerHandle | None = None
        self._guard_phase = ""
        self._counted = False
        self._peer = self.limits.key(self.client[0]) if self.client else "?"
        limits = self.limits
        if not self._make_room():
            log.warning("refusing a connection from %s: every open connection is being served", self._peer)
            transport.abort()
            return
        self._counted = True
        limits.open_total += 1
        limits.open_per_client[self._peer] += 1
        limits.idle[self] = None
        self._arm("headers", limits.header_timeout_s)

    def _make_room(self) -> bool:
        """Close the oldest idle connections until this one fits under both caps; False if it cannot."""
        limits = self.limits
        while limits.open_per_client[self._peer] >= limits.max_connections_per_client:
            if not self._evict(lambda c: c._peer == self._peer):
                return False
        while limits.open_total >= limits.max_connections:
            if not self._evict(lambda c: True):
                return False
        return True

    def _evict(self, match: Any) -> bool:
        victim = next((c for c in self.limits.idle if match(c)), None)
        if victim is None:
            return False
        log.info("closing an idle connection from %s to make room for a new one", victim._peer)
        victim._release()
        victim.transport.abort()
        return True

    def data_received(self, data: bytes) -> None:
        if self._guard_phase == "" and self._between_requests():
            self._arm("headers", self.limits.header_timeout_s)  # a new request on a kept-alive connection
            self.limits.idle[self] = None
        if self._guard_phase:
            self._phase_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._guard_phase == "headers" and (cycle is None or cycle.response_complete):
            if self._phase_bytes > self.limits.max_header_bytes:  # headers still not over
                log.info("closing a connection from %s: request headers too large", self._peer)
                self.transport.write(_HEADERS_TOO_LARGE)
                self.transport.close()
            return
        if cycle is not None and not cycle.response_complete:
            if cycle.more_body:
                if self._guard_phase != "body":
                    self._arm("body", self.limits.body_timeout_s)
            elif self._guard_phase:
                self._disarm()  # the whole request is in: the application has it
                self.limits.idle.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self._counted and not self.transport.is_closing():
            self.limits.idle[self] = None  # idle until its next request: a cap may close it

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)  # type: ignore[misc]

    def _release(self) -> None:
        self._disarm()
        self.limits.idle.pop(self, None)
        if getattr(self, "_counted", False):
            self._counted = False
            self.limits.open_total -= 1
            self.limits.open_per_client[self._peer] -= 1
            if self.limits.open_per_client[self._peer] <= 0:
                del self.limits.open_per_client[self._peer]

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._guard_phase = phase
        self._phase_bytes = 0
        self._phase_start = time.monotonic()
        self._phase_deadline = self._phase_start + seconds
        self._guard_timer = self.loop.call_later(min(seconds, _RATE_GRACE_S), self._check)

    def _disarm(self) -> None:
        if getattr(self, "_guard_timer", None) is not None:
            self._guard_timer.cancel()
        self._guard_timer = None
        self._guard_phase = ""

    def _check(self) -> None:
        """Close the connection if its phase is past its deadline or below the minimum byte rate; else look
        again in a second."""
        now = time.monotonic()
        slow = self._phase_bytes < self.limits.min_bytes_per_s * (now - self._phase_start - _RATE_GRACE_S)
        if now >= self._phase_deadline or slow:
            log.info(
                "closing a connection from %s: its request %s %s",
                self._peer,
                self._guard_phase,
                "did not arrive in time" if not slow else "arrived too slowly",
            )
            self._guard_timer = None
            self.transport.close()
            return
        self._guard_timer = self.loop.call_later(min(1.0, self._phase_deadline - now), self._check)
