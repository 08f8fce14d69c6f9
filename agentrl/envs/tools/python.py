"""The stateful ``python`` code-interpreter tool over a :class:`~agentrl.envs.sandbox.SandboxBackend`.

Each episode gets its own notebook-like session (globals persist between calls, the value of a trailing
expression is shown). In Harmony it is the built-in ``python`` tool (recipient ``python``, free-text code);
with chat templates it is a function ``python(code: str)``.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from agentrl.envs.sandbox.base import SandboxBackend, make_backend
from agentrl.envs.tools.base import StatefulTool, ToolInfrastructureError, ToolOutput

#: event loop -> {backend spec -> [backend, number of tools using it]}; entries vanish with their loop.
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, list[Any]]] = (
    weakref.WeakKeyDictionary()
)

DESCRIPTION = (
    "Execute Python code in a stateful Jupyter-like session: variables persist between calls, printed output "
    "and the value of the last expression are returned. No internet access."
)


class PythonTool(StatefulTool):
    """Runs model-written code in a sandbox session, one session per episode.

    Args:
        sandbox: a backend instance (shared across envs; this tool does not close it) or a backend name for
            :func:`~agentrl.envs.sandbox.make_backend` (created on first use and shared with the other tools on
            the same event loop; see :meth:`backend`).
        exec_timeout_s: wall-clock limit of one run inside the sandbox, counted from the moment the run starts:
            the sandbox enforces it and reports the timeout itself. The tool ``times_itself``: the dispatcher adds
            no timeout of its own, so waiting for a session slot or a free worker never counts as run time (the
            backend bounds those waits, e.g. the local pool's ``session_wait_s``).
        backend_kwargs: passed to ``make_backend`` when ``sandbox`` is a name.

    Results: the run's rendered output (stdout, display value, stderr, and a status note on failure). A run
    that times out is recorded as ``tool_timeout``; an exception in the code is an ordinary result the model
    reads (recorded without an error kind). A failure of the sandbox itself raises
    :class:`~agentrl.envs.tools.base.ToolInfrastructureError` (kind ``tool_infrastructure``; the episode ends
    unscored): the backend could not be built or started, a session could not be created (the pool admits
    no more, or its admission wait timed out), a run came back with status ``sandbox_error`` (a worker died,
    hung or failed before the code ran; a server did not answer or answered garbage; E2B failed), or ``run``
    raised (the backend was closed or lost the session). None of these depends on the model's code: the
    sandbox contract reports everything the code does as a status other than ``sandbox_error``.
    """

    name = "python"
    namespace = "python"
    times_itself = True
    description = DESCRIPTION
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
    }

    def __init__(
        self, sandbox: SandboxBackend | str = "local", *, exec_timeout_s: float = 10.0, **backend_kwargs: Any
    ):
        self._backend: SandboxBackend | None = None if isinstance(sandbox, str) else sandbox
        self._backend_name = sandbox if isinstance(sandbox, str) else None
        self._backend_kwargs = backend_kwargs
        self._shared_key: tuple[asyncio.AbstractEventLoop, str] | None = None
        self.exec_timeout_s = exec_timeout_s

    async def backend(self) -> SandboxBackend:
        """The sandbox backend. A backend given by name is shared by every PythonTool on the running event loop
        that names the same backend and kwargs (so many envs use one worker pool); it is created on first use
        and closed when the last tool using it closes."""
        if self._backend is None:
            loop = asyncio.get_running_loop()
            spec = f"{self._backend_name}:{sorted(self._backend_kwargs.items())!r}"
            per_loop = _SHARED.setdefault(loop, {})
            if spec not in per_loop:  # no await between the check and the insert: no race within a loop
                per_loop[spec] = [make_backend(self._backend_name or "local", **self._backend_kwargs), 0]
            per_loop[spec][1] += 1
            self._backend, self._shared_key = per_loop[spec][0], (loop, spec)
        return self._backend

    async def create_session(self) -> str:
        try:
            return await (await self.backend()).create_session()
        except Exception as exc:  # noqa: BLE001 - nothing of the model's is involved: the sandbox failed
            raise ToolInfrastructureError(
                f"the code sandbox could not start a session: {type(exc).__name__}: {exc}"
            ) from exc

    async def release_session(self, session: Any) -> None:
        if self._backend is not None:
            await self._backend.release_session(session)

    async def session_capacity(self) -> int | None:
        """The backend's ``max_sessions`` (live sessions it admits at once), if it has one."""
        return getattr(await self.backend(), "max_sessions", None)

    async def request_sessions(self, sessions: int) -> None:
        """Ask the backend to admit ``sessions`` live sessions (its ``admit``, if it has one: the local pool, before
        it starts, within what its memory backs)."""
        admit = getattr(await self.backend(), "admit", None)
        if admit is not None:
            admit(sessions)

    async def call(self, arguments: dict[str, Any], session: Any = None) -> ToolOutput:
        try:
            backend = await self.backend()
            result = await backend.run(arguments["code"], session=session, timeout_s=self.exec_timeout_s)
        except Exception as exc:  # noqa: BLE001 - run raises only for a closed backend or a lost session
            raise ToolInfrastructureError(f"the code sandbox failed: {type(exc).__name__}: {exc}") from exc
        if result.status == "sandbox_error":
            raise ToolInfrastructureError(f"the code sandbox failed: {result.message or 'unknown error'}")
        return ToolOutput(result.render(), "tool_timeout" if result.status == "timeout" else None)

    async def aclose(self) -> None:
        if self._shared_key is None:
            return  # a backend passed in is the caller's to close
        (loop, spec), self._shared_key = self._shared_key, None
        backend, self._backend = self._backend, None
        entry = _SHARED.get(loop, {}).get(spec)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _SHARED[loop][spec]
                await backend.aclose()
