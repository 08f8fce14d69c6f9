"""Teacher policies and the demonstration generator for supervised cold starts (``agentrl sft``).

A teacher plays episodes of an env. Every action it takes goes through ``env.astep`` as token ids in the
env's format (the student's format), so a demonstration is a trajectory the student could have produced:
prompt and env tokens are the env's own, tool outputs are what the env's real tools (the real code
sandbox) returned, and the teacher's actions are encoded the way the student emits them (the format's
``render_completion``: its tokenizer's own split, then the end-of-turn token). Nothing is re-tokenised
afterwards; the trajectory is the env's record.

Teachers:

- :class:`ReToolScriptedTeacher` (``teacher=scripted`` for ``retool``): writes the python that solves the
  task (the generator's ``task["code"]``), reads the tool's output from the env's observation and answers
  ``The answer is \\boxed{<output>}.``;
- :class:`EngineTeacher`: any :class:`~agentrl.engines.base.RolloutEngine` on the student's tokenizer, e.g. a
  bigger model of the same family behind an OpenAI-compatible completions endpoint
  (:class:`~agentrl.engines.openai_engine.OpenAIEngine`, ``teacher_api=completions``);
- :class:`ChatTeacher`: any chat-completions endpoint (vLLM, SGLang, hosted APIs; ``teacher_api=chat``): its
  replies are rendered into the env's format by the product :class:`~agentrl.runtime.Agent`.

:func:`generate_demonstrations` runs a teacher over tasks and keeps the episodes that pass a filter
(:func:`keep_trajectory`: correct ones by default), in task order whatever the concurrency.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.harmony.trajectory import Trajectory
from agentrl.harmony.types import Message


class TeacherError(RuntimeError):
    """A teacher cannot act on this env or task; the message says why and what to use instead."""


class Teacher(abc.ABC):
    """Plays one episode of ``task`` in ``env`` and returns the env's trajectory."""

    name: str = "teacher"

    @abc.abstractmethod
    async def episode(self, env: Any, task: dict[str, Any], seed: int) -> Trajectory:
        """Reset ``env`` to ``task`` (with ``seed``), act until the episode ends, return ``env.trajectory``."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release the teacher's resources (clients)."""


class StepTeacher(Teacher):
    """A teacher that picks one action at a time from the env's state (its task and trajectory so far)."""

    @abc.abstractmethod
    async def act(self, env: Any) -> Any:
        """The next action: token ids in ``env.format`` or an engine ``Completion``."""

    async def episode(self, env: Any, task: dict[str, Any], seed: int) -> Trajectory:
        await env.areset(seed=seed, options={"task": task})
        while True:
            _, _, terminated, truncated, _ = await env.astep(await self.act(env))
            if terminated or truncated:
                return env.trajectory


def _python_spec(env: Any) -> Any:
    spec = next((s for s in env.toolbox.specs if s.name == "python"), None)
    if spec is None:
        raise TeacherError(f"{type(env).__name__} has no python tool; the scripted retool teacher needs one")
    return spec


class ReToolScriptedTeacher(StepTeacher):
    """The scripted retool teacher: one python call with the task's program, then the boxed tool output.

    Turn 1: a call of the env's ``python`` tool with ``task["code"]`` (tasks from the retool generator carry
    it; other tasks raise :class:`TeacherError`). Turn 2: ``The answer is \\boxed{<last line of the tool
    output>}.``, read from the env's own tool record of turn 1. A program that fails makes a wrong
    demonstration, which the default filter (correct episodes only) drops.
    """

    name = "scripted"

    def __init__(self, answer_template: str = "The answer is \\boxed{{{output}}}.") -> None:
        self.answer_template = answer_template

    async def act(self, env: Any) -> list[int]:
        from agentrl.runtime.bridge import reply_to_steps

        traj, task = env.trajectory, env.task
        results = [rec for turn in traj.turns for rec in turn.tools]
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
            return list(env.format.render_completion(step))
        lines = results[-1].result.strip().splitlines() or [""]
        answer = self.answer_template.format(output=lines[-1].strip())
        return list(env.format.render_completion([Message("assistant", answer, channel="final")]))


