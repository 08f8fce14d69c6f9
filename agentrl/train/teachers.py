"""Teacher policies and the demonstration generator for supervised cold starts (``agentrl sft``).

A teacher plays episodes of an env. Every action it takes goes through ``env.astep`` as token ids in the
env's format (the student's format), so a demonstration is a trajectory the student could have produced:
prompt and env tokens are the env's own, tool outputs are what the env's real tools (the real code
sandbox) returned, and the teacher's actions are encoded the way the student emits them (the format's
``render_completion``: its tokenizer's own split, then the end-of-turn token). Nothing is re-tokenised
afterwards; the trajectory is the env's record.

A teacher is an :class:`agentrl.episodes.Policy` run by the one episode loop (:func:`agentrl.episodes.collect`):

- the env's own scripted teacher (``teacher=scripted``, or ``auto`` when the env has one: the
  :meth:`AgentEnv.scripted_teacher <agentrl.envs.AgentEnv.scripted_teacher>` hook; retool's writes the python
  that solves the task and answers with its boxed output);
- :func:`engine_teacher`: :class:`agentrl.episodes.TokenPolicy` on any engine with the student's tokenizer,
  e.g. a bigger model of the same family behind an OpenAI-compatible completions endpoint
  (``teacher_api=completions``);
- :func:`chat_teacher`: :class:`agentrl.runtime.ChatPolicy` on any chat-completions endpoint (vLLM, SGLang,
  hosted APIs; ``teacher_api=chat``), whose replies are rendered into the env's format.

:func:`generate_demonstrations` runs a teacher over tasks and keeps the episodes that pass a filter
(:func:`~agentrl.train.sft_data.keep_trajectory`: correct ones by default), in task order whatever the
concurrency.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.envs.env import TeacherError
from agentrl.harmony.trajectory import Trajectory
from agentrl.progress import ProgressLines
from agentrl.train.sft_data import keep_trajectory


@dataclass
class Teacher:
    """A named teacher: ``policy`` (an :class:`agentrl.episodes.Policy`, or ``job -> Policy`` for policies
    that keep per-episode state, such as :class:`agentrl.runtime.ChatPolicy`) and what closes its clients."""

    name: str
    policy: Any
    close: Callable[[], Awaitable[Any]] | None = None

    async def aclose(self) -> None:
        if self.close is not None:
            await self.close()


def engine_teacher(engine: Any, sampling: SamplingParams, name: str = "engine") -> Teacher:
    """A token-level teacher: :class:`agentrl.episodes.TokenPolicy` on any engine with the student's tokenizer
    (e.g. :class:`~agentrl.engines.client.OpenAIEngine` on a served bigger model of the same family)."""
    from agentrl.episodes import TokenPolicy

    close = getattr(engine, "aclose", None)
    return Teacher(name, TokenPolicy(engine, sampling), close)


def chat_teacher(client: Any, sampling: dict[str, Any] | None = None, name: str = "chat") -> Teacher:
    """A chat-completions teacher (any tokenizer): :class:`agentrl.runtime.ChatPolicy` per episode, whose
    replies are rendered into the env's format; ``sampling`` holds chat request fields, the episode's seed
    is added."""
    from agentrl.runtime.chat_policy import ChatPolicy

    def policy(job: Any) -> Any:
        return ChatPolicy(client, {**(sampling or {}), **({"seed": job.seed} if job.seed is not None else {})})

    return Teacher(name, policy, client.aclose)


def scripted_teacher(env_cls: type) -> Teacher:
    """The env's own scripted teacher (:meth:`AgentEnv.scripted_teacher <agentrl.envs.AgentEnv.scripted_teacher>`);
    raises :class:`~agentrl.envs.TeacherError` naming what to use instead when it has none."""
    policy = env_cls.scripted_teacher()
    if policy is None:
        raise TeacherError(
            f"{env_cls.__name__} has no scripted teacher (AgentEnv.scripted_teacher); use an endpoint teacher "
            "(teacher=http://HOST:PORT/v1) or trajectories from `agentrl eval` (data=PATH)"
        )
    return Teacher("scripted", policy)


@dataclass
class Demonstrations:
    """Output of :func:`generate_demonstrations`: the kept trajectories (task order), how many episodes ran,
    how many failed with an exception (``errors``: their messages), the wall time, and the messages of the
    finished episodes whose reward raised (``reward_errors``; such episodes are never kept)."""

    trajectories: list[Trajectory]
    episodes: int
    failed: int
    wall_s: float
    errors: list[str] = field(default_factory=list)
    reward_errors: list[str] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return len(self.trajectories)


async def generate_demonstrations(
    make_env: Callable[[], Any],
    teacher: Teacher | Any,
    tasks: Sequence[dict[str, Any]],
    *,
    seed: int = 0,
    concurrency: int = 8,
    min_reward: float | None = None,
    correct_only: bool = True,
    progress_interval_s: float = 0.0,
) -> Demonstrations:
    """Run ``teacher`` (a :class:`Teacher` or a bare policy) once on each task with
    :func:`agentrl.episodes.collect` (``concurrency`` envs from ``make_env``; episode ``i`` gets seed
    ``seed + i``) and keep the episodes that pass :func:`keep_trajectory`, in task order. An episode that
    raises is counted in ``failed`` and dropped; a :class:`TeacherError` (the teacher cannot handle the env or
    task at all) is raised. The envs are closed at the end. When stdout is not a terminal, a progress line every
    ``progress_interval_s`` seconds (:class:`~agentrl.progress.ProgressLines`)."""
    from agentrl.episodes import EnvPool, EpisodeJob, collect

    if not isinstance(teacher, Teacher):
        teacher = Teacher(getattr(teacher, "name", type(teacher).__name__), teacher)
    t0 = time.perf_counter()
    pool = EnvPool(make_env, max(1, min(concurrency, len(tasks))))
    jobs = [EpisodeJob(dict(task), seed + i, str(task.get("id", i)), i) for i, task in enumerate(tasks)]
    lines = ProgressLines("SFT data", len(jobs), interval_s=progress_interval_s)
    try:
        with lines:
            results = await collect(pool, teacher.policy, jobs, on_episode=lambda r: lines.update(lines.done + 1))
    finally:
        await pool.aclose()
    errors = [f"task {r.task_id}: {r.error}" for r in results if r.error]
    refused = next((e for e in errors if "TeacherError" in e), None)
    if refused is not None:
        raise TeacherError(refused.split("TeacherError: ", 1)[-1])
    kept = []
    for r in results:
        if r.error:
            continue
        r.trajectory.model = f"teacher {teacher.name}"
        if keep_trajectory(r.trajectory, min_reward=min_reward, correct_only=correct_only):
            kept.append(r.trajectory)
    reward_errors = [f"task {r.task_id}: {r.trajectory.reward_error}" for r in results
                     if not r.error and r.trajectory.reward_error]
    return Demonstrations(kept, len(tasks), len(errors), time.perf_counter() - t0, errors, reward_errors)
