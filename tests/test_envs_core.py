"""AgentEnv, the tool API and the registry, driven by scripted policies that emit real Harmony tokens."""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import EntryPoint
from typing import Literal

import gymnasium
import numpy as np
import pytest
from _no_torch import check_imports_without_torch
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.engines.base import Completion
from agentrl.envs import AgentEnv, EnvLimits, Rubric, StatefulTool, ToolError, tool
from agentrl.envs import registry as reg
from agentrl.envs.rewards import ExactMatch
from agentrl.envs.rewards.common import ChannelToolCallCount, ErrorCount
from agentrl.envs.tools import Sessions, ToolBox
from agentrl.harmony import default_format
from agentrl.harmony.types import Message, ToolCall

#: every kind of error an episode counts
ERROR_KINDS = {"parse_error", "truncation", "unknown_tool", "bad_arguments", "tool_timeout", "tool_exception"}


@pytest.fixture(scope="module")
def fmt():
    return default_format()


def call(fmt, name: str, args: str, channel: str = "commentary") -> list[int]:
    """Harmony ids of a function call, as a model would sample them after ``<|start|>assistant``."""
    return fmt.render_completion(
        [Message("assistant", args, channel=channel, recipient=f"functions.{name}", content_type="json")]
    )


def final(fmt, text: str, analysis: str | None = None) -> list[int]:
    msgs = [Message("assistant", analysis, channel="analysis")] if analysis else []
    return fmt.render_completion([*msgs, Message("assistant", text, channel="final")])


