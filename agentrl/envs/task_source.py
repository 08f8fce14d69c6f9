"""Task streams for training and held-out evaluation: :class:`TaskSource`.

The trainer (``data.tasks``) and ``agentrl eval`` (``tasks=``) draw their tasks here, so a training run's
held-out evaluation and ``agentrl eval model=RUN_DIR`` evaluate the same problems. The source is:

- ``env``: the env's own offline generator (``EnvClass.generate_task(rng, split)``);
- ``arithmetic``: short integer arithmetic questions (``What is 7 + 5?``) at ``level`` 1-3, for
  small models that cannot solve the env's own tasks yet; any math env (retool, gsm8k) scores them,
  since a task is just ``{"id", "prompt", "answer"}`` (plus the ``code`` a scripted teacher runs);
- a shipped dataset's name (``gsm8k``, ``ifeval``, ...; :mod:`agentrl.data`) or a path to a JSONL/parquet
  file in the env's task format (``EnvClass.load_tasks``): its first ``num_held_out`` rows are held out for
  evaluation, the rest are the training stream (cycled).

Task ``i`` of the training stream is a pure function of ``(seed, i)``, so a resumed run continues the
stream exactly. Held-out tasks use another seed stream (generators) or rows (files), and a generated
training task whose identity equals a held-out task's is redrawn, so evaluation questions are never
trained on (with ``arithmetic`` level 1, 81 possible questions, that matters). A task's identity is its
``key`` when the generator gives one (retool: the problem, whatever its phrasing, so a paraphrase of a
held-out problem is redrawn too), else its prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentrl.seeds import HELD_OUT_OFFSET

#: the generated sources (anything else names a dataset or a task file)
TASK_SOURCES = ("env", "arithmetic")


def arithmetic_task(rng: np.random.Generator, level: int = 1) -> dict[str, Any]:
    """One integer arithmetic question. Level 1: a+b with a, b in 1..9; level 2: +, - or * on 1..20;
    level 3: a op b op c on 1..50. ``code`` prints the answer (for the scripted retool teacher)."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    if level == 1:
        a, b = r(1, 9), r(1, 9)
        expr, value = f"{a} + {b}", a + b
    elif level == 2:
        a, b, op = r(1, 20), r(1, 20), str(rng.choice(["+", "-", "*"]))
        expr = f"{a} {op} {b}"
        value = eval(expr)  # noqa: S307 - expr is built from two ints and one operator above
    elif level == 3:
        a, b, c = r(1, 50), r(1, 50), r(1, 50)
        ops = [str(o) for o in rng.choice(["+", "-", "*"], size=2)]
        expr = f"{a} {ops[0]} {b} {ops[1]} {c}"
        value = eval(expr)  # noqa: S307 - ints and operators only
    else:
        raise ValueError(f"the arithmetic level must be 1, 2 or 3, got {level}")
    return {"id": f"arith{level}-{expr.replace(' ', '')}", "prompt": f"What is {expr}?", "answer": str(value),
            "code": f"print({expr})"}


def task_identity(task: dict[str, Any]) -> str:
    """What makes two tasks the same problem: ``task["key"]`` if present (phrasing-independent), else the prompt."""
    return str(task["key"]) if task.get("key") is not None else str(task.get("prompt"))


class TaskSource:
    """``train(i)`` -> task ``i`` of the training stream; ``held_out(n)`` -> the fixed evaluation tasks.
    ``generator_kwargs`` go to the env's ``generate_task`` (e.g. ``{"tier": "tool"}`` for retool)."""

    def __init__(
        self, env_cls: type, source: str, *, seed: int, level: int = 1, eval_seed: int = HELD_OUT_OFFSET, num_held_out: int = 0,
        generator_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.env_cls, self.source, self.seed, self.level, self.eval_seed = env_cls, source, seed, level, eval_seed
        self.num_held_out = num_held_out
        self.generator_kwargs = dict(generator_kwargs or {})
        self._rows: list[dict[str, Any]] | None = None
        if source not in TASK_SOURCES:
            try:
                self._rows = list(env_cls.load_tasks(source))
            except FileNotFoundError:
                raise ValueError(f"tasks {source!r}: no such file; use env, arithmetic, a dataset name or a task file path") from None
            if not self._rows:
                raise ValueError(f"tasks {source!r}: the file holds no tasks")
        self._excluded: dict[int, set[str]] = {}
        if num_held_out and self._rows is None:  # fail early if there are not enough distinct tasks
            self._excluded[num_held_out] = {task_identity(t) for t in self.held_out()}

    def _generate(self, rng: np.random.Generator, split: str) -> dict[str, Any]:
        if self.source == "arithmetic":
            return arithmetic_task(rng, self.level)
        return self.env_cls.generate_task(rng, split, **self.generator_kwargs)

    def train(self, index: int, num_held_out: int | None = None) -> dict[str, Any]:
        """Task ``index`` of the training stream, never one of the first ``num_held_out`` (default: the
        constructor's) held-out tasks."""
        n = self.num_held_out if num_held_out is None else num_held_out
        if self._rows is not None:
            pool = self._rows[n:] or self._rows
            return dict(pool[index % len(pool)])
        if n not in self._excluded:
            self._excluded[n] = {task_identity(t) for t in self.held_out(n)}
        rng = np.random.default_rng([self.seed, 0, index])
        for _ in range(10_000):
            task = self._generate(rng, "train")
            if task_identity(task) not in self._excluded[n]:
                return task
        raise ValueError(
            f"could not draw a training task outside the {n} held-out ones; lower the held-out task count (eval.num_tasks, limit=) or raise the level"
        )

    def held_out(self, n: int | None = None) -> list[dict[str, Any]]:
        """The fixed evaluation tasks: the first ``n`` (default: the constructor's ``num_held_out``) of a
        fixed sequence of distinct tasks, so a smaller ``n`` gives a prefix of a larger one."""
        n = self.num_held_out if n is None else n
        if self._rows is not None:
            return [dict(t) for t in self._rows[:n]]
        tasks: list[dict[str, Any]] = []
        seen: set[str] = set()
        rng = np.random.default_rng([self.eval_seed, 1])
        for _ in range(100 * n + 100):  # distinct questions, so every held-out task counts once
            if len(tasks) == n:
                break
            task = self._generate(rng, "test")
            if task_identity(task) not in seen:
                seen.add(task_identity(task))
                tasks.append(task)
        if len(tasks) < n:
            raise ValueError(f"only {len(tasks)} distinct held-out tasks exist here; lower the held-out task count (eval.num_tasks, limit=) to that")
        return tasks
