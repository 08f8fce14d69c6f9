"""``@tool``: turn a typed Python function (sync or async) into a :class:`~agentrl.envs.tools.base.Tool`.

The JSON schema comes from the type hints (via pydantic, so ``Literal``, ``Optional``, ``list[int]``,
``TypedDict`` and pydantic models all work) and the docstring (first paragraph = description; a Google-style
``Args:`` section = parameter descriptions); see :mod:`agentrl.envs.tools.schema`. Parameters without a
default are required.

A sync ``@tool`` runs in a child process forked for each call (``run_in="process"``, the default), so a
module-level variable it changes keeps its old value in the caller: state that must persist between calls of
an episode belongs in a :class:`~agentrl.envs.tools.base.StatefulTool` session (or use ``run_in="thread"``, or
make the function ``async``).

Example::

    @tool
    def add(a: int, b: int = 0) -> int:
        \"\"\"Add two integers.

        Args:
            a: first addend
            b: second addend
        \"\"\"
        return a + b
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from agentrl.envs.tools.base import Tool, ToolOutput, render_result
from agentrl.envs.tools.schema import parse_docstring, schema_from_signature
from agentrl.envs.tools.worker_process import run_forked

#: Where a sync function runs: see :class:`FunctionTool`.
RUN_IN = ("process", "thread", "inline")


class FunctionTool(Tool):
    """A tool backed by a plain function. Non-string return values are rendered as JSON.

    Async functions run on the event loop; a timeout cancels them. Sync functions run according to ``run_in``:

    - ``"process"`` (default): in a child process forked for the call (see
      :mod:`~agentrl.envs.tools.worker_process`), so that a call that overruns its timeout is really stopped
      (the child is killed) and a stuck call never delays interpreter exit. The child sees the caller's state as
      it is at the call, but what it changes in memory is not seen by the caller; results must be picklable.
    - ``"thread"``: in a daemon thread of this process (it sees and may change the caller's state). A thread
      cannot be stopped: after a timeout it runs on, which the timeout's error message says; it never delays
      interpreter exit.
    - ``"inline"`` (or ``inline=True``): directly on the event loop, blocking it; no timeout can fire.

    Args:
        fn: the function; its type hints and docstring give the JSON schema and description.
        name, description: override the function's name and docstring summary.
        timeout_s: per-call limit (overrides the env's).
        inline: shorthand for ``run_in="inline"``.
        run_in: see above (sync functions only).
        max_workers: calls of this tool running at once at most (``"process"``/``"thread"``); more wait.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        inline: bool = False,
        run_in: str = "process",
        max_workers: int | None = None,
    ) -> None:
        if run_in not in RUN_IN:
            raise ValueError(f"run_in must be one of {RUN_IN}, not {run_in!r}")
        doc_desc, param_docs = parse_docstring(fn.__doc__)
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else doc_desc
        self.parameters = schema_from_signature(fn, param_docs)
        self.timeout_s = timeout_s
        self._is_async = inspect.iscoroutinefunction(fn)
        self.run_in = "inline" if inline else run_in
        self.inline = self.run_in == "inline"
        self.max_workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._running = 0

    @property
    def stops_on_timeout(self) -> bool:
        """Whether a call cut off by a timeout really stops (False for sync functions in a thread)."""
        return self._is_async or self.run_in == "process"

    async def call(self, arguments: dict[str, Any], session: Any = None) -> str | ToolOutput:
        if self._is_async:
            value = await self.fn(**arguments)
        elif self.run_in == "inline":
            value = self.fn(**arguments)
        else:
            while self._running >= self.max_workers:
                await asyncio.sleep(0.005)
            self._running += 1
            try:
                if self.run_in == "process":
                    value = await run_forked(self.fn, arguments)
                else:
                    value = await self._in_daemon_thread(arguments)
            finally:
                self._running -= 1
        return render_result(value)

    async def _in_daemon_thread(self, arguments: dict[str, Any]) -> Any:
        """Run in a daemon thread (``asyncio.to_thread``'s executor threads would hold up interpreter exit)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work() -> None:
            try:
                outcome = (True, self.fn(**arguments))
            except BaseException as exc:  # handed to the caller
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(outcome))

        threading.Thread(target=work, daemon=True, name=f"agentrl-tool-{self.name}").start()
        ok, value = await done
        if not ok:
            raise value
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly (handy in tests and scripts)."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


def tool(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., timeout_s=..., run_in=...)`` -> :class:`FunctionTool` (``options``
    are its keyword arguments: ``name``, ``description``, ``timeout_s``, ``inline``, ``run_in``, ``max_workers``)."""

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(f, **options)

    return wrap(fn) if fn is not None else wrap
