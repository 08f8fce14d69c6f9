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
- caps on connections open at once, per client and in total. A client is an address, except that an IPv6
  client is its /64 and all of loopback (127.0.0.0/8, ::1) is one client per local user (the owner of the
  connecting socket, as the kernel reports it in ``/proc/net/tcp``), so that many addresses of one host count
  together and local users do not share one cap. At a client's cap, the oldest of its connections that is idle
  between requests is closed to make room (never one still sending its request: a burst of requests must not
  cut its own first ones off); at the total cap, the oldest connection of any client that is not being served
  (idle, or still sending its request). Where none can be closed, the new connection waits, unread, until one
  ends (first come, first served within a client; at most ``max_connections`` wait, more are refused), so a
  client that opens more connections than its cap loses none of its requests, and its waiting connections
  never hold up another client's;
- a deadline for reading the answer: once the answer fills the connection's send buffers (the client reads it
  slower than it is written, or not at all), the client has ``answer_timeout_s`` to read enough of it for
  writing to go on, else the connection is closed and the answer freed (it is held in the server's memory
  until then).

The time an application takes to answer is not limited here (the sandbox's own timeouts bound it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
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
    answer_timeout_s: float = 30.0
    #: Which client an address counts as (:func:`client_key`; e.g. the address itself behind a trusted proxy
    #: that gives each user an address of its own).
    key: Callable[[str], str] = field(default_factory=lambda: client_key)
    open_total: int = 0
    open_per_client: Counter[str] = field(default_factory=Counter)
    #: Connections not being served (sending a request, or idle), oldest first: the ones a cap may close.
    idle: dict[Any, None] = field(default_factory=dict)
    #: Connections waiting, unread, for room under the caps, oldest first.
    waiting: dict[Any, None] = field(default_factory=dict)


def client_key(address: str) -> str:
    """The client an address counts as: itself, but all of loopback as one (which the connection then splits by
    local user) and an IPv6 address as its /64."""
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


def loopback_peer_uid(peer: tuple[str, int]) -> int | None:
    """The uid that owns the local TCP socket bound to ``peer`` (the client end of a loopback connection), from
    the kernel's socket tables (``/proc/net/tcp``, ``/proc/net/tcp6``); None if it is not there (gone)."""
    host, port = peer[0], peer[1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address):
        tables = {"/proc/net/tcp": ip.packed, "/proc/net/tcp6": ipaddress.IPv6Address(f"::ffff:{ip}").packed}
    else:
        tables = {"/proc/net/tcp6": ip.packed}
        if ip.ipv4_mapped is not None:
            tables["/proc/net/tcp"] = ip.ipv4_mapped.packed
    for table, packed in tables.items():
        # the kernel prints each 32-bit word of the address in host (little-endian) order
        words = "".join(
            f"{int.from_bytes(packed[i : i + 4], 'little'):08X}" for i in range(0, len(packed), 4)
        )
        local = f"{words}:{port:04X}"
        try:
            with open(table) as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and fields[1] == local:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def _client_of(limits: ConnectionLimits, client: tuple[str, int] | None) -> str:
    """The client a connection counts as: ``limits.key`` of its address; on loopback, per local user."""
    if not client:
        return "?"
    key = limits.key(client[0])
    if key == "loopback":
        key = f"loopback:uid={loopback_peer_uid(client)}"
    return key


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
        self._answer_timer: asyncio.TimerHandle | None = None
        self._guard_phase = ""
        self._counted = False
        self._peer = _client_of(self.limits, self.client)
        limits = self.limits
        if not any(c._peer == self._peer for c in limits.waiting) and self._make_room():
            self._admit()
        elif len(limits.waiting) < limits.max_connections:
            log.info(
                "a connection from %s waits: every open connection it may have is being served", self._peer
            )
            transport.pause_reading()
            limits.waiting[self] = None
        else:
            log.warning("refusing a connection from %s: every open connection is being served", self._peer)
            transport.abort()

    def _admit(self) -> None:
        limits = self.limits
        self._counted = True
        limits.open_total += 1
        limits.open_per_client[self._peer] += 1
        limits.idle[self] = None
        self._arm("headers", limits.header_timeout_s)

    def _admit_waiting(self) -> None:
        """Admit the waiting connections that now fit under the caps (closing idle ones as for a new one)."""
        for conn in list(self.limits.waiting):
            if conn._make_room():
                del self.limits.waiting[conn]
                conn._admit()
                conn.transport.resume_reading()

    def _make_room(self) -> bool:
        """Close the oldest idle connections until this one fits under both caps (see the module docstring);
        False if it cannot."""
        limits = self.limits
        while limits.open_per_client[self._peer] >= limits.max_connections_per_client:
            if not self._evict(lambda c: c._peer == self._peer and not c._guard_phase):
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
            if self.limits.waiting:
                self._admit_waiting()

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._answer_timer is None and not self.transport.is_closing():
            self._answer_timer = self.loop.call_later(self.limits.answer_timeout_s, self._answer_unread)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._stop_answer_timer()

    def _answer_unread(self) -> None:
        self._answer_timer = None
        log.info("closing a connection from %s: it left its answer unread", self._peer)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # reset, so that the kernel drops what it still holds of the answer at once
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # drops the buffered answer; the application's next send sees the disconnect

    def _stop_answer_timer(self) -> None:
        if getattr(self, "_answer_timer", None) is not None:
            self._answer_timer.cancel()
        self._answer_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)  # type: ignore[misc]
        if self.limits.waiting:
            self._admit_waiting()

    def _release(self) -> None:
        self._disarm()
        self._stop_answer_timer()
        self.limits.idle.pop(self, None)
        self.limits.waiting.pop(self, None)
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
