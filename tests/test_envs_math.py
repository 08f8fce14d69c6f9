"""gsm8k and retool envs: real data files, real Harmony tokens, the real local code sandbox."""

from __future__ import annotations

import asyncio

import pytest
from _fixtures import local_sandbox
from gymnasium.utils.env_checker import check_env

from agentrl.envs.builtin.gsm8k import GSM8KEnv
from agentrl.envs.builtin.retool import ReToolEnv, make_problem
from agentrl.envs.rewards import extract_boxed, math_equal, numeric_equal
from agentrl.harmony import default_format
from agentrl.harmony.types import Message


@pytest.fixture(scope="module")
def fmt():
    return default_format()


def final(fmt, text, analysis=None):
    msgs = [Message("assistant", analysis, channel="analysis")] if analysis else []
    return fmt.render_completion([*msgs, Message("assistant", text, channel="final")])


def py(fmt, code):
    return fmt.render_completion([Message("assistant", code, channel="analysis", recipient="python")])


def test_math_verifiers():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed("none") is None
    assert numeric_equal("The total is $1,234.", "1234") and not numeric_equal("1235", "1234")
    assert math_equal(r"\boxed{0.5}", r"\frac{1}{2}")
    assert math_equal(r"the answer is \boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}")
    assert not math_equal(r"\boxed{3}", "4") and not math_equal(None, "4") and not math_equal("", "4")


def test_gsm8k_real_data_correct_wrong_and_malformed(fmt):
    tasks = GSM8KEnv.tasks(path="gsm8k", n=3)  # the GSM8K test split shipped in agentrl.data
    assert tasks[0]["answer"] == "18" and tasks[0]["prompt"].startswith("Janet")
    env = GSM8KEnv(tasks=tasks)
    for text, want in [(r"She makes \boxed{18} dollars.", 1.0), ("18", 1.0), (r"\boxed{20}", 0.0)]:
        env.reset(options={"task": tasks[0]})
        obs, r, term, trunc, info = env.step(final(fmt, text, analysis="16-3-4=9, 9*2=18"))
        assert (r, term, trunc) == (want, True, False)
        assert len(obs["tokens"]) == 0
    for bad in (fmt.encode("18"), []):  # cut before a stop token, empty: the episode is truncated
        env.reset(options={"task": tasks[0]})
        obs, r, term, trunc, info = env.step(bad)
        assert (r, term, trunc) == (0.0, False, True) and info["trajectory"].truncated
    env.reset(options={"task": tasks[0]})
    obs, r, term, trunc, info = env.step(py(fmt, "print(18)"))  # a call in a tool-less env
    assert (r, term, trunc) == (0.0, True, False) and info["trajectory"].terminated


def test_gsm8k_generator_and_check_env():
    tasks = GSM8KEnv.tasks(n=20, seed=0)
    assert all(t["answer"].lstrip("-").isdigit() for t in tasks)
    check_env(GSM8KEnv(), skip_render_check=True)


def test_retool_generator_answers_are_computed():
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(12):
        p = make_problem(rng, "compute")
        assert isinstance(p.answer, int) and p.prompt.endswith("?") and p.key and p.code
    assert ReToolEnv.tasks(n=3, seed=1) == ReToolEnv.tasks(n=3, seed=1)
    assert ReToolEnv.tasks(n=3, seed=1, tier="compute") != ReToolEnv.tasks(n=3, seed=1)


def test_retool_loads_aime_and_math500():
    tasks = ReToolEnv.tasks(path="aime2024", n=30)
    assert len(tasks) == 30 and tasks[0]["answer"] == "204" and "Aya" in tasks[0]["prompt"]
    math500 = ReToolEnv.tasks(path="math500", n=1000)
    assert len(math500) == 500 and all(t["prompt"] and t["answer"] for t in math500)


@pytest.fixture
async def sandbox():
    async with local_sandbox(workers=1) as sb:
        yield sb


async def test_retool_episode_with_real_sandbox(fmt, sandbox):
    env = ReToolEnv(sandbox=sandbox, exec_timeout_s=2.0)
    task = {"id": "t", "prompt": "What is the sum of all primes below 100?", "answer": "1060"}
    obs, info = await env.areset(options={"task": task})
    assert "python" in fmt.decode(obs["tokens"])
    obs, r, term, trunc, info = await env.astep(
        py(fmt, "p = [n for n in range(2, 100) if all(n % d for d in range(2, n))]")
    )
    assert not term and info["errors"] == []
    obs, r, term, trunc, info = await env.astep(py(fmt, "sum(p)"))  # state persists within the episode
    assert obs["messages"][0].content == "1060" and obs["messages"][0].name == "python"
    obs, r, term, trunc, info = await env.astep(py(fmt, "1/0"))
    assert "ZeroDivisionError" in obs["messages"][0].content and info["errors"] == []
    obs, r, term, trunc, info = await env.astep(py(fmt, "while True: pass"))
    assert info["errors"] == ["tool_timeout"] and "timeout" in obs["messages"][0].content
    obs, r, term, trunc, info = await env.astep(final(fmt, r"The sum is \boxed{1060}."))
    assert (r, term) == (1.0, True)
    assert info["trajectory"].reward_components == {"correct": 1.0}
    # A new episode gets a fresh session: `p` is gone.
    await env.areset(options={"task": task})
    obs, *_ = await env.astep(py(fmt, "p"))
    assert "NameError" in obs["messages"][0].content
    obs, r, term, trunc, info = await env.astep(final(fmt, r"\boxed{1061}"))
    assert (r, term) == (0.0, True)
    await env.aclose()
    await env.aclose()


