"""Connection-level limits for ``agentrl serve sandbox``, as a uvicorn HTTP protocol (httptools-based).

uvicorn bounds idle keep-alive connections, but not a client that opens a connection and then sends its request
headers (or body) slowly or never: such half-open connections pile up until the server runs out of file
descriptors. This protocol adds, per connection:

- a deadline for the request's headers, from the connection's first byte (or, on a kept-alive connection,
  from the next request's first byte), and a deadline for the body once the headers are in; a connection that
  misses one is closed (the application never sees the request, so no execution is started);
- a cap on connections open at once from one client address, and on all connections together; connections
  beyond a cap are closed at once, before anything is read.

The time an application takes to answer is not limited here (the sandbox's own timeouts bound it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


@dataclass
class ConnectionLimits:
    """Limits shared by all connections of one server, and the live counts they are checked against."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_client: int = 64
    open_total: int = 0
    open_per_client: Counter[str] = field(default_factory=Counter)


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
        self._peer = self.client[0] if self.client else "?"
        limits = self.limits
        if (
            limits.open_total >= limits.max_connections
            or limits.open_per_client[self._peer] >= limits.max_connections_per_client
        ):
            self._counted = False
            log.warning("refusing a connection from %s: too many open connections", self._peer)
            transport.abort()
            return
        self._counted = True
        limits.open_total += 1
        limits.open_per_client[self._peer] += 1
        self._arm("headers", limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._guard_phase == "" and self._between_requests():
            self._arm("headers", self.limits.header_timeout_s)  # a new request on a kept-alive connection
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.more_body:
                if self._guard_phase != "body":
                    self._arm("body", self.limits.body_timeout_s)
            elif self._guard_phase:
                self._disarm()  # the whole request is in: the application has it

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_counted", False):
            self._counted = False
            self.limits.open_total -= 1
            self.limits.open_per_client[self._peer] -= 1
            if self.limits.open_per_client[self._peer] <= 0:
                del self.limits.open_per_client[self._peer]
        super().connection_lost(exc)  # type: ignore[misc]

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._guard_phase = phase
        self._guard_timer = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_guard_timer", None) is not None:
            self._guard_timer.cancel()
        self._guard_timer = None
        self._guard_phase = ""

    def _expire(self) -> None:
        log.info(
            "closing a connection from %s: its request %s did not arrive in time",
            self._peer,
            self._guard_phase,
        )
        self._guard_timer = None
        self.transport.close()
