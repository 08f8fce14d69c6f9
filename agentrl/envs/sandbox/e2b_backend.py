"""E2B backend: runs code in an E2B cloud sandbox through ``e2b-code-interpreter`` (extra ``e2b``).

One E2B sandbox (a cloud VM with a Jupyter server) is created on first use and shared by all runs of this
backend. Each stateful session is its own Jupyter context (kernel); a stateless run gets a fresh context that
is removed afterwards, so interpreter state never leaks between stateless runs (the VM's filesystem is shared).
Needs ``E2B_API_KEY`` (or ``api_key=``) and network access.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from agentrl.envs.sandbox.base import ExecResult, SandboxError, SandboxUnavailable


class E2BSandbox:
    """Implements :class:`~agentrl.envs.sandbox.base.SandboxBackend` on E2B.

    Args:
        api_key: E2B API key; default ``$E2B_API_KEY``.
        template: E2B template id; default the code-interpreter template.
        sandbox_timeout_s: lifetime of the cloud sandbox, seconds (E2B kills it afterwards).
        **opts: more keyword arguments for ``AsyncSandbox.create`` (e.g. ``domain``, ``request_timeout``).

    Raises:
        SandboxUnavailable: if ``e2b-code-interpreter`` is not installed or no API key is given.
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        template: str | None = None,
        sandbox_timeout_s: int = 3600,
        **opts: Any,
    ) -> None:
        try:
            from e2b_code_interpreter import AsyncSandbox
        except ImportError:
            raise SandboxUnavailable(
                "the E2B backend needs e2b-code-interpreter: pip install 'agentrl-sdk[e2b]'"
            ) from None
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise SandboxUnavailable("the E2B backend needs an API key: set E2B_API_KEY or pass api_key=...")
        self._cls = AsyncSandbox
        self._create_kwargs = {"api_key": key, "template": template, "timeout": sandbox_timeout_s, **opts}
        self._sandbox: Any = None
        self._lock = asyncio.Lock()
        self._contexts: dict[str, Any] = {}
        self._closed = False

    async def _get(self) -> Any:
        async with self._lock:
            if self._closed:
                raise SandboxError("this sandbox backend is closed")
            if self._sandbox is None:
                self._sandbox = await self._cls.create(**self._create_kwargs)
            return self._sandbox

    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float = 10.0, stdin: str = ""
    ) -> ExecResult:
        """Run ``code``; see :class:`~agentrl.envs.sandbox.base.SandboxBackend`. ``stdin`` is provided as
        ``sys.stdin`` (Jupyter kernels have no real standard input)."""
        if session is not None and session not in self._contexts:
            raise SandboxError(f"unknown sandbox session {session!r}; create one with create_session()")
        start = time.monotonic()
        try:
            sbx = await self._get()
            ctx = self._contexts[session] if session is not None else await sbx.create_code_context()
        except SandboxError:
            raise
        except Exception as exc:  # any SDK or transport failure is the sandbox's, reported as data
            return _sandbox_error(exc, start)
        try:
            if stdin:
                setup = f"import io as _io, sys as _sys\n_sys.stdin = _io.StringIO({stdin!r})\ndel _io, _sys"
                await sbx.run_code(setup, context=ctx, timeout=timeout_s)
            return await self._execute(sbx, ctx, code, timeout_s, start)
        except Exception as exc:
            return _sandbox_error(exc, start)
        finally:
            if session is None:
                try:
                    await sbx.remove_code_context(ctx)
                except Exception:
                    pass  # the context dies with the sandbox anyway

    async def _execute(self, sbx: Any, ctx: Any, code: str, timeout_s: float, start: float) -> ExecResult:
        from e2b.exceptions import TimeoutException

        try:
            execution = await sbx.run_code(code, context=ctx, timeout=timeout_s)
        except TimeoutException as exc:
            return ExecResult("", "", None, "timeout", time.monotonic() - start, message=str(exc))
        stdout = "".join(execution.logs.stdout)
        stderr = "".join(execution.logs.stderr)
        display = next((r.text for r in execution.results if r.is_main_result and r.text is not None), None)
        err = execution.error
        if err is None:
            status, exit_code = "ok", 0
        else:
            status, exit_code = ("oom" if err.name == "MemoryError" else "error"), 1
            stderr += err.traceback if isinstance(err.traceback, str) else "\n".join(err.traceback)
            if not stderr.endswith("\n"):
                stderr += "\n"
        return ExecResult(stdout, stderr, exit_code, status, time.monotonic() - start, display=display)

    async def create_session(self) -> str:
        """Create a Jupyter context in the E2B sandbox and return its id."""
        sbx = await self._get()
        ctx = await sbx.create_code_context()
        self._contexts[ctx.id] = ctx
        return ctx.id

    async def release_session(self, session: str) -> None:
        """Remove the session's Jupyter context."""
        ctx = self._contexts.pop(session, None)
        if ctx is not None and self._sandbox is not None:
            try:
                await self._sandbox.remove_code_context(ctx)
            except Exception:
                pass  # the context dies with the sandbox anyway

    async def aclose(self) -> None:
        """Kill the E2B sandbox. Idempotent."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            self._contexts.clear()
            if self._sandbox is not None:
                try:
                    await self._sandbox.kill()
                finally:
                    self._sandbox = None

    async def __aenter__(self) -> E2BSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _sandbox_error(exc: Exception, start: float) -> ExecResult:
    return ExecResult(
        "",
        "",
        None,
        "sandbox_error",
        time.monotonic() - start,
        message=f"E2B failed: {type(exc).__name__}: {exc}",
    )
