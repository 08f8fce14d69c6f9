"""The one episode loop: ``reset``, then ``act`` / ``step`` until the env ends the episode or a limit does.

Every caller drives episodes through :func:`run_episode`: the trainer's rollout (through
:func:`~agentrl.episodes.collect`), ``agentrl eval``, the verl agent loop and the product
:class:`~agentrl.runtime.Agent`. They differ only in the :class:`~agentrl.episodes.Policy` (a token
engine, verl's rollout servers, a chat endpoint) and in the limits and hooks they pass; the trajectory
is always the env's own token-exact record, so the same policy gives the same trajectory everywhere.

Limits: the env's own (:class:`~agentrl.envs.EnvLimits`: turns, tool calls, total tokens) end an
episode with ``truncated=True``; :class:`EpisodeLimits` overrides them for one episode and adds a
wall-clock limit and a response-token budget.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.envs.env import AgentEnv
from agentrl.episodes.policy import Policy
from agentrl.episodes.state import EpisodeState, Step
from agentrl.harmony.trajectory import Trajectory

#: Why an episode ended: the env's reasons (``answer``: a final answer; ``no_answer``: a single-turn env's
#: action without one; ``tool_limit`` / ``turn_limit`` / ``token_limit``: an env limit; ``infrastructure``: a
#: tool's backend failed, not the model), the runner's ``time_limit``, and ``error`` (the episode raised; set by
#: :func:`~agentrl.episodes.collect`).
STOP_REASONS = (
    "answer", "no_answer", "tool_limit", "turn_limit", "token_limit", "infrastructure", "time_limit", "error",
)

StepHook = Callable[[Step], Any]

#: How many times an episode that a tool's backend ended (``stop_reason="infrastructure"``) is run again
#: (:func:`~agentrl.episodes.collect`, the verl agent loop).
INFRA_RETRIES = 2
#: Seconds to wait before the ``k``-th run again of such an episode: ``k`` times this.
INFRA_RETRY_DELAY_S = 0.5


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of one episode; ``None`` keeps the env's own.

    - ``time_s``: wall-clock seconds from reset; when hit, the policy call or tool call in flight is
      cancelled and the episode stops with ``stop_reason="time_limit"`` (the trajectory keeps every
      finished step; it is neither terminated nor truncated, and has no reward).
    - ``max_turns``, ``max_tool_calls``, ``max_total_tokens``: override the env's
      :class:`~agentrl.envs.EnvLimits` for this episode (restored afterwards).
    - ``max_response_tokens``: cap on response tokens (model + env tokens after the prompt); sets
      ``max_total_tokens`` to at most ``len(prompt) + max_response_tokens`` once the prompt is rendered.
    """

    time_s: float | None = None
    max_turns: int | None = None
    max_tool_calls: int | None = None
    max_total_tokens: int | None = None
    max_response_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("time_s", "max_turns", "max_tool_calls", "max_total_tokens", "max_response_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EpisodeLimits.{name} must be > 0 or None, got {value!r}")

    def env_overrides(self) -> dict[str, int]:
        return {
            k: v
            for k, v in (
                ("max_turns", self.max_turns),
                ("max_tool_calls", self.max_tool_calls),
                ("max_total_tokens", self.max_total_tokens),
            )
            if v is not None
        }


