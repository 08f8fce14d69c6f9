"""``Agent``: answer one user request with an env's tools and a served chat model.

The env is the same :class:`~agentrl.envs.AgentEnv` used in training: its tools, instructions, argument
validation, sessions (e.g. one sandbox kernel per request), limits and error taxonomy all apply unchanged.
The model is any OpenAI-compatible chat-completions endpoint with tool calling (vLLM, SGLang,
``agentrl serve model``, hosted APIs). Each model reply is rendered into the env's format and stepped
through the env by the shared episode runner (:func:`agentrl.episodes.run_episode` with a
:class:`~agentrl.runtime.ChatPolicy`), so the returned trajectory is the env's own record.

Usage::

    agent = Agent(agentrl.make("retool"), base_url="http://127.0.0.1:8000/v1")
    result = await agent.run("What is 2**100 mod 7?", on_text=lambda s: print(s, end=""))
    print(result.answer, result.stop_reason, len(result.tool_calls))

One ``Agent`` runs one request at a time (it owns one env episode); make one per concurrent request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import AsyncClosing
from agentrl.engines.client import ChatClient
from agentrl.episodes import STOP_REASONS as EPISODE_STOP_REASONS
from agentrl.episodes import EpisodeLimits, Step, run_episode
from agentrl.harmony.trajectory import ToolRecord, Trajectory
from agentrl.runtime.chat_policy import ChatPolicy

#: Why a run stopped (the episode runner's reasons; an Agent run raises instead of ending in ``error``).
STOP_REASONS = tuple(r for r in EPISODE_STOP_REASONS if r != "error")


@dataclass
class AgentResult:
    """The outcome of one request.

    - ``answer``: the final answer text, or ``None`` if the run stopped before one.
    - ``stop_reason``: one of :data:`STOP_REASONS`.
    - ``messages``: the OpenAI-shaped transcript (system, user, assistant with tool calls, tool results).
    - ``tool_calls``: every tool invocation (name, arguments, result, latency, error kind).
    - ``trajectory``: the env's record of the episode, in the env's format (tokens rendered from the
      replies, so log-probs are 0; ``trajectory.api == "chat"``).
    - ``reward``: the env's reward when the run was scored (:meth:`Agent.run_task`), else ``None`` (also when a
      time limit or a tool backend's failure, ``stop_reason="infrastructure"``, ended it).
    - ``usage``: summed ``prompt_tokens`` / ``completion_tokens`` reported by the endpoint;
      ``requests``: chat requests made; ``latency_s``: wall time of the run.
    """

    answer: str | None
    stop_reason: str
    messages: list[dict[str, Any]]
    tool_calls: list[ToolRecord]
    trajectory: Trajectory | None
    reward: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    latency_s: float = 0.0


@dataclass
class TextDelta:
    """A piece of assistant text as it streams in."""

    text: str


@dataclass
class ToolEvent:
    """A tool call that finished (its record has the result and error kind)."""

    record: ToolRecord


@dataclass
class Done:
    """The run is over."""

    result: AgentResult


AgentEvent = TextDelta | ToolEvent | Done


def _no_reward(ctx: Any) -> tuple[float, dict[str, float]]:
    return 0.0, {}


class Agent(AsyncClosing):
    """Runs an env's tools against a served chat model for one request at a time.

    Args:
        env: the env whose tools, instructions and limits to use (its format must be able to render
            completions, e.g. the default :class:`~agentrl.harmony.HarmonyFormat`).
        client: a :class:`~agentrl.engines.client.ChatClient`; or pass ``base_url``, ``api_key``,
            ``model`` (or the ``OPENAI_*`` environment variables) to build one.
        max_tool_calls, max_turns: limits for one request (override the env's limits when given).
        time_limit_s: wall-clock limit of one request; when hit, the run stops with ``time_limit``.
            ``None``: no limit.
        sampling: chat-completions parameters (``temperature``, ``max_tokens``, ...).
    """

    def __init__(
        self,
        env: Any,
        client: ChatClient | None = None,
        *,
        max_tool_calls: int | None = None,
        max_turns: int | None = None,
        time_limit_s: float | None = 120.0,
        sampling: dict[str, Any] | None = None,
        **client_kwargs: Any,
    ):
        if not hasattr(env.format, "render_completion"):
            raise TypeError(
                f"Agent needs an env format that renders completions; {type(env.format).__name__} does not "
                "(use the default HarmonyFormat)"
            )
        self.env = env
        self.client = client if client is not None else ChatClient(**client_kwargs)
        self._owns_client = client is None
        self.limits = EpisodeLimits(time_s=time_limit_s, max_turns=max_turns, max_tool_calls=max_tool_calls)
        self.sampling = dict(sampling or {})
        self._lock = asyncio.Lock()

    async def aclose(self) -> None:
        """Close the env (releasing tool sessions) and the client if the Agent built it."""
        await self.env.aclose()
        if self._owns_client:
            await self.client.aclose()

    # ------------------------------------------------------------------ public API
    async def run(self, request: str, *, on_text: Callable[[str], Any] | None = None) -> AgentResult:
        """Answer ``request`` (unscored: a product request has no reference answer). ``on_text`` is called
        with each piece of assistant text as it streams in."""
        return await self._guarded({"id": "request", "prompt": request}, on_text, None, score=False)

    async def run_task(
        self, task: dict[str, Any], *, on_text: Callable[[str], Any] | None = None
    ) -> AgentResult:
        """Run one env task (with ``prompt`` and, e.g., ``answer``) and score it with the env's reward."""
        return await self._guarded(task, on_text, None, score=True)

    async def stream(self, request: str) -> AsyncIterator[AgentEvent]:
        """Answer ``request``, yielding :class:`TextDelta` and :class:`ToolEvent` as they happen and
        :class:`Done` last. Exceptions of the run are raised here."""
        queue: asyncio.Queue[AgentEvent] = asyncio.Queue()
        job = asyncio.create_task(
            self._guarded(
                {"id": "request", "prompt": request},
                lambda s: queue.put_nowait(TextDelta(s)),
                queue.put_nowait,
                score=False,
            )
        )
        while True:
            getter = asyncio.create_task(queue.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield Done(job.result())
            return

    # ------------------------------------------------------------------ internals
    async def _guarded(
        self,
        task: dict[str, Any],
        on_text: Callable[[str], Any] | None,
        on_event: Callable[[AgentEvent], Any] | None,
        *,
        score: bool,
    ) -> AgentResult:
        async with self._lock:
            policy = ChatPolicy(self.client, self.sampling, on_text=on_text)
            tool_calls: list[ToolRecord] = []

            def on_step(step: Step) -> None:
                tool_calls.extend(step.turn.tools)
                if on_event is not None:
                    for record in step.turn.tools:
                        on_event(ToolEvent(record))

            if not score:
                self.env.reward = _no_reward  # instance attribute: shadows the env's reward for this run
            try:
                result = await run_episode(self.env, policy, task=task, limits=self.limits, on_step=on_step)
            finally:
                if not score:
                    del self.env.reward
            policy.sync(result.steps)
            traj = result.trajectory
            traj.latency_s = result.wall_s
            answer = traj.final_answer
            return AgentResult(
                answer=answer if result.stop_reason == "answer" else None,
                stop_reason=result.stop_reason,
                messages=policy.messages,
                tool_calls=tool_calls,
                trajectory=traj,
                reward=traj.reward if score and result.stop_reason not in ("time_limit", "infrastructure") else None,
                usage=dict(policy.usage),
                requests=policy.requests,
                latency_s=result.wall_s,
            )
