"""``agentrl serve sandbox``: a SandboxFusion-compatible HTTP server running on the local isolated pool.

Endpoints (same request and response fields as SandboxFusion, see :mod:`.fusion_api`):

- ``GET /v1/ping`` -> ``"pong"``
- ``POST /run_code`` -> ``RunCodeResponse`` (Python only; other languages get ``status="SandboxError"``)
- ``POST /run_jupyter`` -> ``RunJupyterResponse`` (cells run in one fresh stateful session)

Hostile clients (see :class:`SandboxServerConfig` for every limit): request bodies over ``max_body_bytes`` get
HTTP 413; a timeout that is NaN, infinite, not positive or above ``max_timeout_s`` gets HTTP 422 naming the field;
at most ``max_concurrency`` executions run at once and at most ``max_queue`` more wait, beyond that HTTP 503;
requests whose headers or body arrive too slowly are dropped, and each client address may hold only so many
connections (:mod:`.http_guard`). Every answer is built through strict response models, so nothing the code in
the sandbox prints or writes can change the answer's fields or their types.

With a token set, every request but ``/v1/ping`` must carry it, either as ``Authorization: Bearer <token>`` or as
the first path segment: ``http://host:port/<token>/run_code``, which the official ``sandbox-fusion`` client can
use unmodified (``endpoint="http://host:port/<token>"``). Anything else gets HTTP 401. The token never appears in
the server's logs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import math
import os
import resource
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from agentrl.cli_args import CommandSpec, key, parse, run, to_object
from agentrl.envs.sandbox import fusion_api as api
from agentrl.envs.sandbox.base import (
    LIMITS,
    SandboxBackend,
    SandboxError,
    SandboxMessages,
    SandboxUnavailable,
    make_backend,
)
from agentrl.envs.sandbox.http_guard import ConnectionLimits, guarded_protocol

log = logging.getLogger(__name__)
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class SandboxServerConfig:
    """Settings of ``agentrl serve sandbox``: the pool's limits, the HTTP layer's limits and access control."""

    host: str = key("127.0.0.1", "Address to bind; ``0.0.0.0`` serves a cluster (then set a token).")
    port: int = key(8080, "TCP port.")
    workers: int | None = key(
        None, "Sandboxes in the pool (parallel executions); default three per CPU (``local.WORKERS_PER_CORE``).")
    memory_mb: int = key(
        LIMITS.memory_mb, "Memory limit of one execution, MiB (address space per process, and everything the run holds).")
    max_processes: int = key(LIMITS.max_processes, "Processes and threads of one execution.")
    output_limit_bytes: int = key(
        LIMITS.output_limit_bytes, "Bytes of stdout and of stderr kept per execution; the rest is cut with a marker.")
    max_body_bytes: int = key(1 << 20, "Largest request body, bytes; larger ones get HTTP 413.")
    max_timeout_s: float = key(
        60.0, "Largest ``run_timeout`` / ``total_timeout`` / ``cell_timeout`` a request may ask for, seconds; "
        "above: 422.")
    max_concurrency: int = key(64, "Executions running at once.")
    max_queue: int = key(1024, "Requests waiting for an execution slot; beyond that HTTP 503.")
    token: str | None = key(
        None, "Shared secret required on every request but ``/v1/ping`` (default: $AGENTRL_SANDBOX_TOKEN if set).")
    header_timeout_s: float = key(10.0, "Seconds a client has to send a request's headers; then the connection is closed.")
    body_timeout_s: float = key(30.0, "Seconds a client has to send a request's body once its headers are in.")
    keepalive_timeout_s: float = key(5.0, "Seconds an idle kept-alive connection stays open.")
    max_connections: int = key(
        1024, "Connections open at once, all clients together. At a cap the oldest connection not being served is "
        "closed to make room, or else the new one waits unread for one to end (up to this many wait; more are "
        "refused).")
    max_connections_per_client: int = key(
        64, "Connections open at once from one client (an address; an IPv6 client is its /64, and all of loopback "
        "is one client per local user). At the cap the client's oldest connection idle between requests is closed "
        "to make room, or else the new one waits unread for one of that client's to end.")
    max_header_bytes: int = key(
        64 * 1024, "Largest request head (request line and headers), bytes; larger ones get HTTP 431.")
    min_bytes_per_s: float = key(
        256.0, "Slowest a request's headers and body may arrive after the first second, bytes per second; slower "
        "connections are closed.")
    answer_timeout_s: float = key(
        30.0, "Seconds a client may leave an answer unread once it fills the connection's buffers; then the "
        "connection is closed and the answer freed.")
    max_cells: int = key(1024, "Most cells one ``/run_jupyter`` request may carry; more get HTTP 422.")
    max_response_bytes: int = key(
        16 << 20, "Output (stdout, stderr, display values, errors) one request may produce, bytes; a ``/run_jupyter`` "
        "request that reaches it runs no further cells and says so.")
    show_internal_errors: bool = key(
        False, "Put internal details of sandbox failures in the answers (they are always logged).")
    unsafe_no_isolation: bool = key(
        False, "Run code WITHOUT any isolation (trusted code only; never expose such a server).")
    log_level: str = key("info", "Logging level: debug, info, warning, error.", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.token is None:
            self.token = os.environ.get(TOKEN_ENV) or None
        if self.token is not None and (not self.token or "/" in self.token or not self.token.isprintable()):
            raise ValueError("token must be a non-empty printable string without '/'")
        for name in (
            "max_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "keepalive_timeout_s",
            "answer_timeout_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in (
            "max_body_bytes",
            "max_concurrency",
            "max_queue",
            "max_connections",
            "max_connections_per_client",
            "max_header_bytes",
            "max_cells",
            "max_response_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


class _Gate:
    """Plain ASGI middleware (cheap per request): token check (401; path prefix or bearer header), then a body-size
    limit (413) for bodies declared or streamed larger than ``limit`` bytes, then one access-log line."""

    def __init__(self, app: Any, limit: int, token: str | None) -> None:
        self.app, self.limit = app, limit
        self.token = token.encode() if token else None
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.token is not None:
            authorized = self._authorize(scope, headers)
            if authorized is None:
                resp = JSONResponse(
                    {
                        "detail": "missing or wrong token: send 'Authorization: Bearer <token>' or use "
                        "http://host:port/<token>/... as the endpoint"
                    },
                    status_code=401,
                )
                return await resp(scope, receive, send)
            scope = authorized
        status: list[int] = []

        async def logged_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        start = time.monotonic()
        try:
            await self._limited(scope, receive, logged_send, headers)
        finally:
            client = scope.get("client") or ("?", 0)
            log.info(
                '%s - "%s %s" %s %.1f ms',
                client[0],
                scope["method"],
                scope["path"],
                status[0] if status else "-",
                (time.monotonic() - start) * 1000,
            )

    def _authorize(self, scope: dict, headers: dict) -> dict | None:
        """``scope`` with a token path prefix removed, if the request carries the token; else None."""
        path = scope["path"]
        first, sep, rest = path[1:].partition("/")
        if hmac.compare_digest(first.encode(), self.token):
            raw = scope.get("raw_path") or path.encode()
            cut = len(first.encode()) + 1
            return {**scope, "path": "/" + rest, "raw_path": raw[cut:] or b"/"}
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected) or path == "/v1/ping":
            return scope
        return None

    async def _limited(self, scope: dict, receive: Callable, send: Callable, headers: dict) -> None:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        # Read the whole body first (it is small by construction) so that a streamed body without a declared
        # length is bounded too; then hand it to the app in one message.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        resp = JSONResponse(
            {"detail": f"request body exceeds {self.limit} bytes; send smaller code or raise max_body_bytes"},
            status_code=413,
        )
        await resp(scope, receive, send)


def create_app(backend: SandboxBackend, config: SandboxServerConfig | None = None) -> FastAPI:
    """The ASGI app serving ``backend`` (FastAPI behind the token and body-size gate). The app closes the backend
    on shutdown. Serve it with :func:`uvicorn_config` to get the connection limits too."""
    config = config or SandboxServerConfig()
    slots = asyncio.Semaphore(config.max_concurrency)
    # /run_jupyter requests beyond the sessions the pool admits wait here rather than fail
    session_slots = asyncio.Semaphore(max(1, getattr(backend, "max_sessions", config.max_concurrency)))
    waiting = 0

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = getattr(backend, "start", None)
        if start is not None:
            try:
                await start()
            except SandboxUnavailable as exc:
                log.error("cannot start the sandbox pool: %s", exc)
                raise
        yield
        await backend.aclose()

    app = FastAPI(title="agentrl sandbox (SandboxFusion-compatible)", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Any, exc: RequestValidationError) -> JSONResponse:
        # Without echoing the offending input: it may be NaN, which JSON cannot carry.
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @asynccontextmanager
    async def execution_slot():
        nonlocal waiting
        if waiting >= config.max_queue:
            raise HTTPException(503, f"server busy: {waiting} requests already queued; retry later")
        waiting += 1
        try:
            await slots.acquire()
        finally:
            waiting -= 1
        try:
            yield
        finally:
            slots.release()

    def within_limit(name: str, value: float) -> float:
        if value > config.max_timeout_s:
            raise HTTPException(
                422,
                [
                    {
                        "loc": ["body", name],
                        "msg": f"{name}={value:g} exceeds this server's limit of {config.max_timeout_s:g} s; "
                        "ask for less or start the server with a higher max_timeout_s",
                        "type": "less_than_equal",
                    }
                ],
            )
        return float(value)

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=api.RunCodeResponse)
    async def run_code(req: api.RunCodeRequest) -> api.RunCodeResponse:
        timeout = within_limit("run_timeout", req.run_timeout)
        if req.language not in api.PYTHON_LANGUAGES:
            return api.RunCodeResponse(
                status="SandboxError",
                message=f"language {req.language!r} is not supported here; use 'python'",
            )
        files, error = _decode_files(req.files)
        if error:
            return api.RunCodeResponse(status="SandboxError", message=error)
        async with execution_slot():
            result = await backend.run(
                req.code,
                timeout_s=timeout,
                stdin=req.stdin or "",
                **_local_kwargs(files, req.fetch_files, req.memory_limit_MB),
            )
        return api.run_code_response(result)

    @app.post("/run_jupyter", response_model=api.RunJupyterResponse)
    async def run_jupyter(req: api.RunJupyterRequest) -> api.RunJupyterResponse:
        total = within_limit("total_timeout", req.total_timeout)
        within_limit("cell_timeout", req.cell_timeout)
        if len(req.cells) > config.max_cells:
            raise HTTPException(
                422,
                [
                    {
                        "loc": ["body", "cells"],
                        "msg": f"{len(req.cells)} cells exceed this server's limit of {config.max_cells}; send "
                        "fewer or start the server with a higher max_cells",
                        "type": "too_long",
                    }
                ],
            )
        files, error = _decode_files(req.files)
        if error:
            return api.RunJupyterResponse(status="SandboxError", message=error)
        async with execution_slot(), session_slots:
            try:
                session = await backend.create_session()
            except SandboxError as exc:
                raise HTTPException(503, f"no sandbox session available: {exc}") from None
            try:
                return await _run_cells(backend, session, req, files, total, config.max_response_bytes)
            finally:
                await backend.release_session(session)

    return _Gate(app, config.max_body_bytes, config.token)  # type: ignore[return-value]


async def _run_cells(
    backend: SandboxBackend, session: str, req: api.RunJupyterRequest, files: dict, total: float, budget: int
) -> api.RunJupyterResponse:
    """Run a ``/run_jupyter`` request's cells in ``session`` until one times out, the sandbox fails, ``total``
    seconds pass, or their output reaches ``budget`` bytes (then no further cell runs, and the answer says so)."""
    start = time.monotonic()
    cells: list[api.CellRunResult] = []
    fetched: dict[str, str] = {}
    timed_out, message, used = False, "", 0
    for i, cell in enumerate(req.cells):
        left = total - (time.monotonic() - start)
        limit = min(left, req.cell_timeout) if req.cell_timeout > 0 else left
        if limit <= 0:
            timed_out = True
            break
        if used >= budget:
            message = f"output budget of {budget} bytes reached: {len(req.cells) - i} cells were not run"
            break
        last = i == len(req.cells) - 1
        extra = _local_kwargs(files if i == 0 else {}, req.fetch_files if last else [])
        result = await backend.run(cell, session=session, timeout_s=limit, **extra)
        cells.append(api.cell_result(result))
        used += api.output_bytes(result)
        fetched.update(api.fetched_files(result))
        if result.status == "sandbox_error":
            return api.RunJupyterResponse(status="SandboxError", message=result.message, cells=cells)
        if result.status == "timeout":
            timed_out = True
            break
    driver = api.CommandRunResult(
        status="TimeLimitExceeded" if timed_out else "Finished",
        execution_time=time.monotonic() - start,
        return_code=None if timed_out else 0,
    )
    failed = timed_out or bool(message)
    return api.RunJupyterResponse(
        status="Failed" if failed else "Success", message=message, driver=driver, cells=cells, files=fetched
    )


def _decode_files(files: dict[str, str | None]) -> tuple[dict[str, bytes], str]:
    out: dict[str, bytes] = {}
    for path, b64 in files.items():
        try:
            out[path] = base64.b64decode(b64 or "", validate=True)
        except (binascii.Error, ValueError):
            return {}, f"files[{path!r}] is not valid base64"
    return out, ""


def _local_kwargs(files: dict[str, bytes], fetch: list[str], memory_mb: int = -1) -> dict[str, Any]:
    # Only the local backend takes these; pass them only when they are used.
    extra: dict[str, Any] = {}
    if memory_mb > 0:
        extra["memory_mb"] = memory_mb
    if files:
        extra["files"] = files
    if fetch:
        extra["fetch_files"] = fetch
    return extra


def uvicorn_config(
    app: Any, config: SandboxServerConfig, client_key: Callable[[str], str] | None = None
) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with ``config``'s connection limits (and no access log of uvicorn's
    own, which would show a token sent in the path). ``client_key``: which client an address counts as (default
    :func:`~agentrl.envs.sandbox.http_guard.client_key`)."""
    import uvicorn

    limits = ConnectionLimits(
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        max_connections=config.max_connections,
        max_connections_per_client=config.max_connections_per_client,
        max_header_bytes=config.max_header_bytes,
        min_bytes_per_s=config.min_bytes_per_s,
        answer_timeout_s=config.answer_timeout_s,
    )
    if client_key is not None:
        limits.key = client_key
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=guarded_protocol(limits),
        timeout_keep_alive=config.keepalive_timeout_s,
        access_log=False,
        log_level=config.log_level,
    )


