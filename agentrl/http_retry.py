"""The one retry policy of agentrl's HTTP clients (the OpenAI-compatible endpoint client and the OpenAPI
tools), built on tenacity.

:func:`retrying` returns a ``tenacity.AsyncRetrying``: up to ``retries`` more attempts after the first,
exponential backoff with jitter (``backoff_s * 2**n`` scaled by a random factor in [0.5, 1], capped at
``max_backoff_s``), a server's ``Retry-After`` honoured (also capped), and only the exceptions in
``retry_on`` retried; the last exception is re-raised. A caller raises :class:`RetryableStatus` for an
HTTP answer worth retrying (:data:`RETRY_STATUSES`, or its own choice).

This module imports nothing from agentrl, so every layer may use it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

#: HTTP statuses worth retrying: the request may succeed later.
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class RetryableStatus(Exception):
    """An HTTP answer worth retrying: ``status``, a short ``message`` and the server's ``Retry-After``
    (seconds) if it sent one."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def from_response(cls, resp: httpx.Response, message: str) -> RetryableStatus:
        retry_after = None
        if ra := resp.headers.get("retry-after"):
            try:
                retry_after = max(0.0, float(ra))
            except ValueError:
                pass
        return cls(resp.status_code, message, retry_after)


def backoff(backoff_s: float, max_backoff_s: float) -> Callable[[RetryCallState], float]:
    """Seconds to wait before the next attempt (tenacity ``wait``)."""

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, RetryableStatus) and exc.retry_after_s is not None:
            return min(exc.retry_after_s, max_backoff_s)
        base = min(backoff_s * 2 ** (state.attempt_number - 1), max_backoff_s)
        return base * (0.5 + random.random() / 2)

    return wait


def retrying(
    retries: int,
    *,
    backoff_s: float = 0.5,
    max_backoff_s: float = 16.0,
    retry_on: tuple[type[BaseException], ...] = (httpx.TransportError, RetryableStatus),
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> AsyncRetrying:
    """``async for attempt in retrying(...): with attempt: ...`` runs the block until it succeeds, raises
    something outside ``retry_on``, or ran ``retries + 1`` times (then the last exception is raised)."""
    return AsyncRetrying(
        stop=stop_after_attempt(max(0, retries) + 1),
        wait=backoff(backoff_s, max_backoff_s),
        retry=retry_if_exception_type(retry_on),
        before_sleep=before_sleep,
        reraise=True,
    )