@dataclass
class EpisodeResult:
    """A finished episode.

    - ``trajectory``: the env's token-exact :class:`~agentrl.harmony.Trajectory` (its ``stop_reason`` repeats
      ``stop_reason``).
    - ``stop_reason``: one of :data:`STOP_REASONS`.
    - ``steps``: every env step; ``policy_s`` / ``env_s``: seconds in ``policy.act`` / ``env.astep``;
      ``wall_s``: seconds from reset to the end.
    - ``has_logprobs``: every action carried sampled log-probs (else the trajectory's 0.0 entries for
      model tokens are placeholders).
    - Collection labels (set by :func:`~agentrl.episodes.collect`): ``task_id``, ``group`` (the id
      shared by the samples of one task), ``sample`` (which sample of its task), ``error`` (the
      exception's last line when the episode raised, the trajectory then being the partial one; or, for an
      episode a tool's backend ended, its ``trajectory.error``), ``traceback`` (the full traceback(s) behind
      ``error``, for the run's ``errors.log``), ``retries`` (how many earlier runs of this job a tool's backend
      ended and :func:`~agentrl.episodes.collect` ran again) and ``retried_errors`` (their errors and tracebacks).
    """

    trajectory: Trajectory
    stop_reason: str
    steps: list[Step] = field(default_factory=list)
    policy_s: float = 0.0
    env_s: float = 0.0
    wall_s: float = 0.0
    has_logprobs: bool = True
    task_id: str | None = None
    group: int | None = None
    sample: int = 0
    error: str | None = None
    traceback: str | None = None
    retries: int = 0
    retried_errors: list[str] = field(default_factory=list)

    @property
    def infrastructure(self) -> bool:
        """True when a tool's backend ended the episode (``stop_reason == "infrastructure"``): not the model's
        failure, never scored or trained on."""
        return self.stop_reason == "infrastructure"

    @property
    def reward_error(self) -> str | None:
        """The env's reward function's exception (``trajectory.reward_error``), or None: the
        episode finished, but its reward (0) is not a score."""
        return self.trajectory.reward_error

    @property
    def usable(self) -> bool:
        """False when the episode raised, a tool's backend ended it, or its reward function raised: the
        trajectory is kept and counted, not trained on."""
        return self.error is None and self.reward_error is None and not self.infrastructure

    def failures(self) -> list[tuple[str, str]]:
        """What went wrong, for the run's ``errors.log`` (:mod:`agentrl.errorlog`): ``(what, text)`` for each
        earlier run that a tool's backend ended, then for this run when it failed (``text``: the traceback, or
        the message when there is none). Empty for an episode that ran without a failure."""
        label = f"task {self.task_id} sample {self.sample}"
        out = [(f"{label}: infrastructure failure, run again ({k + 1})", text)
               for k, text in enumerate(self.retried_errors)]
        if self.error is not None:
            kind = "infrastructure failure, left out" if self.infrastructure else "episode failed"
            out.append((f"{label}: {kind}: {self.error.splitlines()[0] if self.error else ''}",
                        self.traceback or self.error))
        elif self.reward_error is not None:
            out.append((f"{label}: the reward function raised", self.reward_error))
        return out

    @property
    def tool_s(self) -> float:
        """Seconds the episode's tool calls took (summed; calls of one action run concurrently)."""
        return sum(rec.latency_s for turn in self.trajectory.turns for rec in turn.tools)

    @property
    def routing(self) -> Any:
        """The last action's recorded MoE routing (it covers the whole context that action was sampled
        from), or ``None``."""
        return getattr(self.steps[-1].action, "routing", None) if self.steps else None


