"""Dispatch parsed tool calls to tools: validation, per-episode sessions, timeouts, bounded results.

Every failure becomes a :class:`~agentrl.harmony.trajectory.ToolRecord` whose ``error`` is one of
``unknown_tool``, ``bad_arguments``, ``tool_timeout``, ``tool_exception``, ``tool_infrastructure`` and whose
``result`` is a message the model can read. ``tool_infrastructure`` is a failure of the tool's backend, not of the
call: a :class:`~agentrl.envs.tools.base.ToolInfrastructureError`, or any exception while creating the episode's
session of a stateful tool (the model gave that no input), or a session that is not ready within
:data:`SESSION_TIMEOUT_S` (session creation is outside the call's time limit). Its traceback is kept in
:attr:`Sessions.tracebacks` for the run's ``errors.log``. :meth:`ToolBox.call` never raises (except
``asyncio.CancelledError``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jsonschema

from agentrl import errorlog
from agentrl.envs.tools.base import StatefulTool, Tool, ToolError, ToolInfrastructureError, ToolOutput
from agentrl.harmony.trajectory import ToolRecord
from agentrl.harmony.types import ToolCall, ToolSpec

#: Seconds a stateful tool may take to create an episode's session (e.g. waiting for a sandbox pool to admit it),
#: at least the call's own limit. Creating the session is outside the call's time limit (a wait for the backend
#: is not the model's call running long); past this, the backend failed (``tool_infrastructure``). It is longer
#: than the local sandbox pool's default admission wait (``session_wait_s=600``), so the pool's own error, which
#: names its fix, comes first.
SESSION_TIMEOUT_S = 900.0


def truncate_text(text: str, max_chars: int) -> str:
    """Cut ``text`` to ``max_chars`` characters plus a marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... truncated {len(text) - max_chars} characters]"


class Sessions:
    """The per-episode sessions of stateful tools, created lazily on first use, and ``tracebacks``: the full
    tracebacks of the episode's ``tool_infrastructure`` failures, oldest first (for the run's ``errors.log``)."""

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[StatefulTool, Any]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.tracebacks: list[str] = []

    async def get(self, tool: StatefulTool) -> Any:
        """The episode's session of ``tool``; raises :class:`ToolInfrastructureError` when it cannot be created."""
        if tool.name in self._sessions:
            return self._sessions[tool.name][1]
        lock = self._locks.setdefault(tool.name, asyncio.Lock())
        async with lock:
            if tool.name not in self._sessions:
                try:
                    session = await tool.create_session()
                except ToolInfrastructureError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the model gave this no input: the backend failed
                    raise ToolInfrastructureError(
                        f"{tool.name} could not start its session: {type(exc).__name__}: {exc}"
                    ) from exc
                self._sessions[tool.name] = (tool, session)
        return self._sessions[tool.name][1]

    async def release_all(self) -> None:
        """Release every session (errors while releasing are swallowed: the episode is over)."""
        items, self._sessions, self._locks = list(self._sessions.values()), {}, {}
        for tool, session in items:
            try:
                await tool.release_session(session)
            except Exception:  # noqa: BLE001 - releasing must not fail an episode
                pass


