"""The tool contract: what a tool declares (name, description, JSON-schema parameters) and how it is called.

A tool is either stateless (:class:`Tool`) or stateful (:class:`StatefulTool`, which gets a per-episode
session from ``create_session`` and gives it back in ``release_session``). ``call`` returns the text the
model sees, or a :class:`ToolOutput` when the tool wants to flag the result as an error of a given kind.
A tool signals a failure the model should read by raising :class:`ToolError`; any other exception is
caught by the dispatcher and reported as ``tool_exception``. Nothing a tool does reaches the trainer as an
exception.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from agentrl.harmony.trajectory import ERROR_KINDS  # the taxonomy of ToolRecord.error and step infos
from agentrl.harmony.types import ToolSpec

__all__ = ["ERROR_KINDS", "StatefulTool", "Tool", "ToolError", "ToolOutput"]


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


class Tool(ABC):
    """A stateless tool.

    Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of type ``object``) and
    implement :meth:`call`. ``namespace`` is ``"functions"`` for function tools (Harmony recipient
    ``functions.<name>``); the built-in code tool uses ``"python"``. ``timeout_s`` overrides the env's
    per-call timeout for this tool. Arguments are validated against ``parameters`` before ``call``.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    namespace: str = "functions"
    timeout_s: float | None = None
    stateful: bool = False

    def spec(self) -> ToolSpec:
        """What the model is told about this tool (rendered into the Harmony developer message)."""
        return ToolSpec(self.name, self.description, self.parameters, self.namespace)

    @abstractmethod
    async def call(self, arguments: dict[str, Any], session: Any = None) -> str | ToolOutput:
        """Run the tool on validated ``arguments`` and return the text for the model."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Free resources the tool owns (clients, backends). Idempotent. Default: nothing to free."""


class StatefulTool(Tool):
    """A tool with per-episode state (a code kernel, a browser, a shopping cart).

    The env calls :meth:`create_session` lazily before the first call in an episode, passes the session to
    every :meth:`call` of that episode, and calls :meth:`release_session` when the episode ends (reset,
    termination, truncation or close).
    """

    stateful = True

    @abstractmethod
    async def create_session(self) -> Any:
        """Create and return this episode's session object."""

    @abstractmethod
    async def release_session(self, session: Any) -> None:
        """Free the session. Must not raise for an already released session."""
