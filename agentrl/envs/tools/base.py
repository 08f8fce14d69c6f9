"""The tool contract: what a tool declares (name, description, JSON-schema parameters) and how it is called.

A tool is either stateless (:class:`Tool`) or stateful (:class:`StatefulTool`, which gets a per-episode
session from ``create_session`` and gives it back in ``release_session``). ``call`` returns the text the
model sees, or a :class:`ToolOutput` when the tool wants to flag the result as an error of a given kind.
A tool signals a failure the model should read by raising :class:`ToolError`; any other exception is
caught by the dispatcher and reported as ``tool_exception``. A failure of the tool's own backend, which is not
the model's doing (a sandbox pool that admits no session, a lost worker, an unreachable server), is raised as
:class:`ToolInfrastructureError` (kind ``tool_infrastructure``): the env then ends the episode at once, unscored,
and the trainer and evaluations retry it or leave it out. Nothing a tool does reaches the trainer as an
exception.
"""

from __future__ import annotations

import inspect
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from agentrl.envs.tools.schema import parse_docstring, schema_from_signature
from agentrl.harmony.trajectory import ERROR_KINDS  # the taxonomy of ToolRecord.error and step infos
from agentrl.harmony.types import ToolSpec

__all__ = ["ERROR_KINDS", "StatefulTool", "Tool", "ToolError", "ToolInfrastructureError", "ToolOutput"]


@dataclass
class ToolOutput:
    """A tool result with an optional error kind (one of :data:`ERROR_KINDS`, or ``None`` for success)."""

    content: str
    error: str | None = None


class ToolError(Exception):
    """Raised by a tool to report a failure the model should read, with its error kind.

    ``kind`` is one of :data:`ERROR_KINDS` (default ``tool_exception``); the message is shown to the model,
    so it must say what was wrong and what to do instead.
    """

    def __init__(self, message: str, kind: str = "tool_exception") -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r}; use one of {ERROR_KINDS}")
        super().__init__(message)
        self.kind = kind


class ToolInfrastructureError(ToolError):
    """Raised by a tool when its backend failed, not the call: the sandbox pool admits no session (full, or the
    admission wait timed out), a worker was lost, a sandbox server or cloud service does not answer. Kind
    ``tool_infrastructure``: the env ends the episode at once (``stop_reason="infrastructure"``) without scoring
    it. An error in the model's code stays an ordinary result, a call that runs too long ``tool_timeout``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "tool_infrastructure")


class Tool(ABC):
    """A stateless tool.

    Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of type ``object``) and
    implement :meth:`call`. ``namespace`` is ``"functions"`` for function tools (Harmony recipient
    ``functions.<name>``); the built-in code tool uses ``"python"``. ``timeout_s`` overrides the env's
    per-call timeout for this tool. A tool whose calls bound their own run time (``times_itself = True``, e.g. a
    code sandbox with its own execution timeout) gets no dispatcher timeout at all, so that its waits for
    capacity (a session slot, a free worker) never count as its run time. Arguments are validated against
    ``parameters`` before ``call``.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    namespace: str = "functions"
    timeout_s: float | None = None
    times_itself: bool = False
    stateful: bool = False

    def spec(self) -> ToolSpec:
        """What the model is told about this tool (rendered into the Harmony developer message)."""
        return ToolSpec(self.name, self.description, self.parameters, self.namespace)

    @abstractmethod
    async def call(self, arguments: dict[str, Any], session: Any = None) -> str | ToolOutput:
        """Run the tool on validated ``arguments`` and return the text for the model."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Free resources the tool owns (clients, backends). Idempotent. Default: nothing to free."""


def render_result(value: Any) -> str | ToolOutput:
    """A tool's return value as the model sees it: ``str`` and :class:`ToolOutput` as they are, anything
    else as JSON (``default=str`` for what JSON cannot hold)."""
    if isinstance(value, (str, ToolOutput)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


class StatefulTool(Tool):
    """A tool with per-episode state (a code kernel, a browser, a shopping cart).

    The env calls :meth:`create_session` lazily before the first call in an episode, passes the session to
    every call of that episode, and calls :meth:`release_session` when the episode ends (reset,
    termination, truncation or close). Sessions live in the env's process, so what a call changes in its
    session is there for the next call (unlike module-level state changed by a sync ``@tool``, whose calls
    run in forked processes).

    Write the tool's work as a typed method ``run(self, session, <arguments>)`` (sync or async), like a
    ``@tool`` function: its type hints and docstring give ``parameters`` (the JSON schema) and
    ``description``, the class name gives ``name`` (``ShoppingCart`` -> ``shopping_cart``), each unless the
    class sets it, and a return value that is not a ``str`` is shown as JSON. A sync ``run`` runs on the
    event loop (keep it quick, or make it ``async``). Example::

        class Cart(StatefulTool):
            async def create_session(self):
                return []

            async def release_session(self, session):
                session.clear()

            def run(self, session: list, item: str, quantity: int = 1) -> list[str]:
                '''Add an item to this episode's cart; returns the cart.

                Args:
                    item: what to add
                    quantity: how many
                '''
                session.extend([item] * quantity)
                return session

    Or override :meth:`call` (``arguments`` dict, ``session``) and set ``parameters`` by hand.
    """

    stateful = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:
            return
        doc, param_docs = parse_docstring(run.__doc__)
        if "parameters" not in cls.__dict__:
            cls.parameters = schema_from_signature(run, param_docs, skip=2)  # self, session
        if "description" not in cls.__dict__:
            cls.description = doc or parse_docstring(cls.__doc__)[0]
        if not isinstance(getattr(cls, "name", None), str):
            cls.name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls.__name__).lower()

    async def call(self, arguments: dict[str, Any], session: Any = None) -> str | ToolOutput:
        """``run(session, **arguments)``, awaited when it is a coroutine, its value rendered for the model."""
        run = getattr(self, "run", None)
        if run is None:
            raise NotImplementedError(
                f"{type(self).__name__} defines neither run(self, session, ...) nor call(self, arguments, session)"
            )
        value = run(session, **arguments)
        if inspect.isawaitable(value):
            value = await value
        return render_result(value)

    @abstractmethod
    async def create_session(self) -> Any:
        """Create and return this episode's session object."""

    @abstractmethod
    async def release_session(self, session: Any) -> None:
        """Free the session. Must not raise for an already released session."""

    async def session_capacity(self) -> int | None:
        """How many sessions of this tool can be live at once (the episodes of every env sharing its backend
        together), or None: no limit. Collectors keep their episodes in flight within it."""
        return None

    async def request_sessions(self, sessions: int) -> None:  # noqa: B027 - optional hook
        """A collector would run ``sessions`` episodes at once: a backend that sizes itself before first use may
        raise its :meth:`session_capacity` towards that many, within what backs them (e.g. the local sandbox
        pool, :meth:`~agentrl.envs.sandbox.LocalSandbox.admit`). Never lowers it; by default nothing."""
