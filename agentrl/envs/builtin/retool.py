"""``retool``: math over several turns with a stateful python code-interpreter tool (ReTool-style).

The model may run code (``python`` tool, one sandbox session per episode) and must end with a final answer;
the reward checks it against ``task["answer"]`` with math-verify (``\\boxed{}`` preferred, else the final
text). Tasks: the offline generator (problems where computation matters: prime sums, modular powers, digit
sums of factorials...), local AIME/MATH/DAPO-style files (``{problem, answer}``), or the hub when online.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agentrl.envs.env import AgentEnv, EnvLimits
from agentrl.envs.rewards import MathAnswer, Rubric
from agentrl.envs.sandbox.base import SandboxBackend
from agentrl.envs.tasks import load_hf_rows, load_math, math_row_to_task
from agentrl.envs.tools.base import Tool
from agentrl.envs.tools.python import PythonTool

INSTRUCTIONS = (
    "Solve the math problem. You can run Python code with the python tool to compute exact values; its "
    "state persists between calls. When you are done, give the final answer as \\boxed{<answer>}."
)


def _prime_sum(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return sum(i for i in range(n) if sieve[i])


def _num_divisors(n: int) -> int:
    count, d = 1, 2
    while d * d <= n:
        e = 0
        while n % d == 0:
            n //= d
            e += 1
        count *= e + 1
        d += 1
    return count * (2 if n > 1 else 1)


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def make_problem(rng: np.random.Generator) -> tuple[str, int]:
    """One problem whose answer needs real computation, and its integer answer."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    kind = r(0, 5)
    if kind == 0:
        n = r(2_000, 50_000)
        return f"What is the sum of all prime numbers less than {n}?", _prime_sum(n)
    if kind == 1:
        n, a, b = r(10_000, 1_000_000), r(3, 13), r(14, 29)
        c = int(rng.choice([2, 5, 7]))
        lcm = math.lcm
        union = n // a + n // b - n // lcm(a, b)
        count = union - (n // lcm(a, c) + n // lcm(b, c) - n // lcm(a, b, c))
        return (
            f"How many integers from 1 to {n} inclusive are divisible by {a} or by {b} but not by {c}?",
            count,
        )
    if kind == 2:
        a, b = r(2, 99), r(100, 5_000)
        return f"What is the remainder when {a}^{b} is divided by 10000?", pow(a, b, 10_000)
    if kind == 3:
        n = r(30, 150)
        return f"What is the sum of the digits of {n}! (the factorial of {n})?", sum(
            map(int, str(math.factorial(n)))
        )
    if kind == 4:
        n = r(10**8, 10**9)
        return f"How many positive divisors does {n} have?", _num_divisors(n)
    n, m = r(1_000, 20_000), r(1_000, 100_000)
    return (f"Let F(0)=0, F(1)=1 and F(k)=F(k-1)+F(k-2). What is F({n}) mod {m}?", _fib_mod(n, m))


class ReToolEnv(AgentEnv):
    """Multi-turn math with a python tool.

    Args:
        sandbox: a :class:`~agentrl.envs.sandbox.SandboxBackend` (not closed by the env) or a backend name
            (``"local"``, ``"sandboxfusion"``, ``"e2b"``): envs on the same event loop naming the same backend
            and ``sandbox_kwargs`` share one, created on first use and closed with the last of them.
        exec_timeout_s: per-run limit inside the sandbox.
        sandbox_kwargs: passed to :func:`~agentrl.envs.sandbox.make_backend` (e.g. ``{"workers": 4}``).
        **kwargs: :class:`~agentrl.envs.AgentEnv` arguments (``format``, ``tasks``, ``limits``...).

    Reward components: ``correct`` (math-verify equality of the final answer and ``task["answer"]``).
    """

    instructions = INSTRUCTIONS
    default_limits = EnvLimits(max_turns=8, max_tool_calls=8, max_total_tokens=16384)
    rubric = Rubric([MathAnswer()])

    def __init__(
        self,
        *,
        sandbox: SandboxBackend | str = "local",
        exec_timeout_s: float = 10.0,
        sandbox_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self._sandbox = sandbox
        self._exec_timeout_s = exec_timeout_s
        self._sandbox_kwargs = dict(sandbox_kwargs or {})
        super().__init__(**kwargs)

    def make_tools(self) -> list[Tool]:
        return [PythonTool(self._sandbox, exec_timeout_s=self._exec_timeout_s, **self._sandbox_kwargs)]

    @classmethod
    def generate_task(cls, rng: np.random.Generator, split: str = "train") -> dict[str, Any]:
        prompt, answer = make_problem(rng)
        return {"id": f"gen-{int(rng.integers(1 << 31))}", "prompt": prompt, "answer": str(answer)}

    @classmethod
    def load_tasks(cls, path: str) -> list[dict[str, Any]]:
        return load_math(path)

    @staticmethod
    def hub_tasks(
        repo: str = "BytedTsinghua-SIA/DAPO-Math-17k", split: str = "train"
    ) -> list[dict[str, Any]]:
        """DAPO-Math-17k (or any ``{problem, answer}`` dataset) from the HF hub; needs network."""
        return [math_row_to_task(r, i) for i, r in enumerate(load_hf_rows(repo, split))]
