"""retool's difficulty tiers: the tool tier's problems, answers and programs, and held-out disjointness
(by problem, so paraphrases of a held-out problem never reach training)."""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import numpy as np
import pytest

from agentrl.envs.builtin.retool import TIERS, TOOL_OPS, TOOL_TEMPLATES, ReToolEnv, make_problem, split_of
from agentrl.envs.task_source import TaskSource, task_identity


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # noqa: S102 - the generator's own programs
    return out.getvalue().strip()


def test_tool_tier_covers_every_operation_and_phrasing_and_programs_print_the_answer():
    rng = np.random.default_rng(0)
    seen = Counter()
    for _ in range(600):
        p = make_problem(rng, "tool")
        seen[(p.op, p.template)] += 1
        assert _run(p.code) == str(p.answer), p
        assert p.key.startswith(p.op + ":") and str(p.answer) not in p.prompt.split()
    assert {op for op, _ in seen} == set(TOOL_OPS)
    assert len(seen) == sum(len(t) for t in TOOL_TEMPLATES.values())  # every phrasing occurs
    rng = np.random.default_rng(1)
    for tier in TIERS:
        assert make_problem(rng, tier).prompt
    with pytest.raises(ValueError, match="unknown retool tier 'hard'; valid: tool, compute, mixed, table"):
        make_problem(rng, "hard")
    with pytest.raises(ValueError, match="unknown retool tier"):
        ReToolEnv(tier="nope")


def test_answers_need_exact_computation():
    """The tool tier's answers are big exact numbers (not guessable): at least 5 digits, mostly many more."""
    rng = np.random.default_rng(2)
    digits = [len(str(make_problem(rng, "tool").answer)) for _ in range(300)]
    assert min(digits) >= 3 and np.median(digits) >= 7


def test_splits_are_disjoint_by_problem_whatever_the_phrasing():
    for tier in TIERS:
        test = ReToolEnv.tasks("test", n=200, seed=0, tier=tier, table_rows=5)
        train = ReToolEnv.tasks("train", n=2000, seed=0, tier=tier, table_rows=5)
        assert all(split_of(t["key"]) == "test" for t in test)
        assert all(split_of(t["key"]) == "train" for t in train)
        assert not {t["key"] for t in test} & {t["key"] for t in train}


def test_task_source_never_trains_on_a_held_out_problem():
    src = TaskSource(ReToolEnv, "env", seed=0, num_held_out=128, generator_kwargs={"tier": "tool"})
    held = src.held_out()
    assert len(held) == 128 and len({task_identity(t) for t in held}) == 128
    keys = {t["key"] for t in held}
    assert not keys & {src.train(i)["key"] for i in range(1500)}
    assert src.train(7) == TaskSource(ReToolEnv, "env", seed=0, num_held_out=128, generator_kwargs={"tier": "tool"}).train(7)


class _TinyParaphraseEnv(ReToolEnv):
    """Few problems, many phrasings, and no split by key: a training draw often is a paraphrase of a
    held-out problem, which only the task source's exclusion by problem key can catch."""

    @classmethod
    def generate_task(cls, rng, split="train", tier="tool"):
        a, b = int(rng.integers(10, 14)), int(rng.integers(10, 12))
        template = int(rng.integers(len(TOOL_TEMPLATES["mul"])))
        prompt = TOOL_TEMPLATES["mul"][template].format(a=a, b=b)
        return {"id": f"{a}x{b}-{template}", "prompt": prompt, "answer": str(a * b), "key": f"mul:{min(a, b)}:{max(a, b)}"}


def test_paraphrases_of_held_out_problems_are_redrawn():
    src = TaskSource(_TinyParaphraseEnv, "env", seed=0, num_held_out=3)
    held = src.held_out()
    held_keys, held_prompts = {t["key"] for t in held}, {t["prompt"] for t in held}
    rng = np.random.default_rng([0, 0, 0])
    raw = [_TinyParaphraseEnv.generate_task(rng) for _ in range(300)]
    paraphrases = [t for t in raw if t["key"] in held_keys and t["prompt"] not in held_prompts]
    assert paraphrases  # the raw stream does contain rephrased held-out problems ...
    drawn = [src.train(i) for i in range(300)]
    assert not {t["key"] for t in drawn} & held_keys  # ... and training never gets one
    assert {t["key"] for t in drawn} == {t["key"] for t in raw} - held_keys  # every other problem still appears


def test_table_tier_is_long_context_and_its_programs_print_the_answer():
    rng = np.random.default_rng(3)
    ops = Counter()
    for _ in range(20):
        p = make_problem(rng, "table", table_rows=50)
        ops[p.op] += 1
        lines = p.prompt.splitlines()
        assert len(lines) == 52 and lines[1].startswith("entry 1: ") and lines[-1].endswith("?")
        assert _run(p.code) == str(p.answer) and p.key.startswith(p.op + ":50:")
    assert set(ops) == {"table_sum", "table_count"}
    from agentrl.harmony import HarmonyFormat

    env = ReToolEnv(format=HarmonyFormat(), tier="table")  # the default ledger: a prompt of about 6.5k tokens
    obs, info = env.reset(seed=0)
    env.close()
    assert 6000 < len(obs["tokens"]) < 7500 and info["task"]["tier"] == "table"


def test_closeness_shaping_rewards_the_magnitude_of_any_number_written():
    from agentrl.envs.rewards.math import answer_closeness
    from agentrl.harmony import HarmonyFormat

    assert answer_closeness("\\boxed{12345}", "12345") == 1.0
    assert answer_closeness("about 57 or so", "348271902") == pytest.approx(1 - (8.5419 - 1.7634) / 10, abs=1e-3)
    assert answer_closeness("no digits", "5") == answer_closeness("-4", "5") == answer_closeness(None, "5") == 0.0
    assert answer_closeness("1", "10**40") == 0.0  # a gold answer that is not a number

    task = {"prompt": "What is 111 * 111?", "answer": "12321"}
    env = ReToolEnv(format=HarmonyFormat(), closeness=0.5)
    env.reset(options={"task": task})
    _, reward, terminated, _, info = env.step("<|channel|>final<|message|>\\boxed{12320}<|return|>")
    assert terminated and info["reward_components"]["correct"] == 0.0
    assert 0.99 < info["reward_components"]["closeness"] < 1.0 and reward == 0.5 * info["reward_components"]["closeness"]
    env.close()
    env = ReToolEnv(format=HarmonyFormat(), closeness=0.5, max_turns=1)  # unparseable text ends at the turn limit
    env.reset(options={"task": task})
    _, reward, _, truncated, info = env.step("garbage 123 tokens")
    assert truncated and info["reward_components"]["closeness"] == pytest.approx(1 - 2 / 10, abs=0.01)
    env.close()
    with pytest.raises(ValueError, match="closeness is a reward weight"):
        ReToolEnv(closeness=-1.0)
