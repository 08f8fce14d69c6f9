"""``agentrl serve sandbox``: a SandboxFusion-compatible HTTP server running on the local isolated pool.

Endpoints (same request and response fields as SandboxFusion, see :mod:`.fusion_api`):

- ``GET /v1/ping`` -> ``"pong"``
- ``POST /run_code`` -> ``RunCodeResponse`` (Python only; other languages get ``status="SandboxError"``)
- ``POST /run_jupyter`` -> ``RunJupyterResponse`` (cells run in one fresh stateful session)

Limits: request bodies over ``max_body_bytes`` get HTTP 413; ``run_timeout`` is capped at ``max_timeout_s``;
at most ``max_concurrency`` executions run at once and at most ``max_queue`` more wait, beyond that HTTP 503.
With a token set, every request but ``/v1/ping`` needs ``Authorization: Bearer <token>`` (else HTTP 401).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hmac
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse

from agentrl.envs.sandbox import fusion_api as api
from agentrl.envs.sandbox.base import SandboxBackend, SandboxUnavailable, make_backend

log = logging.getLogger(__name__)
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"


@dataclass
class ServerSettings:
    """Limits of the HTTP layer (the pool's own limits are set on the backend)."""

    max_body_bytes: int = 1 << 20
    max_timeout_s: float = 60.0
    max_concurrency: int = 64
    max_queue: int = 1024
    token: str | None = None


class _Gate:
    """Plain ASGI middleware (cheap per request): bearer-token check (401), then a body-size limit (413) for
    bodies declared or streamed larger than ``limit`` bytes."""

    def __init__(self, app: Any, limit: int, token: str | None) -> None:
        self.app, self.limit = app, limit
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] != "/v1/ping":  # health checks need no token
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                resp = JSONResponse(
                    {"detail": "missing or wrong bearer token (send 'Authorization: Bearer <token>')"},
                    status_code=401,
                )
                return await resp(scope, receive, send)
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
            {
                "detail": f"request body exceeds {self.limit} bytes; send smaller code or raise --max-body-bytes"
            },
            status_code=413,
        )
        await resp(scope, receive, send)


def create_app(backend: SandboxBackend, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving ``backend``. The app closes the backend on shutdown."""
    settings = settings or ServerSettings()
    slots = asyncio.Semaphore(settings.max_concurrency)
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

    @asynccontextmanager
    async def execution_slot():
        nonlocal waiting
        if waiting >= settings.max_queue:
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

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=api.RunCodeResponse)
    async def run_code(req: api.RunCodeRequest) -> api.RunCodeResponse:
        if req.language not in api.PYTHON_LANGUAGES:
            return api.RunCodeResponse(
                status="SandboxError",
                message=f"language {req.language!r} is not supported here; use 'python'",
            )
        files, error = _decode_files(req.files)
        if error:
            return api.RunCodeResponse(status="SandboxError", message=error)
        timeout = _timeout(req.run_timeout, settings)
        async with execution_slot():
            result = await backend.run(
                req.code,
                timeout_s=timeout,
                stdin=req.stdin or "",
                **_local_kwargs(files, req.fetch_files, req.memory_limit_MB),
            )
        resp = api.run_code_response(result)
        resp.files = {k: v for k, v in result.files.items() if v is not None}
        return resp

    @app.post("/run_jupyter", response_model=api.RunJupyterResponse)
    async def run_jupyter(req: api.RunJupyterRequest) -> api.RunJupyterResponse:
        files, error = _decode_files(req.files)
        if error:
            return api.RunJupyterResponse(status="SandboxError", message=error)
        total = _timeout(req.total_timeout, settings)
        start = time.monotonic()
        cells: list[api.CellRunResult] = []
        timed_out = False
        fetched: dict[str, str] = {}
        async with execution_slot():
            session = await backend.create_session()
            try:
                for i, cell in enumerate(req.cells):
                    left = total - (time.monotonic() - start)
                    limit = min(left, req.cell_timeout) if req.cell_timeout > 0 else left
                    if limit <= 0:
                        timed_out = True
                        break
                    last = i == len(req.cells) - 1
                    extra = _local_kwargs(files if i == 0 else {}, req.fetch_files if last else [])
                    result = await backend.run(cell, session=session, timeout_s=limit, **extra)
                    cells.append(api.cell_result(result))
                    fetched.update({k: v for k, v in result.files.items() if v is not None})
                    if result.status == "sandbox_error":
                        return api.RunJupyterResponse(
                            status="SandboxError", message=result.message, cells=cells
                        )
                    if result.status == "timeout":
                        timed_out = True
                        break
            finally:
                await backend.release_session(session)
        driver = api.CommandRunResult(
            status="TimeLimitExceeded" if timed_out else "Finished",
            execution_time=time.monotonic() - start,
            return_code=None if timed_out else 0,
        )
        return api.RunJupyterResponse(
            status="Failed" if timed_out else "Success", message="", driver=driver, cells=cells, files=fetched
        )

    return _Gate(app, settings.max_body_bytes, settings.token)  # type: ignore[return-value]


def _timeout(requested: float, settings: ServerSettings) -> float:
    if requested <= 0:
        return settings.max_timeout_s
    return min(float(requested), settings.max_timeout_s)


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


def main(argv: list[str]) -> int:
    """Entry point of ``agentrl serve sandbox [options]``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="agentrl serve sandbox",
        description="Serve the isolated local sandbox pool over SandboxFusion's HTTP API.",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default 127.0.0.1; use 0.0.0.0 to serve a cluster)"
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--workers", type=int, default=None, help="sandboxes in the pool (default: 2 x CPU count)")
    p.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per process, MiB")
    p.add_argument("--max-processes", type=int, default=64)
    p.add_argument("--output-limit-bytes", type=int, default=64 * 1024)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-timeout", type=float, default=60.0, help="cap on run_timeout / total_timeout, seconds"
    )
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--token", default=None, help=f"require this bearer token (default: ${TOKEN_ENV} if set)")
    p.add_argument(
        "--unsafe-no-isolation",
        action="store_true",
        help="run code WITHOUT any isolation (trusted code only; never expose such a server)",
    )
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)

    import uvicorn

    logging.basicConfig(level=args.log_level.upper())
    try:
        backend = make_backend(
            "unsafe_local" if args.unsafe_no_isolation else "local",
            workers=args.workers,
            memory_mb=args.memory_mb,
            max_processes=args.max_processes,
            output_limit_bytes=args.output_limit_bytes,
        )
    except SandboxUnavailable as exc:
        print(f"error: {exc}")
        return 2
    settings = ServerSettings(
        max_body_bytes=args.max_body_bytes,
        max_timeout_s=args.max_timeout,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.token:
        log.warning(
            "serving on %s without a bearer token: anyone who reaches this port can run code", args.host
        )
    uvicorn.run(create_app(backend, settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0