class ToolBox:
    """The tools of one env, indexed by name, with the dispatch policy.

    Args:
        tools: the tools (names must be unique).
        timeout_s: default per-call wall-clock limit (a tool's own ``timeout_s`` overrides it).
        max_result_chars: results longer than this are cut with a ``[... truncated N characters]`` marker.
    """

    def __init__(
        self, tools: Iterable[Tool], *, timeout_s: float = 30.0, max_result_chars: int = 8000
    ) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique within an env")
            self.tools[t.name] = t
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self._by_recipient = {t.spec().recipient: t for t in self.tools.values()}
        self._validators = {
            name: jsonschema.Draft202012Validator(t.parameters) for name, t in self.tools.items()
        }

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec() for t in self.tools.values()]

    def resolve(self, call: ToolCall) -> Tool | None:
        """The tool a call addresses: by full recipient (``functions.x``, ``python``), or by name when the
        recipient is empty, the bare name, or ``functions.<name>`` (chat formats address every tool as a
        function). A recipient in another namespace (``browser.x`` for a ``functions.x`` tool) matches nothing."""
        if call.recipient in self._by_recipient:
            return self._by_recipient[call.recipient]
        t = self.tools.get(call.name)
        if t is not None and call.recipient in ("", None, t.name, f"functions.{t.name}"):
            return t
        return None

    async def call(self, call: ToolCall, sessions: Sessions) -> ToolRecord:
        """Validate and run one call; always returns a record (``error`` set on failure)."""
        start = time.perf_counter()
        name = call.name or call.recipient
        args: Any = call.arguments

        def record(result: str, error: str | None) -> ToolRecord:
            return ToolRecord(
                name=name,
                arguments=args,
                result=truncate_text(result, self.max_result_chars),
                latency_s=time.perf_counter() - start,
                error=error,
            )

        tool = self.resolve(call)
        if tool is None:
            avail = ", ".join(sorted(t.spec().recipient for t in self.tools.values())) or "none"
            return record(
                f"Error: there is no tool named {call.recipient or name!r}. Available tools: {avail}.",
                "unknown_tool",
            )
        name = tool.name
        if not isinstance(args, dict):
            try:
                args = json.loads(call.raw_arguments) if call.raw_arguments.strip() else {}
            except (json.JSONDecodeError, AttributeError):
                args = call.raw_arguments
            if not isinstance(args, dict):
                return record(
                    f"Error: the arguments of {tool.name} must be a JSON object, got {str(call.raw_arguments)[:200]!r}.",
                    "bad_arguments",
                )
        problems = sorted(self._validators[tool.name].iter_errors(args), key=lambda e: list(e.path))
        if problems:
            detail = "; ".join(_describe(e) for e in problems[:5])
            return record(f"Error: invalid arguments for {tool.name}: {detail}.", "bad_arguments")
        timeout = None if tool.times_itself else tool.timeout_s if tool.timeout_s is not None else self.timeout_s

        session = None
        if isinstance(tool, StatefulTool):  # outside the call's time limit: waiting for a session is not the call's
            limit = SESSION_TIMEOUT_S if timeout is None else max(timeout, SESSION_TIMEOUT_S)
            try:
                session = await _with_timeout(sessions.get(tool), limit)
            except (TimeoutError, asyncio.TimeoutError):
                return self._infrastructure(
                    ToolInfrastructureError(f"{tool.name} could not start its session within {limit:g} s"),
                    sessions, record,
                )
            except ToolInfrastructureError as e:
                return self._infrastructure(e, sessions, record)

        async def run() -> str | ToolOutput:
            return await tool.call(args, session)

        try:
            out = await _with_timeout(run(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            if getattr(tool, "stops_on_timeout", True):
                text = f"Error: {tool.name} did not finish within {timeout:g} s and was stopped."
            else:
                text = f"Error: {tool.name} did not finish within {timeout:g} s; its result was abandoned."
            return record(text, "tool_timeout")
        except ToolInfrastructureError as e:
            return self._infrastructure(e, sessions, record)
        except ToolError as e:
            return record(f"Error: {e}", e.kind)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - tool bugs become observations, never trainer crashes
            return record(f"Error: {tool.name} failed: {type(e).__name__}: {e}", "tool_exception")
        if isinstance(out, ToolOutput):
            return record(out.content, out.error)
        return record(str(out), None)

    @staticmethod
    def _infrastructure(exc: ToolInfrastructureError, sessions: Sessions, record: Any) -> ToolRecord:
        """The record of a backend failure; its traceback is kept in ``sessions.tracebacks``."""
        sessions.tracebacks.append(errorlog.format_exception(exc))
        return record(f"Error: {exc}", "tool_infrastructure")

    async def call_many(self, calls: Sequence[ToolCall], sessions: Sessions) -> list[ToolRecord]:
        """Run calls concurrently; results come back in call order."""
        if len(calls) == 1:
            return [await self.call(calls[0], sessions)]
        return list(await asyncio.gather(*(self.call(c, sessions) for c in calls)))

    async def aclose(self) -> None:
        for t in self.tools.values():
            try:
                await t.aclose()
            except Exception:  # noqa: BLE001 - closing is best effort and idempotent
                pass


async def _with_timeout(coro: Any, timeout: float | None) -> Any:
    """``asyncio.timeout`` where available (no extra task, so an instant tool does not yield to the loop),
    else ``asyncio.wait_for``. ``None``: no timeout."""
    if timeout is None:
        return await coro
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)


def _describe(err: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in err.absolute_path)
    return f"{where}: {err.message}" if where else err.message
