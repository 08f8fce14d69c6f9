"""``gsm8k``: grade-school math word problems, one turn, no tools; the reward checks the final number.

Tasks: the offline generator (arithmetic word problems with computed integer answers), a local GSM8K-format
file (``tasks=path`` or ``GSM8KEnv.tasks(path=...)``), or the hub (``GSM8KEnv.hub_tasks()``, online only).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentrl.envs.env import AgentEnv, EnvLimits
from agentrl.envs.rewards import NumericAnswer, Rubric
from agentrl.envs.tasks import gsm8k_row_to_task, load_gsm8k, load_hf_rows

INSTRUCTIONS = (
    "Solve the math word problem. Reason step by step, then give only the final number in your final "
    "answer, written as \\boxed{<number>}."
)


def _templates(rng: np.random.Generator) -> tuple[str, int]:
    """One word problem and its integer answer."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    kind = r(0, 4)
    if kind == 0:
        hens, eggs, eaten, price = r(3, 30), r(1, 3), r(1, 6), r(2, 6)
        total = hens * eggs
        eaten = min(eaten, total)
        return (
            f"A farm has {hens} hens. Each hen lays {eggs} eggs a day. The family eats {eaten} eggs a day and "
            f"sells the rest for ${price} each. How many dollars does the farm make from eggs in a week?",
            (total - eaten) * price * 7,
        )
    if kind == 1:
        boxes, per_box, broken, friends = r(2, 12), r(6, 24), r(0, 5), r(2, 6)
        good = boxes * per_box - broken
        good -= good % friends
        return (
            f"Maya buys {boxes} boxes of pencils with {per_box} pencils in each box. {broken} pencils are broken "
            f"and she throws them away. She then gives away as many as possible so that her {friends} friends each "
            f"get the same number, keeping the rest. How many pencils does each friend get?",
            good // friends,
        )
    if kind == 2:
        speed, hours, stop_km = r(40, 90), r(2, 6), r(5, 60)
        return (
            f"A train travels at {speed} km per hour for {hours} hours, then {stop_km} km more to reach the "
            f"station. How many kilometres does it travel in total?",
            speed * hours + stop_km,
        )
    if kind == 3:
        wage, hours, days, tax = r(10, 40), r(3, 9), r(2, 6), r(5, 50)
        return (
            f"Sam earns ${wage} an hour. He works {hours} hours a day for {days} days and then pays ${tax} for a "
            f"bus pass. How many dollars does he have left from his earnings?",
            wage * hours * days - tax,
        )
    price, qty, pct = r(1, 15) * 20, r(2, 9), int(rng.choice([10, 20, 25, 50]))
    return (
        f"A shirt costs ${price}. The store gives a {pct}% discount on every shirt. How many dollars do "
        f"{qty} shirts cost after the discount?",
        price * (100 - pct) // 100 * qty,
    )


class GSM8KEnv(AgentEnv):
    """Single-turn math: the first action ends the episode; reward 1.0 when the final number is right.

    Reward components: ``correct`` (last number of the final answer equals ``task["answer"]``).
    """

    instructions = INSTRUCTIONS
    eval_dataset = "gsm8k"
    single_turn = True
    default_limits = EnvLimits(max_turns=1, max_tool_calls=0)
    rubric = Rubric([NumericAnswer()])

    @classmethod
    def generate_task(cls, rng: np.random.Generator, split: str = "train") -> dict[str, Any]:
        prompt, answer = _templates(rng)
        return {"id": f"gen-{int(rng.integers(1 << 31))}", "prompt": prompt, "answer": str(answer)}

    @classmethod
    def load_tasks(cls, path: str) -> list[dict[str, Any]]:
        return load_gsm8k(path)

    @staticmethod
    def hub_tasks(split: str = "test") -> list[dict[str, Any]]:
        """GSM8K from the HF hub (``openai/gsm8k``, config ``main``); needs network."""
        return [gsm8k_row_to_task(r, i) for i, r in enumerate(load_hf_rows("openai/gsm8k", split, "main"))]
