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
    with pytest.raises(ValueError, match="unknown retool tier 'hard'; valid: tool, compute, mixed"):
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
        test = ReToolEnv.tasks("test", n=200, seed=0, tier=tier)
        train = ReToolEnv.tasks("train", n=2000, seed=0, tier=tier)
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