# ----------------------------------------------------------------------------- tools
@tool
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend,
            may be omitted
    """
    return a + b


@tool(timeout_s=0.2)
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


@tool
def boom(mode: Literal["value", "tool"]) -> str:
    """Fail on purpose."""
    if mode == "tool":
        raise ToolError("mode 'tool' is not allowed here; use 'value'", "bad_arguments")
    raise ValueError("kaboom")


@tool
def big() -> str:
    """A huge result."""
    return "x" * 50_000


class Counter(StatefulTool):
    """A per-episode counter (stateful tool)."""

    name = "count"
    description = "Increment and return this episode's counter."
    parameters = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.created = self.released = 0

    async def create_session(self):
        self.created += 1
        return {"n": 0}

    async def call(self, arguments, session=None):
        session["n"] += 1
        return str(session["n"])

    async def release_session(self, session):
        self.released += 1


class AddEnv(AgentEnv):
    """Answer a+b; tools add/slow/boom/big/count."""

    instructions = "Use the tools, then answer with the number."
    default_limits = EnvLimits(max_turns=6, max_tool_calls=5, max_tool_result_chars=1000)
    rubric = Rubric([(ExactMatch(), 1.0), (ChannelToolCallCount("analysis"), -0.5), (ErrorCount(), -0.1)])

    def make_tools(self):
        self.counter = Counter()
        return [add, slow, boom, big, self.counter]

    @classmethod
    def generate_task(cls, rng, split="train"):
        a, b = (int(x) for x in rng.integers(0, 100, size=2))
        return {"id": f"{a}+{b}", "prompt": f"What is {a}+{b}?", "answer": str(a + b), "a": a, "b": b}


def test_tool_schema_from_hints_and_docstring():
    assert add.name == "add" and add.description == "Add two integers."
    p = add.parameters
    assert p["required"] == ["a"]
    assert p["properties"]["a"] == {"type": "integer", "description": "first addend"}
    assert p["properties"]["b"]["default"] == 0
    assert p["properties"]["b"]["description"] == "second addend, may be omitted"
    assert boom.parameters["properties"]["mode"]["enum"] == ["value", "tool"]
    assert add(2, 3) == 5
    spec = add.spec()
    assert spec.recipient == "functions.add"


async def test_toolbox_error_taxonomy():
    box = ToolBox([add, slow, boom, big], max_result_chars=100)
    s = Sessions()

    def c(name, args):
        return ToolCall(
            recipient=f"functions.{name}", name=name, arguments=args, raw_arguments=json.dumps(args)
        )

    assert (await box.call(c("add", {"a": 1, "b": 2}), s)).result == "3"
    r = await box.call(c("nope", {}), s)
    assert r.error == "unknown_tool" and "functions.add" in r.result
    r = await box.call(ToolCall("browser.add", "add", {"a": 1}, '{"a": 1}'), s)  # right name, wrong namespace
    assert r.error == "unknown_tool"
    assert (await box.call(ToolCall("add", "add", {"a": 1}, '{"a": 1}'), s)).result == "1"
    r = await box.call(c("add", {"a": "x"}), s)
    assert r.error == "bad_arguments" and "a:" in r.result
    r = await box.call(c("add", {"a": 1, "zzz": 2}), s)
    assert r.error == "bad_arguments"
    r = await box.call(ToolCall("functions.add", "add", None, '{"a": 1'), s)  # type: ignore[arg-type]
    assert r.error == "bad_arguments" and "JSON object" in r.result
    r = await box.call(c("slow", {"seconds": 30}), s)
    assert r.error == "tool_timeout" and "0.2 s" in r.result
    r = await box.call(c("boom", {"mode": "value"}), s)
    assert r.error == "tool_exception" and "ValueError: kaboom" in r.result
    r = await box.call(c("boom", {"mode": "tool"}), s)
    assert r.error == "bad_arguments" and "use 'value'" in r.result
    r = await box.call(c("big", {}), s)
    assert r.error is None and r.result.endswith("[... truncated 49900 characters]")


async def test_toolbox_runs_calls_concurrently():
    gate = asyncio.Event()

    @tool
    async def wait_gate() -> str:
        """Wait until the other call opens the gate."""
        await gate.wait()
        return "passed"

    @tool
    async def open_gate() -> str:
        """Open the gate."""
        gate.set()
        return "opened"

    box = ToolBox([wait_gate, open_gate], timeout_s=5)
    calls = [ToolCall(f"functions.{n}", n, {}, "{}") for n in ("wait_gate", "open_gate")]
    records = await box.call_many(calls, Sessions())
    assert [r.result for r in records] == ["passed", "opened"]


def test_correct_episode_with_tool_and_logprobs(fmt):
    env = AddEnv()
    obs, info = env.reset(seed=3)
    task = info["task"]
    assert obs["tokens"].dtype == np.int64 and obs["tokens"].tolist() == env.trajectory.prompt_ids
    assert fmt.decode(obs["tokens"][-2:]) == "<|start|>assistant"
    prompt = fmt.decode(obs["tokens"])
    developer = prompt[prompt.index("<|start|>developer") : prompt.index("<|start|>user")]
    assert "namespace functions" in developer and "type add = (_: {" in developer  # tools in the developer message
    assert "// first addend" in developer and "Use the tools, then answer" in developer
    ids = call(fmt, "add", json.dumps({"a": task["a"], "b": task["b"]}))
    comp = Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
    obs, r, term, trunc, info = env.step(comp)
    assert (r, term, trunc) == (0.0, False, False)
    assert obs["messages"][0].role == "tool" and obs["messages"][0].content == task["answer"]
    assert fmt.decode(obs["tokens"]).endswith("<|start|>assistant")
    obs, r, term, trunc, info = env.step(final(fmt, task["answer"], analysis="The tool said so."))
    assert (r, term, trunc) == (1.0, True, False)
    traj = info["trajectory"]
    traj.validate()
    assert traj is env.trajectory and traj.reward == 1.0
    assert traj.reward_components == {"exact_match": 1.0, "tool_calls_in_analysis": 0.0, "errors": 0.0}
    assert traj.rollout_logprobs[: len(ids)] == [-0.5] * len(ids)
    t0 = traj.turns[0]
    assert traj.response_ids[slice(*t0.model_span)] == ids and set(
        traj.response_mask[slice(*t0.model_span)]
    ) == {1}
    assert set(traj.response_mask[slice(*t0.env_span)]) == {0}
    assert t0.tools[0].name == "add" and t0.tools[0].error is None
    # The token stream is exact: prompt + response decodes to a well-formed Harmony conversation.
    text = fmt.decode(traj.prompt_ids + traj.response_ids)
    assert text.count("<|call|>") == 1 and text.endswith("<|return|>")
    assert json.loads(traj.to_json())["reward"] == 1.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step(final(fmt, "1"))
    env.close()
    env.close()


def test_every_malformed_action_becomes_an_observation(fmt):
    env = AddEnv(max_turns=20, max_tool_calls=20)
    env.reset(seed=0)
    cases = {
        "parse_error": fmt.encode("no harmony structure at all") + [fmt.stop_token_ids[0]],
        "truncation": fmt.encode("I was cut off mid sent"),
        "unknown_tool": call(fmt, "nope", "{}"),
        "bad_arguments": call(fmt, "add", '{"a": 1'),  # invalid JSON
        "tool_timeout": call(fmt, "slow", '{"seconds": 30}'),
        "tool_exception": call(fmt, "boom", '{"mode": "value"}'),
    }
    for kind, ids in cases.items():
        obs, r, term, trunc, info = env.step(ids)
        assert not term and not trunc, kind
        assert kind in info["errors"], (kind, info["errors"])
        assert len(obs["tokens"]) > 0 and obs["messages"], kind
        assert "rror" in obs["messages"][0].content or "could not be used" in obs["messages"][0].content
    obs, r, term, trunc, info = env.step(call(fmt, "add", '{"a": "one"}'))  # schema violation
    assert info["errors"] == ["bad_arguments"]
    obs, r, term, trunc, info = env.step(call(fmt, "add", '{"a": 1}', channel="analysis"))
    assert info["errors"] == ["parse_error"] and obs["messages"][0].name == "functions.add"
    rng = np.random.default_rng(0)
    obs, r, term, trunc, info = env.step(rng.integers(0, fmt.vocab_size, size=40))  # random garbage
    assert not term and not trunc
    obs, r, term, trunc, info = env.step(final(fmt, env.task["answer"]))
    assert term and r < 1.0  # right answer minus the error penalty
    counts = info["trajectory"].errors
    assert ERROR_KINDS <= set(counts)
    assert info["reward_components"]["exact_match"] == 1.0 and info["reward_components"]["errors"] == sum(
        counts.values()
    )
    records = [t for turn in info["trajectory"].turns for t in turn.tools]
    assert {t.error for t in records} >= {"unknown_tool", "tool_timeout", "tool_exception", "bad_arguments"}
    env.close()


def test_wrong_answer_scores_zero_and_text_actions_work(fmt):
    env = AddEnv()
    env.reset(seed=1)
    obs, r, term, trunc, info = env.step("<|channel|>final<|message|>-1<|return|>")
    assert term and r == 0.0 and env.trajectory.turns[0].parsed.final == "-1"
    env.close()


def test_limits_truncate(fmt):
    env = AddEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step(call(fmt, "add", '{"a": 1}'))[2:4] == (False, False)
    obs, r, term, trunc, info = env.step(call(fmt, "add", '{"a": 1}'))
    assert (
        trunc
        and not term
        and len(obs["tokens"]) == 0
        and "trajectory" in info
        and info["trajectory"].truncated
    )

    env = AddEnv(max_tool_calls=1)
    env.reset(seed=0)
    env.step(call(fmt, "add", '{"a": 1}'))
    assert env.step(call(fmt, "add", '{"a": 1}'))[3] is True

    env = AddEnv(max_total_tokens=len(env.trajectory.prompt_ids) + 30)
    env.reset(seed=0)
    assert env.step(call(fmt, "add", '{"a": 1}'))[3] is True
    with pytest.raises(TypeError, match="max_turnz"):
        AddEnv(max_turnz=3)


def test_stateful_sessions_are_per_episode(fmt):
    env = AddEnv()
    env.reset(seed=0)
    assert env.step(call(fmt, "count", "{}"))[0]["messages"][0].content == "1"
    assert env.step(call(fmt, "count", "{}"))[0]["messages"][0].content == "2"
    env.reset(seed=0)
    assert env.counter.released == 1
    assert env.step(call(fmt, "count", "{}"))[0]["messages"][0].content == "1"
    env.step(final(fmt, "0"))
    assert (env.counter.created, env.counter.released) == (2, 2)
    env.close()


def test_logprob_length_mismatch_is_a_clear_error(fmt):
    env = AddEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="log-probs"):
        env.step(Completion(token_ids=[1, 2, 3], logprobs=[0.0], finish_reason="length"))
    env.close()


async def test_async_api_runs_many_episodes_concurrently(fmt):
    envs = [AddEnv() for _ in range(8)]

    async def episode(i, env):
        obs, info = await env.areset(seed=i)
        t = info["task"]
        await env.astep(call(fmt, "add", json.dumps({"a": t["a"], "b": t["b"]})))
        _, r, term, _, _ = await env.astep(final(fmt, t["answer"]))
        await env.aclose()
        return r, term

    assert await asyncio.gather(*(episode(i, e) for i, e in enumerate(envs))) == [(1.0, True)] * 8
    with pytest.raises(RuntimeError, match="await env.areset"):
        AddEnv().reset()


def test_check_env_passes_for_custom_env():
    check_env(AddEnv(), skip_render_check=True)


def test_tasks_api_is_deterministic():
    a = AddEnv.tasks("train", n=5, seed=1)
    assert a == AddEnv.tasks("train", n=5, seed=1) and a != AddEnv.tasks("test", n=5, seed=1)
    env = AddEnv(tasks=a[:1])
    assert env.reset()[1]["task"] == a[0]
    assert env.reset(options={"task": a[3]})[1]["task"] == a[3]


def test_registry_make_and_entry_points(monkeypatch):
    assert {"gsm8k", "retool", "verifyif", "jobs"} <= set(reg.registered())
    assert {"agentrl/GSM8K-v0", "agentrl/ReTool-v0", "agentrl/VerifyIF-v0", "agentrl/Jobs-v0"} <= set(
        gymnasium.registry
    )
    env = agentrl.make("gsm8k", max_total_tokens=4096)
    assert type(env).__name__ == "GSM8KEnv" and env.limits.max_total_tokens == 4096
    env.close()
    ep = EntryPoint(name="addenv", value=f"{__name__}:AddEnv", group=reg.ENTRY_POINT_GROUP)
    monkeypatch.setattr(reg, "entry_points", lambda group: [ep] if group == reg.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(reg, "_discovered", False)
    assert isinstance(agentrl.make("addenv"), AddEnv)
    g = gymnasium.make("agentrl/addenv-v0")
    assert isinstance(g.unwrapped, AddEnv)
    g.close()
    with pytest.raises(KeyError, match="registered envs"):
        agentrl.make("no-such-env")


def test_envs_import_without_torch():
    check_imports_without_torch(["agentrl.envs", "agentrl.envs.builtin.gsm8k", "agentrl.envs.builtin.retool",
                                 "agentrl.envs.builtin.verifyif", "agentrl.envs.builtin.jobs.env",
                                 "agentrl.envs.tools.search", "agentrl.envs.tools.openapi"])


@pytest.mark.parametrize(
    "gym_id", ["agentrl/GSM8K-v0", "agentrl/ReTool-v0", "agentrl/VerifyIF-v0", "agentrl/Jobs-v0"]
)
def test_check_env_passes_for_every_builtin(gym_id):
    """Full check_env, including the render and close checks that need ``env.spec`` (set by gymnasium.make)."""
    env = gymnasium.make(gym_id)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()


def test_unrenderable_tool_message_falls_back_to_a_user_note(fmt):
    from agentrl.harmony import HarmonyFormat

    class EmptyRecipientFormat(HarmonyFormat):
        """Parses calls with an empty recipient, which a Harmony tool message cannot be written from."""

        def parse(self, completion_ids, **kw):
            parsed = super().parse(completion_ids, **kw)
            for c in parsed.tool_calls:
                c.recipient = ""
            return parsed

    env = AddEnv(format=EmptyRecipientFormat(fmt.encoding))
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(call(fmt, "add", '{"a": 2}'))
    assert not (term or trunc) and obs["messages"][0].role == "user" and obs["messages"][0].content == "2"
    env.close()


def _action_strategy():
    from hypothesis import strategies as st

    specials = list(range(200000, 200019))  # Harmony's special tokens, so headers/stops appear often
    pieces = st.one_of(
        st.lists(st.sampled_from(specials), min_size=1, max_size=3),
        st.lists(st.integers(0, 201087), max_size=8),
        st.sampled_from(
            [
                default_format().encode("to=functions.add"),
                default_format().encode('{"a": 1}'),
                default_format().encode("<|channel|>final<|message|>"),
            ]
        ),
    )
    return st.lists(pieces, max_size=6).map(lambda ps: [t for p in ps for t in p])


def test_random_actions_never_raise_and_keep_invariants():
    from _profiles import examples
    from hypothesis import given, settings
    from hypothesis import strategies as st

    env = AddEnv(max_turns=4, tool_timeout_s=1.0)

    @settings(max_examples=examples(60))
    @given(st.lists(_action_strategy(), min_size=1, max_size=4))
    def run(actions):
        env.reset(seed=0)
        for ids in actions:
            obs, r, term, trunc, info = env.step(ids)
            assert obs in env.observation_space and isinstance(r, float)
            assert set(info["errors"]) <= ERROR_KINDS
            if term or trunc:
                break
        t = env.trajectory
        t.validate()
        for turn in t.turns:
            assert set(t.response_mask[slice(*turn.model_span)]) <= {1}
            assert set(t.response_mask[slice(*turn.env_span)]) <= {0}

    run()
    env.close()


def test_docstring_sections_in_any_order():
    from agentrl.envs.tools.function import parse_docstring

    doc = """Find things.

    More detail here.

    Returns:
        a list
    Args:
        query (str): what to find,
            across lines
        k: how many
    Raises:
        ValueError: never
    """
    desc, params = parse_docstring(doc)
    assert desc == "Find things.\n\nMore detail here."
    assert params == {"query": "what to find, across lines", "k": "how many"}
    assert parse_docstring("Just a line.") == ("Just a line.", {})