class EngineTeacher(StepTeacher):
    """A token-level teacher: ``engine.generate`` on the exact token stream so far (same tokenizer as the
    student). ``sampling.stop_token_ids`` default to the env format's."""

    name = "engine"

    def __init__(self, engine: Any, sampling: SamplingParams) -> None:
        self.engine, self.sampling = engine, sampling

    async def act(self, env: Any) -> Any:
        traj = env.trajectory
        sampling = self.sampling
        if not sampling.stop_token_ids:
            sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": list(env.format.stop_token_ids)})
        (completion,) = await self.engine.generate([list(traj.prompt_ids) + list(traj.response_ids)], sampling)
        return completion


class ChatTeacher(Teacher):
    """A chat-completions teacher (any tokenizer): the product :class:`~agentrl.runtime.Agent` drives the
    episode and renders each reply into the env's format. ``sampling``: chat request fields
    (``temperature``, ``max_completion_tokens``, ...)."""

    name = "chat"

    def __init__(self, client: Any, sampling: dict[str, Any] | None = None) -> None:
        self.client, self.sampling = client, dict(sampling or {})

    async def episode(self, env: Any, task: dict[str, Any], seed: int) -> Trajectory:
        from agentrl.runtime import Agent

        agent = Agent(env, self.client, time_limit_s=None, sampling={**self.sampling, "seed": seed})
        result = await agent.run_task(task)
        assert result.trajectory is not None
        return result.trajectory

    async def aclose(self) -> None:
        await self.client.aclose()


#: env name -> scripted teacher class
SCRIPTED_TEACHERS: dict[str, Callable[[], Teacher]] = {"retool": ReToolScriptedTeacher}


def scripted_teacher(env_name: str) -> Teacher:
    """The scripted teacher of a built-in env; raises :class:`TeacherError` naming the envs that have one."""
    if env_name not in SCRIPTED_TEACHERS:
        raise TeacherError(
            f"env {env_name!r} has no scripted teacher (envs with one: {', '.join(sorted(SCRIPTED_TEACHERS))}); "
            "use an endpoint teacher (teacher=http://HOST:PORT/v1) or trajectories from `agentrl eval` (data=PATH)"
        )
    return SCRIPTED_TEACHERS[env_name]()


def is_correct(traj: Trajectory) -> bool:
    """The episode's ``correct`` reward component if it has one, else ``reward >= 1``."""
    if "correct" in traj.reward_components:
        return traj.reward_components["correct"] >= 1.0
    return traj.reward >= 1.0


def keep_trajectory(traj: Trajectory, *, min_reward: float | None = None, correct_only: bool = False) -> bool:
    """The SFT data filter: usable (no rollout error, at least one model token), reward >= ``min_reward``
    when given, and correct (:func:`is_correct`) when ``correct_only`` (rejection sampling)."""
    if traj.metadata.get("rollout_error") or not any(traj.response_mask):
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
    teacher: Teacher,
    tasks: Sequence[dict[str, Any]],
    *,
    seed: int = 0,
    concurrency: int = 8,
    min_reward: float | None = None,
    correct_only: bool = True,
    on_progress: Callable[[int, int], Any] | None = None,
) -> Demonstrations:
    """Run ``teacher`` once on each task (``concurrency`` envs from ``make_env``; episode ``i`` gets seed
    ``seed + i``) and keep the episodes that pass :func:`keep_trajectory`. An episode that raises is counted
    in ``failed`` and dropped; a :class:`TeacherError` (the teacher cannot handle the env or task at all) is
    raised. Envs are closed at the end."""
    t0 = time.perf_counter()
    results: list[Trajectory | None] = [None] * len(tasks)
    errors: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(tasks)):
        queue.put_nowait(i)
    done = 0

    async def worker() -> None:
        nonlocal done
        env = make_env()
        try:
            while not queue.empty():
                i = queue.get_nowait()
                task = dict(tasks[i])
                try:
                    traj = await teacher.episode(env, task, seed + i)
                except TeacherError:
                    raise
                except Exception as exc:  # noqa: BLE001 - one failed demonstration must not stop the rest
                    errors.append(f"task {task.get('id', i)}: {type(exc).__name__}: {exc}")
                    await env.aclose()
                    env = make_env()
                else:
                    traj.metadata.setdefault("task_id", task.get("id", i))
                    traj.metadata["teacher"] = teacher.name
                    results[i] = traj
                done += 1
                if on_progress is not None:
                    on_progress(done, len(tasks))
        finally:
            await env.aclose()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(tasks))))))
    kept = [
        t for t in results if t is not None and keep_trajectory(t, min_reward=min_reward, correct_only=correct_only)
    ]
    return Demonstrations(kept, len(tasks), len(errors), time.perf_counter() - t0, errors)