async def test_retool_malformed_actions(fmt, sandbox):
    env = ReToolEnv(sandbox=sandbox)
    await env.areset(seed=0)
    for ids, kind in [
        (fmt.encode("cut off"), "truncation"),
        (
            fmt.render_completion(
                [Message("assistant", "{}", channel="commentary", recipient="functions.nope")]
            ),
            "unknown_tool",
        ),
        (fmt.encode("plain text") + [fmt.stop_token_ids[0]], "parse_error"),
    ]:
        obs, r, term, trunc, info = await env.astep(ids)
        assert not (term or trunc) and kind in info["errors"]
    await env.aclose()


def test_retool_check_env():
    # The backend is created on the first python call, in the env's own loop (random actions make none).
    check_env(ReToolEnv(sandbox="local"), skip_render_check=True)


SOLVERS = {  # brute-force programs, independent of the generator's formulas, run in the sandbox
    "sum of all prime": "n={0}\nprint(sum(k for k in range(2, n) if all(k % d for d in range(2, int(k**0.5) + 1))))",
    "divisible by": "n,a,b,c={1},{2},{3},{4}\nprint(sum(1 for k in range(1, n + 1) if (k % a == 0 or k % b == 0) and k % c))",
    "remainder when": "print({0}**{1} % 10000)",
    "sum of the digits": "import math\nprint(sum(int(ch) for ch in str(math.factorial({0}))))",
    "positive divisors": "n={0}\nprint(sum(2 if d * d != n else 1 for d in range(1, int(n**0.5) + 1) if n % d == 0))",
    "F(0)=0": "a, b = 0, 1\nfor _ in range({6}): a, b = b, a + b\nprint(a % {7})",
}


async def test_retool_generated_answers_match_independent_programs(fmt, sandbox):
    import re

    env = ReToolEnv(sandbox=sandbox, exec_timeout_s=20)
    seen = set()
    for task in ReToolEnv.tasks(n=40, seed=11, tier="compute"):
        key = next(k for k in SOLVERS if k in task["prompt"])
        if key in seen:
            continue
        seen.add(key)
        nums = re.findall(r"\d+", task["prompt"])
        await env.areset(options={"task": task})
        obs, *_ = await env.astep(py(fmt, SOLVERS[key].format(*nums)))
        out = obs["messages"][0].content.strip()
        _, r, term, *_ = await env.astep(final(fmt, rf"\boxed{{{out}}}"))
        assert (r, term) == (1.0, True), (task, out)
    assert len(seen) == len(SOLVERS)
    await env.aclose()


async def test_retool_envs_share_a_named_backend(fmt):
    from agentrl.envs.tools import python as pytool

    envs = [ReToolEnv(sandbox="local", sandbox_kwargs={"workers": 1}) for _ in range(3)]
    try:
        for e in envs:
            await e.areset(options={"task": {"prompt": "1+1?", "answer": "2"}})
            obs, _, _, _, info = await e.astep(py(fmt, "1 + 1"))
            if info.get("stop_reason") == "infrastructure":  # no sandbox on this machine
                pytest.skip(info["infrastructure_error"])
            assert obs["messages"][0].content == "2"
        backends = {id(e.toolbox.tools["python"]._backend) for e in envs}
        assert len(backends) == 1
        (entry,) = pytool._SHARED[asyncio.get_running_loop()].values()
        assert entry[1] == 3
    finally:
        for e in envs:
            await e.aclose()
    assert not pytool._SHARED[asyncio.get_running_loop()]


def test_task_files_jsonl_parquet_and_dapo_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from agentrl.envs.tasks import load_math, load_task_file

    rows = [
        {"problem": "1+1?", "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}},  # DAPO-Math
    ]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "a.parquet")
    assert load_math(tmp_path / "a.parquet") == [{"id": 0, "prompt": "1+1?", "answer": "2"}]
    (tmp_path / "b.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows))
    assert [t["answer"] for t in load_math(tmp_path / "b.jsonl")] == ["2", "4"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_task_file(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_math(tmp_path / "missing.jsonl")
    (tmp_path / "odd.jsonl").write_text('{"text": "no math fields"}\n')
    with pytest.raises(ValueError, match="expected .problem, answer"):
        load_math(tmp_path / "odd.jsonl")
