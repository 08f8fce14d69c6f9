"""A SandboxFusion client backend (httpx): runs code on a real SandboxFusion server or on ``agentrl serve
sandbox``, through ``POST /run_code``.

SandboxFusion has no persistent kernels: each ``/run_jupyter`` request starts a fresh one. Sessions are
therefore emulated by replay: a session remembers the cells that ran successfully, and each run sends them
again, followed by the new cell, in one ``/run_jupyter`` request; only the new cell's output is returned. State
is exact for deterministic code; side effects of earlier cells (files, prints to the outside) happen again, and
a run costs time proportional to the session's history. Cells that failed are not replayed. A replay may take
at most the server's limit on a request's timeouts (``max_timeout_s``, 60 s on ``agentrl serve sandbox`` by
default): every timeout this client sends is clamped to it.
"""

from __future__ import annotations

import os
import uuid

import httpx
from pydantic import ValidationError

from agentrl.envs.sandbox import fusion_api as api
from agentrl.envs.sandbox.base import ExecResult, SandboxError

ENDPOINT_ENV = "SANDBOX_FUSION_ENDPOINT"
#: Seconds allowed on top of a run's own timeout for queueing and transfer.
HTTP_SLACK_S = 30.0


class SandboxFusionBackend:
    """Implements :class:`~agentrl.envs.sandbox.base.SandboxBackend` over SandboxFusion's HTTP API.

    Args:
        endpoint: server base URL; default ``$SANDBOX_FUSION_ENDPOINT`` or ``http://localhost:8080``.
        token: optional bearer token (``agentrl serve sandbox --token``).
        max_connections: concurrent HTTP connections.
        retries: connection-level retries (connect errors only; an execution is never sent twice).
        max_timeout_s: the server's limit on the timeouts of one request (``agentrl serve sandbox``'s
            ``max_timeout_s``); timeouts sent are clamped to it, so that a long session's replay is not refused.
        transport: an httpx transport to use instead of the network (for tests and custom routing).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        token: str | None = None,
        max_connections: int = 64,
        retries: int = 2,
        max_timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_timeout_s = max_timeout_s
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or "http://localhost:8080").rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(
            base_url=self.endpoint,
            headers=headers,
            transport=transport or httpx.AsyncHTTPTransport(retries=retries, limits=limits),
        )
        self._sessions: dict[str, list[str]] = {}
        self._closed = False

    async def ping(self) -> bool:
        """True if the server answers ``GET /v1/ping``."""
        try:
            resp = await self._client.get("/v1/ping", timeout=10.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float = 10.0, stdin: str = ""
    ) -> ExecResult:
        """Run ``code``; see :class:`~agentrl.envs.sandbox.base.SandboxBackend` and the module note on sessions."""
        if self._closed:
            raise SandboxError("this sandbox backend is closed")
        if session is not None:
            if session not in self._sessions:
                raise SandboxError(f"unknown sandbox session {session!r}; create one with create_session()")
            return await self._run_in_session(session, code, timeout_s)
        timeout_s = min(timeout_s, self.max_timeout_s)
        body = api.RunCodeRequest(code=code, language="python", run_timeout=timeout_s, stdin=stdin)
        raw = await self._post("/run_code", body.model_dump(), timeout_s)
        if isinstance(raw, ExecResult):
            return raw
        try:
            return api.exec_result_from_run(api.RunCodeResponse.model_validate(raw))
        except ValidationError as exc:
            return _error(f"unexpected /run_code answer from {self.endpoint}: {exc}")

    async def _run_in_session(self, session: str, code: str, timeout_s: float) -> ExecResult:
        history = self._sessions[session]
        cell_timeout = min(timeout_s, self.max_timeout_s)
        total = min(timeout_s * (len(history) + 1), self.max_timeout_s)
        body = api.RunJupyterRequest(cells=[*history, code], cell_timeout=cell_timeout, total_timeout=total)
        raw = await self._post("/run_jupyter", body.model_dump(), body.total_timeout)
        if isinstance(raw, ExecResult):
            return raw
        try:
            resp = api.RunJupyterResponse.model_validate(raw)
        except ValidationError as exc:
            return _error(f"unexpected /run_jupyter answer from {self.endpoint}: {exc}")
        if resp.status == "SandboxError":
            return _error(resp.message or "sandbox error")
        duration = resp.driver.execution_time if resp.driver and resp.driver.execution_time else 0.0
        if len(resp.cells) < len(history) + 1:
            return ExecResult(
                "",
                "",
                None,
                "timeout",
                duration,
                message=f"the session's {len(history)} earlier cells plus this one did not finish in time",
            )
        cell = resp.cells[-1]
        display = next((d.get("text/plain") for d in cell.display if "text/plain" in d), None)
        timed_out = resp.driver is not None and resp.driver.status == "TimeLimitExceeded"
        if cell.exec_status is not None:  # our server: the sandbox's own verdict
            status: str = cell.exec_status
        elif timed_out:
            status = "timeout"
        elif cell.error:
            status = "oom" if cell.error[0].get("ename") == "MemoryError" else "error"
        else:
            status = "ok"
        if status == "ok":
            history.append(code)
        return ExecResult(
            stdout=cell.stdout,
            stderr=cell.stderr,
            exit_code=None if status == "timeout" else (0 if status == "ok" else 1),
            status=status,
            duration_s=duration,
            display=display,
            truncated=bool(cell.truncated),
        )

    async def _post(self, path: str, body: dict, timeout_s: float) -> dict | ExecResult:
        try:
            resp = await self._client.post(path, json=body, timeout=timeout_s + HTTP_SLACK_S)
        except httpx.HTTPError as exc:
            return _error(f"request to {self.endpoint}{path} failed: {type(exc).__name__}: {exc}")
        if resp.status_code != 200:
            return _error(f"{self.endpoint}{path} answered HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            return resp.json()
        except ValueError:
            return _error(f"{self.endpoint}{path} answered with invalid JSON: {resp.text[:200]!r}")

    async def create_session(self) -> str:
        """Start an emulated session (see the module note) and return its id."""
        if self._closed:
            raise SandboxError("this sandbox backend is closed")
        sid = uuid.uuid4().hex
        self._sessions[sid] = []
        return sid

    async def release_session(self, session: str) -> None:
        """Forget a session's history."""
        self._sessions.pop(session, None)

    async def aclose(self) -> None:
        """Close the HTTP client. Idempotent."""
        if not self._closed:
            self._closed = True
            self._sessions.clear()
            await self._client.aclose()

    async def __aenter__(self) -> SandboxFusionBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _error(message: str) -> ExecResult:
    return ExecResult("", "", None, "sandbox_error", 0.0, message=message)
