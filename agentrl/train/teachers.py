"""Teacher policies and the demonstration generator for supervised cold starts (``agentrl sft``).

A teacher plays episodes of an env. Every action it takes goes through ``env.astep`` as token ids in the
env's format (the student's format), so a demonstration is a trajectory the student could have produced:
prompt and env tokens are the env's own, tool outputs are what the env's real tools (the real code
sandbox) returned, and the teacher's actions are encoded the way the student emits them (the format's
``render_completion``: its tokenizer's own split, then the end-of-turn token). Nothing is re-tokenised
afterwards; the trajectory is the env's record.

A teacher is an :class:`agentrl.episodes.Policy` run by the one episode loop (:func:`agentrl.episodes.collect`):

- :class:`ReToolScriptedTeacher` (``teacher=scripted`` for ``retool``): writes the python that solves the
  task (the generator's ``task["code"]``), reads the tool's output from the env's record of the call and
  answers ``The answer is \\boxed{<output>}.``;
- :func:`engine_teacher`: :class:`agentrl.episodes.TokenPolicy` on any engine with the student's tokenizer,
  e.g. a bigger model of the same family behind an OpenAI-compatible completions endpoint
  (``teacher_api=completions``);
- :func:`chat_teacher`: :class:`agentrl.runtime.ChatPolicy` on any chat-completions endpoint (vLLM, SGLang,
  hosted APIs; ``teacher_api=chat``), whose replies are rendered into the env's format.

:func:`generate_demonstrations` runs a teacher over tasks and keeps the episodes that pass a filter
(:func:`keep_trajectory`: correct ones by default), in task order whatever the concurrency.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.harmony.trajectory import Trajectory
from agentrl.harmony.types import Message


class TeacherError(RuntimeError):
    """A teacher cannot act on this env or task; the message says why and what to use instead."""


def _python_spec(env: Any) -> Any:
    spec = next((s for s in env.toolbox.specs if s.name == "python"), None)
    if spec is None:
        raise TeacherError(f"{type(env).__name__} has no python tool; the scripted retool teacher needs one")
    return spec


class ReToolScriptedTeacher:
    """The scripted retool teacher, an :class:`agentrl.episodes.Policy`: one python call with the task's
    program, then the boxed tool output.

    Turn 1: a call of the env's ``python`` tool with ``task["code"]`` (tasks from the retool generator and the
    arithmetic task source carry it; other tasks raise :class:`TeacherError`). Turn 2: ``The answer is
    \\boxed{<last line of the tool output>}.``, read from the env's own record of turn 1's tool call. A program
    that fails makes a wrong demonstration, which the default filter (correct episodes only) drops.
    Stateless: one instance serves any number of concurrent episodes.
    """

    name = "scripted"

    def __init__(self, answer_template: str = "The answer is \\boxed{{{output}}}.") -> None:
        self.answer_template = answer_template

    async def act(self, episode: Any) -> list[list[int]]:
        from agentrl.runtime.bridge import reply_to_steps

        env, task = episode.env, episode.task
        results = [rec for step in episode.steps for rec in step.turn.tools]
        if not results:
            code = task.get("code")
            if not code:
                raise TeacherError(
                    f"task {task.get('id')!r} has no 'code'; the scripted retool teacher solves generated retool "
                    "tasks only (use an endpoint teacher, teacher=http://..., for other tasks)"
                )
            spec = _python_spec(env)
            call = {"function": {"name": spec.name, "arguments": {"code": code}}}
            (step,) = reply_to_steps({"content": None, "tool_calls": [call]}, env.toolbox.specs)
            return [list(env.format.render_completion(step))]
        lines = results[-1].result.strip().splitlines() or [""]
        answer = self.answer_template.format(output=lines[-1].strip())
        return [list(env.format.render_completion([Message("assistant", answer, channel="final")]))]


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
    (e.g. :class:`~agentrl.engines.openai_engine.OpenAIEngine` on a served bigger model of the same family)."""
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


#: env name -> scripted teacher policy class
SCRIPTED_TEACHERS: dict[str, Callable[[], Any]] = {"retool": ReToolScriptedTeacher}


def scripted_teacher(env_name: str) -> Teacher:
    """The scripted teacher of a built-in env; raises :class:`TeacherError` naming the envs that have one."""
    if env_name not in SCRIPTED_TEACHERS:
        raise TeacherError(
            f"env {env_name!r} has no scripted teacher (envs with one: {', '.join(sorted(SCRIPTED_TEACHERS))}); "
            "use an endpoint teacher (teacher=http://HOST:PORT/v1) or trajectories from `agentrl eval` (data=PATH)"
        )
    return Teacher("scripted", SCRIPTED_TEACHERS[env_name]())


def is_correct(traj: Trajectory) -> bool:
    """The episode's ``correct`` reward component if it has one, else ``reward >= 1``."""
    if "correct" in traj.reward_components:
        return traj.reward_components["correct"] >= 1.0
    return traj.reward >= 1.0


def keep_trajectory(traj: Trajectory, *, min_reward: float | None = None, correct_only: bool = False) -> bool:
    """The SFT data filter: usable (no rollout or reward error, at least one model token), reward >= ``min_reward``
    when given, and correct (:func:`is_correct`) when ``correct_only`` (rejection sampling)."""
    if traj.metadata.get("rollout_error") or traj.metadata.get("reward_error") or not any(traj.response_mask):
        return False
    if min_reward is not None and traj.reward < min_reward:
        return False
    return not correct_only or is_correct(traj)


@dataclass
class Demonstrations:
    """Output of :func:`generate_demonstrations`: the kept trajectories (task order), how many episodes ran,
    how many failed with an exception (``errors``: their messages), and the wall time."""

    trajectories: list[Trajectory]
    episodes: int
    failed: int
    wall_s: float
    errors: list[str] = field(default_factory=list)

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
) -> Demonstrations:
    """Run ``teacher`` (a :class:`Teacher` or a bare policy) once on each task with
    :func:`agentrl.episodes.collect` (``concurrency`` envs from ``make_env``; episode ``i`` gets seed
    ``seed + i``) and keep the episodes that pass :func:`keep_trajectory`, in task order. An episode that
    raises is counted in ``failed`` and dropped; a :class:`TeacherError` (the teacher cannot handle the env or
    task at all) is raised. The envs are closed at the end."""
    from agentrl.episodes import EnvPool, EpisodeJob, collect

    if not isinstance(teacher, Teacher):
        teacher = Teacher(getattr(teacher, "name", type(teacher).__name__), teacher)
    t0 = time.perf_counter()
    pool = EnvPool(make_env, max(1, min(concurrency, len(tasks))))
    jobs = [EpisodeJob(dict(task), seed + i, str(task.get("id", i)), i) for i, task in enumerate(tasks)]
    try:
        results = await collect(pool, teacher.policy, jobs)
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
        r.trajectory.metadata.setdefault("task_id", r.task_id)
        r.trajectory.metadata["teacher"] = teacher.name
        if keep_trajectory(r.trajectory, min_reward=min_reward, correct_only=correct_only):
            kept.append(r.trajectory)
    return Demonstrations(kept, len(tasks), len(errors), time.perf_counter() - t0, errors)
