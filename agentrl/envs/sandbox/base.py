"""The code-sandbox backend protocol: one execution result type and one async interface.

Every backend (the local isolated pool, a SandboxFusion server, E2B) implements :class:`SandboxBackend`.
A tool that runs model-written code only needs this module; it never imports a backend directly but calls
:func:`make_backend`.

Contract of an execution:

- ``code`` is Python source text. ``stdin`` is fed to the program and then closed (reading past it gives EOF).
- ``timeout_s`` is a wall-clock limit in seconds. When it passes, every process the code started is killed.
- Stateless mode (``session=None``): each run starts from a fresh interpreter state.
- Stateful mode (``session=<id from create_session()>``): like a notebook kernel, globals persist across
  runs of the same session, and the value of a trailing expression is returned in ``display``. If a run
  kills the kernel (timeout, ``os._exit``, crash), the session keeps working but starts from a fresh state;
  ``message`` then says so.
- Results are always data: a failure of the *code* is ``status="error"`` (or timeout/killed/oom); a failure
  of the *sandbox* is ``status="sandbox_error"`` with ``message`` saying what went wrong. ``run`` raises only
  on misuse (an unknown session id, a closed backend).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Allowed values of :attr:`ExecResult.status`.
STATUSES = ("ok", "error", "timeout", "killed", "oom", "sandbox_error")


class SandboxError(RuntimeError):
    """Misuse of a sandbox backend (unknown session, closed backend, bad argument)."""


class SandboxUnavailable(SandboxError):
    """The requested isolation cannot be provided on this machine; the message names the cause and the fix."""


@dataclass
class ExecResult:
    """What one execution produced.

    Attributes:
        stdout: captured standard output (UTF-8, undecodable bytes replaced), cut to the backend's cap.
        stderr: captured standard error (tracebacks land here), cut to the backend's cap.
        exit_code: the process exit code (negative: killed by that signal); ``None`` if unknown or not
            applicable (a stateful run whose kernel survived reports 0 on success, 1 on an exception).
        status: one of :data:`STATUSES`. ``"ok"``: finished without an uncaught exception and exit code 0.
            ``"error"``: uncaught exception or non-zero exit. ``"timeout"``: wall-clock limit hit.
            ``"killed"``: ended by a signal (e.g. SIGSEGV, SIGKILL from a CPU rlimit). ``"oom"``: ran out of
            the address-space limit (``MemoryError``). ``"sandbox_error"``: the sandbox itself failed.
        duration_s: wall-clock seconds of the execution as measured by the backend.
        truncated: ``True`` if stdout or stderr was cut (a marker line is appended to the cut stream).
        display: in stateful mode, ``repr()`` of the last expression's value if the code ended with an
            expression whose value is not ``None``; otherwise ``None``.
        message: a short human-readable note from the sandbox (e.g. why it timed out, that a session's state
            was reset); empty when there is nothing to say.
        files: files fetched after the run, for backends that support ``fetch_files``: path -> base64 of the
            content, or None if the file was missing or too large.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    status: str
    duration_s: float
    truncated: bool = False
    display: str | None = None
    message: str = ""
    files: dict[str, str | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True if the code ran to completion without error."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of all fields."""
        return asdict(self)

    def render(self) -> str:
        """A compact text rendering for a model observation: output, display value, and the failure reason."""
        parts: list[str] = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.display is not None:
            parts.append(self.display)
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.status != "ok":
            note = f"[status: {self.status}"
            if self.exit_code not in (None, 0, 1):
                note += f", exit code {self.exit_code}"
            note += f"{'; ' + self.message if self.message else ''}]"
            parts.append(note)
        return "\n".join(parts) if parts else "[no output]"


@runtime_checkable
class SandboxBackend(Protocol):
    """An async code-execution backend. All methods are coroutine functions; instances are async context
    managers (``async with make_backend() as sb: ...``)."""

    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float = 10.0, stdin: str = ""
    ) -> ExecResult:
        """Run ``code`` (stateless if ``session`` is None, else inside that session) and return the result."""
        ...

    async def create_session(self) -> str:
        """Start a stateful, notebook-like session and return its id."""
        ...

    async def release_session(self, session: str) -> None:
        """End a session and free its resources. Releasing an unknown or released id is a no-op."""
        ...

    async def aclose(self) -> None:
        """Release every resource (workers, sessions, connections). Idempotent."""
        ...

    async def __aenter__(self) -> SandboxBackend: ...

    async def __aexit__(self, *exc: object) -> None: ...


def make_backend(name: str = "local", **kwargs: Any) -> SandboxBackend:
    """Build a sandbox backend by name.

    Args:
        name: ``"local"`` (isolated worker pool on this Linux machine; needs bubblewrap),
            ``"sandboxfusion"`` (HTTP client of a SandboxFusion-compatible server, e.g. ``agentrl serve
            sandbox``; kwargs ``endpoint``, ``token``), ``"e2b"`` (E2B cloud sandboxes; needs the ``e2b``
            extra and ``E2B_API_KEY``), or ``"unsafe_local"`` (the local pool WITHOUT isolation; only for
            trusted code, warns loudly).
        **kwargs: passed to the backend's constructor (see each backend's docstring).

    Raises:
        SandboxError: for an unknown name.
        SandboxUnavailable: if the backend cannot run here (the message says why and how to fix it).
    """
    if name == "local":
        from agentrl.envs.sandbox.local import LocalSandbox

        return LocalSandbox(**kwargs)
    if name == "unsafe_local":
        from agentrl.envs.sandbox.local import LocalSandbox

        return LocalSandbox(isolation="none", **kwargs)
    if name == "sandboxfusion":
        from agentrl.envs.sandbox.fusion import SandboxFusionBackend

        return SandboxFusionBackend(**kwargs)
    if name == "e2b":
        from agentrl.envs.sandbox.e2b_backend import E2BSandbox

        return E2BSandbox(**kwargs)
    raise SandboxError(
        f"unknown sandbox backend {name!r}; choose one of 'local', 'sandboxfusion', 'e2b', 'unsafe_local'"
    )


class SyncSandbox:
    """A blocking wrapper around a backend for scripts and notebooks (not for use inside a running event loop).

    It owns a private event loop and runs every call on it, so the backend's workers and connections persist
    between calls.
    """

    def __init__(self, name: str = "local", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._backend: SandboxBackend | None = self._loop.run_until_complete(_build(name, kwargs))

    def run(
        self, code: str, *, session: str | None = None, timeout_s: float = 10.0, stdin: str = "", **extra: Any
    ) -> ExecResult:
        """Blocking :meth:`SandboxBackend.run`; ``extra`` goes to backends that take more (e.g. ``files``)."""
        coro = self._backend.run(code, session=session, timeout_s=timeout_s, stdin=stdin, **extra)
        return self._loop.run_until_complete(coro)

    def create_session(self) -> str:
        """Blocking :meth:`SandboxBackend.create_session`."""
        return self._loop.run_until_complete(self._backend.create_session())

    def release_session(self, session: str) -> None:
        """Blocking :meth:`SandboxBackend.release_session`."""
        self._loop.run_until_complete(self._backend.release_session(session))

    def close(self) -> None:
        """Close the backend and the private event loop. Idempotent."""
        if self._backend is not None:
            self._loop.run_until_complete(self._backend.aclose())
            self._backend = None
            self._loop.close()

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _build(name: str, kwargs: dict[str, Any]) -> SandboxBackend:
    # Built inside the loop so that backends may create loop-bound objects in __init__.
    return make_backend(name, **kwargs)