async def run_episode(
    env: AgentEnv,
    policy: Policy,
    *,
    task: dict[str, Any] | None = None,
    seed: int | None = None,
    limits: EpisodeLimits | None = None,
    on_step: StepHook | None = None,
) -> EpisodeResult:
    """Run one episode of ``env`` driven by ``policy`` and return it.

    Args:
        env: the env; reset here (``areset(seed=seed, options={"task": task})``). Not closed: envs are
            reused across episodes.
        policy: see :class:`~agentrl.episodes.Policy`.
        task: the task to run; ``None`` lets the env draw one with ``seed``.
        seed: the env's reset seed.
        limits: per-episode limits (see :class:`EpisodeLimits`).
        on_step: called with each :class:`~agentrl.episodes.Step` right after the env stepped (e.g. to
            stream tool results); may be a coroutine function.

    Returns:
        An :class:`EpisodeResult`. An episode ends when the env terminates or truncates it, or at
        ``limits.time_s``.

    Raises:
        Whatever ``policy.act``, ``env.areset``/``env.astep`` or ``on_step`` raise (the env keeps the
        partial trajectory in ``env.trajectory``); ``ValueError`` for a policy that returns no action. On
        every path out, the episode's tool sessions are released (:meth:`~agentrl.envs.AgentEnv.release_sessions`).
    """
    run = _Run(env, policy, limits or EpisodeLimits(), on_step)
    saved_limits = env.limits
    if run.limits.env_overrides():
        env.limits = replace(env.limits, **run.limits.env_overrides())
    try:
        if run.limits.time_s is None:
            stop_reason = await run.loop(task, seed)
        else:
            try:
                stop_reason = await asyncio.wait_for(run.loop(task, seed), run.limits.time_s)
            except (TimeoutError, asyncio.TimeoutError):
                stop_reason = "time_limit"
    finally:
        env.limits = saved_limits
        await env.release_sessions()  # a time limit, an error or a cancellation frees them too, at once
    return run.result(stop_reason)


class _Run:
    """One call of :func:`run_episode`. The state lives here, not in the loop's frame, so a time limit
    that cancels the loop still leaves the steps done so far."""

    def __init__(self, env: AgentEnv, policy: Policy, limits: EpisodeLimits, on_step: StepHook | None):
        self.env, self.policy, self.limits, self.on_step = env, policy, limits, on_step
        self.state: EpisodeState | None = None
        self.policy_s = self.env_s = 0.0
        self.t0 = time.perf_counter()

    async def loop(self, task: dict[str, Any] | None, seed: int | None) -> str:
        """Reset, then act and step until the env ends the episode; returns the env's stop reason."""
        env = self.env
        obs, info = await env.areset(seed=seed, options={"task": task} if task is not None else None)
        state = self.state = EpisodeState(env, info["task"], seed, tuple(obs["messages"]))
        if self.limits.max_response_tokens is not None:
            cap = len(state.trajectory.prompt_ids) + self.limits.max_response_tokens
            if cap < env.limits.max_total_tokens:
                env.limits = replace(env.limits, max_total_tokens=cap)
        while True:
            t0 = time.perf_counter()
            actions = list(await self.policy.act(state))
            self.policy_s += time.perf_counter() - t0
            if not actions:
                raise ValueError(
                    f"{type(self.policy).__name__}.act returned no action; a policy must return at least one"
                )
            for action in actions:
                t0 = time.perf_counter()
                obs, reward, terminated, truncated, info = await env.astep(action)
                env_s = time.perf_counter() - t0
                self.env_s += env_s
                step = Step(action, obs, reward, terminated, truncated, info, state.trajectory.turns[-1], env_s)
                state.steps.append(step)
                if self.on_step is not None:
                    maybe = self.on_step(step)
                    if inspect.isawaitable(maybe):
                        await maybe
                if step.done:
                    return str(info["stop_reason"])

    def result(self, stop_reason: str) -> EpisodeResult:
        started = self.state is not None and self.env.trajectory is not None
        traj = self.env.trajectory if started else Trajectory(prompt_ids=[])
        assert traj is not None
        traj.stop_reason = stop_reason
        steps = self.state.steps if self.state is not None else []
        broken = stop_reason == "infrastructure"
        tracebacks = self.env.infrastructure_tracebacks if broken else []
        return EpisodeResult(
            trajectory=traj,
            stop_reason=stop_reason,
            steps=steps,
            policy_s=self.policy_s,
            env_s=self.env_s,
            wall_s=time.perf_counter() - self.t0,
            has_logprobs=all(getattr(s.action, "logprobs", None) is not None for s in steps),
            error=traj.infrastructure_error if broken else None,
            traceback="\n".join(tracebacks) or None,
        )
