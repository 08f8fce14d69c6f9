"""``retool``: math over several turns with a stateful python code-interpreter tool (ReTool-style).

The model may run code (``python`` tool, one sandbox session per episode) and must end with a final answer;
the reward checks it against ``task["answer"]`` with math-verify (``\\boxed{}`` preferred, else the final
text). Tasks: the offline generator, local AIME/MATH/DAPO-style files (``{problem, answer}``), or the hub when
online.

The offline generator has difficulty tiers (``tier=`` on the env and on :meth:`ReToolEnv.generate_task`):

- ``tool`` (default): exact big-number arithmetic and counting (products, sums, differences and powers of
  4-8 digit numbers, multiples in a range, sums of ranges), each operation phrased in several templates
  (bare expressions and word problems). A small model cannot do these in its head: without the tool its reward
  is about 0 (SmolLM2-135M answered 0 of 128 held-out problems without a tool call, ``benchmarks/RESULTS.md``),
  with one line of python it is 1.
- ``compute``: problems that need a short program (prime sums, inclusion-exclusion counts, modular powers,
  digit sums of factorials, divisor counts, Fibonacci mod m), for bigger models and GPU runs.
- ``mixed``: either of the two, with equal probability.
- ``table``: long-context problems: a ledger of ``table_rows`` entries (about 8 tokens each: 800 rows make a
  prompt of about 6.5k tokens) and a question over it (the sum, or the count, of the amounts divisible by a
  small number), which a model answers by copying the ledger into python. For runs at long contexts.

Shaping (``closeness=<weight>``): a dense reward component ``closeness`` in [0, 1] added with that weight to
``correct``: how close, in orders of magnitude, the last number the model wrote (its final answer if it gave
one, else anywhere in its actions) is to the answer (:func:`~agentrl.envs.rewards.math.answer_closeness`). A
model that never answers correctly, e.g. a randomly initialised one, still gets rewards that differ within a
GRPO group, so its policy gradient is not zero.

Every generated task carries ``key`` (the problem's identity, the same for every paraphrase of one
problem, e.g. ``mul:4821:90713``), ``op``, ``template`` and ``code`` (a python program that prints the
answer, used by the env's scripted teacher, :class:`ReToolScriptedTeacher`). Train and test splits are disjoint by
``key``: a problem belongs to the test split iff ``crc32(key) % 10 == 0``, so no paraphrase of an evaluation
problem is ever a training problem, whatever the seeds.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentrl.envs.env import AgentEnv, EnvLimits, TeacherError
from agentrl.envs.rewards import MathAnswer, Rubric
from agentrl.envs.rewards.base import RewardContext
from agentrl.envs.rewards.math import answer_closeness
from agentrl.envs.sandbox.base import SandboxBackend
from agentrl.envs.tasks import load_hf_rows, load_math, math_row_to_task
from agentrl.envs.tools.base import Tool
from agentrl.envs.tools.python import PythonTool
from agentrl.harmony.types import Message

INSTRUCTIONS = (
    "Solve the math problem. You can run Python code with the python tool to compute exact values; its "
    "state persists between calls. When you are done, give the final answer as \\boxed{<answer>}."
)
TIERS = ("tool", "compute", "mixed", "table")
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Problem:
    """One generated problem: ``prompt`` (the phrasing shown), integer ``answer``, ``code`` (python that
    prints the answer), ``key`` (identity of the problem across phrasings), ``op`` and ``template``
    (which operation and which phrasing of it)."""

    prompt: str
    answer: int
    code: str
    key: str
    op: str
    template: int


def split_of(key: str) -> str:
    """``"test"`` for one problem key in ten (by CRC-32), else ``"train"``."""
    return "test" if zlib.crc32(key.encode()) % 10 == 0 else "train"


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


# ---------------------------------------------------------------------------------------------- tier "tool"
#: operation -> phrasings; fields are filled from the operands by name
TOOL_TEMPLATES: dict[str, tuple[str, ...]] = {
    "mul": (
        "What is {a} * {b}?",
        "Compute {a} × {b}.",
        "What is the product of {a} and {b}?",
        "Multiply {a} by {b}.",
        "A warehouse has {a} boxes and each box holds {b} screws. How many screws are in the warehouse?",
        "A printer prints {b} pages per hour. How many pages does it print in {a} hours?",
    ),
    "add": (
        "What is {a} + {b} + {c}?",
        "Compute the sum {a} + {b} + {c}.",
        "Add {a}, {b} and {c}. What is the total?",
        "Three trucks carry {a}, {b} and {c} kilograms of sand. How many kilograms do they carry together?",
        "A library owns {a} novels, {b} textbooks and {c} magazines. How many items does it own in all?",
    ),
    "sub": (
        "What is {a} - {b}?",
        "Compute {a} minus {b}.",
        "Subtract {b} from {a}.",
        "A city had {a} residents and {b} of them moved away. How many residents are left?",
        "How much greater is {a} than {b}?",
    ),
    "pow": (
        "What is {a}^{b}?",
        "Compute {a} to the power of {b}.",
        "What is {a} raised to the power {b}?",
        "A colony of bacteria grows {a}-fold every day, starting from one cell. How many cells are there after {b} days?",
    ),
    "count_multiples": (
        "How many integers from {lo} to {hi} inclusive are divisible by {k}?",
        "Count the multiples of {k} between {lo} and {hi}, inclusive.",
        "How many numbers in the range {lo} to {hi} (both included) are multiples of {k}?",
        "Tickets are numbered {lo} to {hi}. Every ticket whose number is divisible by {k} wins. How many tickets win?",
    ),
    "range_sum": (
        "What is the sum of all integers from {lo} to {hi} inclusive?",
        "Compute {lo} + {lo1} + ... + {hi}.",
        "Add up every whole number from {lo} through {hi}.",
        "A runner runs {lo} metres on day one, {lo1} metres on day two, one metre more each day, and {hi} metres on the last day. How many metres does she run in total?",
    ),
}
TOOL_OPS = tuple(TOOL_TEMPLATES)


def _tool_operands(op: str, r: Any) -> tuple[dict[str, int], int, str, str]:
    """Operands, answer, python code and key of one ``op`` problem (``r(lo, hi)`` draws an int)."""
    if op == "mul":
        a, b = r(1_000, 99_999), r(100, 9_999)
        return {"a": a, "b": b}, a * b, f"print({a} * {b})", f"mul:{min(a, b)}:{max(a, b)}"
    if op == "add":
        a, b, c = r(10_000, 9_999_999), r(10_000, 9_999_999), r(10_000, 9_999_999)
        return {"a": a, "b": b, "c": c}, a + b + c, f"print({a} + {b} + {c})", "add:" + ":".join(map(str, sorted((a, b, c))))
    if op == "sub":
        a = r(1_000_000, 99_999_999)
        b = r(100_000, a - 1)
        return {"a": a, "b": b}, a - b, f"print({a} - {b})", f"sub:{a}:{b}"
    if op == "pow":
        a, b = r(11, 99), r(5, 12)
        return {"a": a, "b": b}, a**b, f"print({a} ** {b})", f"pow:{a}:{b}"
    if op == "count_multiples":
        lo, k = r(100, 50_000), r(7, 97)
        hi = lo + r(1_000, 500_000)
        count = hi // k - (lo - 1) // k
        code = f"print({hi} // {k} - ({lo} - 1) // {k})"
        return {"lo": lo, "hi": hi, "k": k}, count, code, f"count_multiples:{lo}:{hi}:{k}"
    if op == "range_sum":
        lo = r(100, 9_999)
        hi = lo + r(100, 9_999)
        return {"lo": lo, "lo1": lo + 1, "hi": hi}, (lo + hi) * (hi - lo + 1) // 2, f"print(sum(range({lo}, {hi} + 1)))", f"range_sum:{lo}:{hi}"
    raise ValueError(f"unknown tool-tier operation {op!r}; valid: {', '.join(TOOL_OPS)}")


def tool_problem(rng: np.random.Generator, ops: tuple[str, ...] = TOOL_OPS) -> Problem:
    """One tier-``tool`` problem: an operation from ``ops`` and one of its phrasings, chosen uniformly."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    op = ops[r(0, len(ops) - 1)]
    fields, answer, code, key = _tool_operands(op, r)
    template = r(0, len(TOOL_TEMPLATES[op]) - 1)
    return Problem(TOOL_TEMPLATES[op][template].format(**fields), answer, code, key, op, template)