def _raise_fd_limit(wanted: int) -> None:
    """Make room for ``wanted`` connections (plus the pool's own fds) under RLIMIT_NOFILE, as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + 256
    if soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            log.warning("RLIMIT_NOFILE allows only %d fds; lower max_connections below %d", new, new - 256)



SPEC = CommandSpec(
    prog="agentrl serve sandbox",
    schema=SandboxServerConfig,
    usage="agentrl serve sandbox [port=8080] [token=SECRET] [key=value ...]",
    aliases={"max_timeout": "max_timeout_s"},  # the flag's name before it carried its unit
    notes="Serves the isolated local sandbox pool over SandboxFusion's HTTP API. Options also as --key value\n"
    "(--max-timeout-s 30) and bare --flags for booleans (--unsafe-no-isolation).",
)


def parse_args(argv: list[str]) -> SandboxServerConfig:
    """``SandboxServerConfig`` from command-line words (``max_timeout_s=30`` or ``--max-timeout-s 30``), read by
    the shared parser (:mod:`agentrl.cli_args`); raises :class:`~agentrl.cli_args.UsageError`."""
    return to_object(SPEC, parse(SPEC, argv))


def main(argv: list[str]) -> int:
    """Entry point of ``agentrl serve sandbox [key=value ...]``; returns the exit code (2: a usage error)."""
    return run(SPEC, argv, lambda cfg: serve(to_object(SPEC, cfg)))


def serve(config: SandboxServerConfig) -> int:
    """Build the pool and serve it until interrupted; returns the exit code."""
    import uvicorn

    logging.basicConfig(level=config.log_level.upper())
    try:
        backend = make_backend(
            "unsafe_local" if config.unsafe_no_isolation else "local",
            workers=config.workers,
            memory_mb=config.memory_mb,
            max_processes=config.max_processes,
            output_limit_bytes=config.output_limit_bytes,
            messages=SandboxMessages(show_internal_details=config.show_internal_errors),
        )
    except SandboxUnavailable as exc:
        print(f"error: {exc}")
        return 2
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.token:
        log.warning("serving on %s without a token: anyone who reaches this port can run code", config.host)
    _raise_fd_limit(config.max_connections)
    uvicorn.Server(uvicorn_config(create_app(backend, config), config)).run()
    return 0
