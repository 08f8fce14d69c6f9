"""The code-sandbox backend protocol: one execution result type and one async interface.

Every backend (the local isolated pool, a SandboxFusion server, E2B) implements :class:`SandboxBackend`.
A tool that runs model-written code only needs this module; it never imports a backend directly but calls
:func:`make_backend`, which finds backends in a registry (:func:`register_backend`, or the entry-point group
``agentrl.sandbox_backends`` for backends in other packages). This module imports none of its implementations.

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
import importlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

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
        error: for an uncaught exception, ``{"ename": <type name>, "evalue": <str of it>}`` if the backend
            records it (the local pool does); otherwise None.
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
    error: dict[str, str] | None = None

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


@dataclass(frozen=True)
class ExecutionLimits:
    """The limits of one execution that both the local pool and ``agentrl serve sandbox`` take, declared once:
    ``memory_mb`` (MiB), ``max_processes`` (processes and threads), ``output_limit_bytes`` (bytes kept per
    stream). :data:`LIMITS` holds their defaults."""

    memory_mb: int = 1024
    max_processes: int = 64
    output_limit_bytes: int = 64 * 1024


#: the default limits of one execution (the pool's and the server's)
LIMITS = ExecutionLimits()


@dataclass(frozen=True)
class SandboxMessages:
    """The notes a backend writes into :attr:`ExecResult.message`, which reach the model's observation.

    Each field is a ``str.format`` template; the fields it may use are named below. Set one to ``""`` to say
    nothing. Internal failures of the sandbox are always logged in full on the host; the model sees only
    :attr:`internal` unless :attr:`show_internal_details` is set.
    """

    timeout: str = "wall-clock limit of {timeout_s:g} s exceeded; all of the code's processes were killed"
    """The run hit its wall-clock limit. Fields: ``timeout_s``."""
    cpu_limit: str = "CPU-time limit exceeded"
    """The run hit its CPU-time limit (SIGXCPU). No fields."""
    signal: str = "killed by signal {signal}"
    """The code's process died from a signal. Fields: ``signal`` (e.g. ``SIGSEGV``)."""
    memory: str = "memory limit of {memory_mb} MiB exceeded (processes, shared memory and files together)"
    """The run's memory cgroup ran out and the OOM killer ended a process. Fields: ``memory_mb``."""
    worker_memory: str = (
        "out of memory at {limit_mb} MiB: the sandbox's other executions held the rest of its {worker_mb} MiB "
        "(this run's own limit is {memory_mb} MiB)"
    )
    """The OOM killer ended a process because the sandbox worker as a whole ran out of memory, not because the
    run exceeded its own limit. Fields: ``limit_mb`` (what the run could use), ``memory_mb`` (its own limit),
    ``worker_mb`` (the worker's capacity)."""
    evicted: str = (
        "the session's earlier state was lost: it held {held_mb} MiB, more than its guaranteed {reserved_mb} MiB, "
        "when another execution in its sandbox needed the memory"
    )
    """An idle session was ended to give its memory to another execution; said on its next run. Fields:
    ``held_mb``, ``reserved_mb``."""
    corrupted: str = "the code corrupted the sandbox's result channel; its processes were killed"
    """The code wrote garbage or a forged frame on the channel that carries its result. No fields."""
    kernel_reset: str = "the session's kernel exited; its state was lost and the next run starts fresh"
    """A session's kernel ended during this run (timeout, ``os._exit``, crash). No fields."""
    state_lost: str = (
        "the sandbox worker holding this session was restarted, so the session's earlier state was lost"
    )
    """The sandbox holding a session was replaced since the session's last run. No fields."""
    internal: str = "the sandbox failed internally, so the code may not have run; try again"
    """The sandbox itself failed (a worker died, hung or could not start). No fields."""
    show_internal_details: bool = False
    """Append the internal cause (worker ids, exceptions) to :attr:`internal`: useful when debugging, but it
    shows the model details of the host."""

    def render(self, kind: str, **fields: Any) -> str:
        """The text for event ``kind`` (a field name above) with ``fields``; for ``internal``, ``detail`` is
        appended only if :attr:`show_internal_details`."""
        detail = fields.pop("detail", "")
        text = getattr(self, kind).format(**fields)
        if kind == "internal" and detail and self.show_internal_details:
            text = f"{text} ({detail})" if text else detail
        return text


#: name -> a factory, or "module:attribute" naming one (imported on first use).
_REGISTRY: dict[str, Callable[..., SandboxBackend] | str] = {}
ENTRY_POINT_GROUP = "agentrl.sandbox_backends"


def register_backend(name: str, factory: Callable[..., SandboxBackend] | str) -> None:
    """Make ``make_backend(name, **kwargs)`` call ``factory(**kwargs)``.

    ``factory`` is a callable returning a :class:`SandboxBackend`, or ``"package.module:attribute"`` naming one,
    imported only when the backend is first built (so registering costs no import). Registering a name again
    replaces it. Packages can also register through the entry-point group ``agentrl.sandbox_backends``.
    """
    _REGISTRY[name] = factory


def registered_backends() -> list[str]:
    """Names :func:`make_backend` accepts: registered ones and those of installed entry points."""
    names = set(_REGISTRY)
    names.update(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def _factory(name: str) -> Callable[..., SandboxBackend] | None:
    found: Callable[..., SandboxBackend] | str | None = _REGISTRY.get(name)
    if found is None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                found = ep.load()
                break
    if isinstance(found, str):
        module, _, attr = found.partition(":")
        found = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = found
    return found


def make_backend(name: str = "local", **kwargs: Any) -> SandboxBackend:
    """Build a sandbox backend by name.

    Args:
        name: a registered backend. Built in: ``"local"`` (isolated worker pool on this Linux machine; needs
            bubblewrap), ``"sandboxfusion"`` (HTTP client of a SandboxFusion-compatible server, e.g. ``agentrl
            serve sandbox``; kwargs ``endpoint``, ``token``), ``"e2b"`` (E2B cloud sandboxes; needs the ``e2b``
            extra and ``E2B_API_KEY``), or ``"unsafe_local"`` (the local pool WITHOUT isolation; only for
            trusted code, warns loudly). More with :func:`register_backend` or entry points.
        **kwargs: passed to the backend's factory (see each backend's docstring).

    Raises:
        SandboxError: for an unknown name.
        SandboxUnavailable: if the backend cannot run here (the message says why and how to fix it).
    """
    factory = _factory(name)
    if factory is None:
        choices = ", ".join(repr(n) for n in registered_backends())
        raise SandboxError(f"unknown sandbox backend {name!r}; choose one of {choices}")
    return factory(**kwargs)


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