# ---------------------------------------------------------------------------------------------- tier "compute"
def compute_problem(rng: np.random.Generator) -> Problem:
    """One problem whose answer needs a short program (tier ``compute``)."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    kind = r(0, 5)
    if kind == 0:
        n = r(2_000, 50_000)
        code = (
            f"n = {n}\nsieve = [True] * n\nsieve[0] = sieve[1] = False\n"
            "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        for j in range(i * i, n, i):\n"
            "            sieve[j] = False\nprint(sum(i for i in range(n) if sieve[i]))"
        )
        return Problem(f"What is the sum of all prime numbers less than {n}?", _prime_sum(n), code, f"prime_sum:{n}", "prime_sum", 0)
    if kind == 1:
        n, a, b = r(10_000, 1_000_000), r(3, 13), r(14, 29)
        c = int(rng.choice([2, 5, 7]))
        lcm = math.lcm
        union = n // a + n // b - n // lcm(a, b)
        count = union - (n // lcm(a, c) + n // lcm(b, c) - n // lcm(a, b, c))
        code = f"print(sum(1 for k in range(1, {n} + 1) if (k % {a} == 0 or k % {b} == 0) and k % {c} != 0))"
        return Problem(
            f"How many integers from 1 to {n} inclusive are divisible by {a} or by {b} but not by {c}?",
            count, code, f"incl_excl:{n}:{a}:{b}:{c}", "incl_excl", 0,
        )
    if kind == 2:
        a, b = r(2, 99), r(100, 5_000)
        return Problem(f"What is the remainder when {a}^{b} is divided by 10000?", pow(a, b, 10_000),
                       f"print(pow({a}, {b}, 10000))", f"mod_pow:{a}:{b}", "mod_pow", 0)
    if kind == 3:
        n = r(30, 150)
        return Problem(f"What is the sum of the digits of {n}! (the factorial of {n})?",
                       sum(map(int, str(math.factorial(n)))),
                       f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))", f"fact_digits:{n}", "fact_digits", 0)
    if kind == 4:
        n = r(10**8, 10**9)
        code = (
            f"n = {n}\ncount = 0\nd = 1\nwhile d * d <= n:\n    if n % d == 0:\n"
            "        count += 1 if d * d == n else 2\n    d += 1\nprint(count)"
        )
        return Problem(f"How many positive divisors does {n} have?", _num_divisors(n), code, f"divisors:{n}", "divisors", 0)
    n, m = r(1_000, 20_000), r(1_000, 100_000)
    code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)"
    return Problem(f"Let F(0)=0, F(1)=1 and F(k)=F(k-1)+F(k-2). What is F({n}) mod {m}?", _fib_mod(n, m), code,
                   f"fib_mod:{n}:{m}", "fib_mod", 0)


# ---------------------------------------------------------------------------------------------- tier "table"
def table_problem(rng: np.random.Generator, rows: int = 800) -> Problem:
    """A ledger of ``rows`` entries ``entry <i>: <amount>`` (4-6 digit amounts) and a question over it: the sum
    or the count of the amounts divisible by ``d`` (3-9). Long context; the program holds the whole ledger."""
    if rows < 1:
        raise ValueError(f"table_rows must be >= 1, got {rows}")
    amounts = [int(a) for a in rng.integers(1_000, 1_000_000, size=rows)]
    d = int(rng.integers(3, 10))
    count = bool(rng.random() < 0.5)
    hits = [a for a in amounts if a % d == 0]
    ledger = "\n".join(f"entry {i + 1}: {a}" for i, a in enumerate(amounts))
    what = "How many amounts" if count else "What is the sum of the amounts that"
    prompt = f"Here is a ledger of {rows} entries, one per line:\n{ledger}\n{what} are divisible by {d}?"
    code = f"amounts = {amounts}\nprint({'len' if count else 'sum'}([a for a in amounts if a % {d} == 0]))"
    digest = zlib.crc32(" ".join(map(str, amounts)).encode())
    op = "table_count" if count else "table_sum"
    return Problem(prompt, len(hits) if count else sum(hits), code, f"{op}:{rows}:{d}:{digest:08x}", op, 0)


def make_problem(
    rng: np.random.Generator, tier: str = "tool", split: str | None = None, table_rows: int = 800
) -> Problem:
    """One problem of ``tier`` (see the module docstring). With ``split`` (``"train"`` or ``"test"``) the
    problem's key belongs to that split (problems of the other split are redrawn). ``table_rows``: the ledger's
    length in tier ``table``."""
    if tier not in TIERS:
        raise ValueError(f"unknown retool tier {tier!r}; valid: {', '.join(TIERS)}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for _ in range(10_000):
        pick = tier if tier != "mixed" else ("tool" if rng.random() < 0.5 else "compute")
        if pick == "table":
            problem = table_problem(rng, table_rows)
        else:
            problem = tool_problem(rng) if pick == "tool" else compute_problem(rng)
        if split is None or split_of(problem.key) == split:
            return problem
    raise RuntimeError(f"could not draw a {split} problem of tier {tier!r}")  # pragma: no cover - 1e-450


class ReToolEnv(AgentEnv):
    """Multi-turn math with a python tool.

    Args:
        sandbox: a :class:`~agentrl.envs.sandbox.SandboxBackend` (not closed by the env) or a backend name
            (``"local"``, ``"sandboxfusion"``, ``"e2b"``): envs on the same event loop naming the same backend
            and ``sandbox_kwargs`` share one, created on first use and closed with the last of them.
        exec_timeout_s: per-run limit inside the sandbox.
        sandbox_kwargs: passed to :func:`~agentrl.envs.sandbox.make_backend` (e.g. ``{"workers": 4}``).
        tier: the offline generator's difficulty tier for episodes started without a task (see the module
            docstring): ``tool`` (default), ``compute``, ``mixed`` or ``table``.
        table_rows: the ledger's length in tier ``table``.
        closeness: weight of the dense ``closeness`` shaping component (0: off; see the module docstring).
        **kwargs: :class:`~agentrl.envs.AgentEnv` arguments (``format``, ``tasks``, ``limits``...).

    Reward components: ``correct`` (math-verify equality of the final answer and ``task["answer"]``), and
    with ``closeness > 0`` also ``closeness``.
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
        tier: str = "tool",
        table_rows: int = 800,
        closeness: float = 0.0,
        **kwargs: Any,
    ):
        if tier not in TIERS:
            raise ValueError(f"unknown retool tier {tier!r}; valid: {', '.join(TIERS)}")
        if closeness < 0:
            raise ValueError(f"closeness is a reward weight and must be >= 0, got {closeness}")
        self.tier = tier
        self.table_rows = int(table_rows)
        self.closeness = float(closeness)
        self._sandbox = sandbox
        self._exec_timeout_s = exec_timeout_s
        self._sandbox_kwargs = dict(sandbox_kwargs or {})
        super().__init__(**kwargs)

    def make_tools(self) -> list[Tool]:
        return [PythonTool(self._sandbox, exec_timeout_s=self._exec_timeout_s, **self._sandbox_kwargs)]

    @classmethod
    def generate_task(
        cls, rng: np.random.Generator, split: str = "train", tier: str = "tool", table_rows: int = 800
    ) -> dict[str, Any]:
        """A task of ``tier`` from ``split`` (the splits are disjoint by problem key, paraphrases included)."""
        p = make_problem(rng, tier, split, table_rows)
        return {
            "id": f"{p.op}-{zlib.crc32(p.key.encode()):08x}-{p.template}",
            "prompt": p.prompt,
            "answer": str(p.answer),
            "key": p.key,
            "op": p.op,
            "template": p.template,
            "tier": tier,
            "code": p.code,
        }

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        return self.generate_task(rng, "train", self.tier, self.table_rows)

    def reward(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        """The rubric's ``correct``, plus ``closeness`` (weighted by :attr:`closeness`) when shaping is on."""
        total, components = super().reward(ctx)
        if self.closeness:
            traj = ctx.trajectory
            written = ctx.final
            if written is None:  # no final answer: whatever the model wrote, parsed or not
                written = self.format.decode([t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m])
            components["closeness"] = answer_closeness(written, str(ctx.task["answer"]))
            total += self.closeness * components["closeness"]
        return total, components

    @classmethod
    def scripted_teacher(cls) -> ReToolScriptedTeacher:
        return ReToolScriptedTeacher()

    @classmethod
    def load_tasks(cls, path: str) -> list[dict[str, Any]]:
        return load_math(path)

    @staticmethod
    def hub_tasks(
        repo: str = "BytedTsinghua-SIA/DAPO-Math-17k", split: str = "train"
    ) -> list[dict[str, Any]]:
        """DAPO-Math-17k (or any ``{problem, answer}`` dataset) from the HF hub; needs network."""
        return [math_row_to_task(r, i) for i, r in enumerate(load_hf_rows(repo, split))]


class ReToolScriptedTeacher:
    """The scripted retool teacher, an :class:`agentrl.episodes.Policy`: one python call with the task's
    program, then the boxed tool output.

    Turn 1: a call of the env's ``python`` tool with ``task["code"]`` (tasks from the retool generator and the
    arithmetic task source carry it; other tasks raise :class:`~agentrl.envs.env.TeacherError`), written the
    way the student's format writes a call (``format.render_completion``). Turn 2: ``The answer is
    \\boxed{<last line of the tool output>}.``, read from the env's own record of turn 1's tool call. A program
    that fails makes a wrong demonstration, which the default filter (correct episodes only) drops.
    Stateless: one instance serves any number of concurrent episodes.
    """

    name = "scripted"

    def __init__(self, answer_template: str = "The answer is \\boxed{{{output}}}.") -> None:
        self.answer_template = answer_template

    async def act(self, episode: Any) -> list[list[int]]:
        env, task = episode.env, episode.task
        results = [rec for step in episode.steps for rec in step.turn.tools]
        if not results:
            code = task.get("code")
            if not code:
                raise TeacherError(
                    f"task {task.get('id')!r} has no 'code'; the scripted retool teacher solves generated retool "
                    "tasks only (use an endpoint teacher, teacher=http://..., for other tasks)"
                )
            return [list(env.format.render_completion([_python_call(env, code)]))]
        lines = results[-1].result.strip().splitlines() or [""]
        answer = self.answer_template.format(output=lines[-1].strip())
        return [list(env.format.render_completion([Message("assistant", answer, channel="final")]))]


def _python_call(env: AgentEnv, code: str) -> Message:
    """An assistant message calling ``env``'s python tool with ``code``: free-text code in the analysis channel
    for the Harmony built-in, JSON arguments in the commentary channel for a function tool."""
    spec = next((s for s in env.toolbox.specs if s.name == "python"), None)
    if spec is None:
        raise TeacherError(f"{type(env).__name__} has no python tool; the scripted retool teacher needs one")
    if spec.namespace != "functions":
        return Message("assistant", code, channel="analysis", recipient=spec.recipient, content_type="code")
    return Message("assistant", json.dumps({"code": code}), channel="commentary", recipient="functions.python",
                   content_type="json")
