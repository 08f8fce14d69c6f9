"""``Agent``: answer one user request with an env's tools and a served chat model.

The env is the same :class:`~agentrl.envs.AgentEnv` used in training: its tools, instructions, argument
validation, sessions (e.g. one sandbox kernel per request), limits and error taxonomy all apply unchanged.
The model is any OpenAI-compatible chat-completions endpoint with tool calling (vLLM, SGLang,
``agentrl serve model``, hosted APIs). Each model reply is rendered into the env's format and stepped
through the env (see :mod:`agentrl.runtime.bridge`), so the returned trajectory is the env's own record.

Usage::

    agent = Agent(agentrl.make("retool"), base_url="http://127.0.0.1:8000/v1")
    result = await agent.run("What is 2**100 mod 7?", on_text=lambda s: print(s, end=""))
    print(result.answer, result.stop_reason, len(result.tool_calls))

One ``Agent`` runs one request at a time (it owns one env episode); make one per concurrent request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.engines.openai_engine import ChatClient, ChatResult
from agentrl.harmony.trajectory import ToolRecord, Trajectory
from agentrl.runtime.bridge import observation_to_openai, prompt_to_openai, reply_to_steps, tools_to_openai

#: Why a run stopped.
STOP_REASONS = ("answer", "no_answer", "tool_limit", "turn_limit", "token_limit", "time_limit")


@dataclass
class AgentResult:
    """The outcome of one request.

    - ``answer``: the final answer text, or ``None`` if the run stopped before one.
    - ``stop_reason``: one of :data:`STOP_REASONS`.
    - ``messages``: the OpenAI-shaped transcript (system, user, assistant with tool calls, tool results).
    - ``tool_calls``: every tool invocation (name, arguments, result, latency, error kind).
    - ``trajectory``: the env's record of the episode, in the env's format (tokens rendered from the
      replies, so log-probs are 0; ``metadata["api"] == "chat"``).
    - ``reward``: the env's reward when the run was scored (:meth:`Agent.run_task`), else ``None``.
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


class Agent:
    """Runs an env's tools against a served chat model for one request at a time.

    Args:
        env: the env whose tools, instructions and limits to use (its format must be able to render
            completions, e.g. the default :class:`~agentrl.harmony.HarmonyFormat`).
        client: a :class:`~agentrl.engines.openai_engine.ChatClient`; or pass ``base_url``, ``api_key``,
            ``model`` (or the ``OPENAI_*`` environment variables) to build one.
        max_tool_calls, max_turns: limits for one request (set on the env's limits when given).
        time_limit_s: wall-clock limit of one request; when hit, the run stops with ``time_limit``.
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
        overrides = {
            k: v for k, v in (("max_tool_calls", max_tool_calls), ("max_turns", max_turns)) if v is not None
        }
        if overrides:
            env.limits = replace(env.limits, **overrides)
        self.time_limit_s = time_limit_s
        self.sampling = dict(sampling or {})
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

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

    def run_sync(self, request: str, **kwargs: Any) -> AgentResult:
        """Blocking :meth:`run` for scripts (not inside a running event loop)."""
        return asyncio.run(self.run(request, **kwargs))

    # ------------------------------------------------------------------ internals
    async def _guarded(self, task, on_text, on_event, *, score: bool) -> AgentResult:
        async with self._lock:
            state = _RunState(time.perf_counter())
            if not score:
                self.env.reward = _no_reward  # instance attribute: shadows the env's reward for this run
            try:
                run = self._episode(task, state, on_text, on_event)
                if self.time_limit_s is None:
                    await run
                else:
                    await asyncio.wait_for(run, self.time_limit_s)
            except (TimeoutError, asyncio.TimeoutError):
                state.stop_reason = "time_limit"
            finally:
                if not score:
                    del self.env.reward
            return state.result(self.env.trajectory, score)

    async def _ask(self, history, tools, on_text) -> ChatResult:
        if on_text is None:
            return await self.client.chat(history, tools, **self.sampling)
        result = None
        async for piece in self.client.stream_chat(history, tools, **self.sampling):
            if isinstance(piece, str):
                on_text(piece)
            else:
                result = piece
        assert result is not None
        return result

    async def _episode(self, task, state: _RunState, on_text, on_event) -> None:
        env = self.env
        obs, _ = await env.areset(options={"task": task})
        state.messages = prompt_to_openai(obs["messages"], env.instructions)
        specs = env.toolbox.specs
        tools = tools_to_openai(specs)
        while True:
            reply = await self._ask(state.messages, tools, on_text)
            state.add_usage(reply)
            msg = {"role": "assistant", "content": reply.message.get("content")}
            calls = [
                dict(c, id=c.get("id") or f"call_{state.requests}_{i}")
                for i, c in enumerate(reply.tool_calls)
            ]
            if calls:
                msg["tool_calls"] = calls
            state.messages.append(msg)
            steps = reply_to_steps({**reply.message, "tool_calls": calls}, specs)
            for i, step in enumerate(steps):
                ids = list(env.format.render_completion(step))
                if reply.finish_reason == "length" and i == len(steps) - 1:
                    ids = ids[:-1]  # the reply was cut: no terminator, so the env sees the truncation
                obs, _, terminated, truncated, info = await env.astep(ids)
                for rec in env.trajectory.turns[-1].tools:
                    state.tool_calls.append(rec)
                    if on_event is not None:
                        on_event(ToolEvent(rec))
                state.messages += observation_to_openai(
                    obs["messages"], calls[i]["id"] if i < len(calls) else None
                )
                if terminated or truncated:
                    state.finish(env, terminated, i < len(calls))
                    return


@dataclass
class _RunState:
    start: float
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolRecord] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    requests: int = 0
    stop_reason: str = "no_answer"

    def add_usage(self, reply: ChatResult) -> None:
        self.requests += 1
        for key in self.usage:
            self.usage[key] += int(reply.usage.get(key) or 0)

    def finish(self, env: Any, terminated: bool, was_call: bool) -> None:
        traj = env.trajectory
        if terminated:
            self.stop_reason = "answer" if traj.turns[-1].parsed.final is not None else "no_answer"
        elif was_call and len(traj.turns[-1].tools) == 0 and traj.turns[-1].parsed.tool_calls:
            self.stop_reason = "tool_limit"
        elif traj.turns[-1].parsed.stop_token is None:  # the last reply was cut at the token limit
            self.stop_reason = "token_limit"
        elif traj.num_turns >= env.limits.max_turns:
            self.stop_reason = "turn_limit"
        else:
            self.stop_reason = "token_limit"

    def result(self, traj: Trajectory | None, scored: bool) -> AgentResult:
        latency = time.perf_counter() - self.start
        answer = None
        if traj is not None:
            answer = next((t.parsed.final for t in reversed(traj.turns) if t.parsed.final is not None), None)
            traj.metadata.update(
                api="chat",
                requests=self.requests,
                latency_s=latency,
                gen_tokens=self.usage["completion_tokens"],
                prompt_tokens=self.usage["prompt_tokens"],
                stop_reason=self.stop_reason,
            )
        return AgentResult(
            answer=answer if self.stop_reason == "answer" else None,
            stop_reason=self.stop_reason,
            messages=self.messages,
            tool_calls=self.tool_calls,
            trajectory=traj,
            reward=traj.reward
            if (scored and traj is not None and self.stop_reason != "time_limit")
            else None,
            usage=dict(self.usage),
            requests=self.requests,
            latency_s=latency,
        )
