"""One episode loop for every caller: the trainer's rollout, ``agentrl eval`` (completions and chat APIs),
the verl agent loop and the product ``Agent`` all run :func:`agentrl.episodes.run_episode`, so the same
scripted policy gives the same trajectory, token for token, through each of them. Also the runner's own
contract: limits, hooks, multi-action policies, failures."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from _scripted_engine import ScriptedEngine, TrainerEngine, scripted_verl_agent_loop
from _tiny_run import TINY

import agentrl.envs.registry as registry
from agentrl.engines.base import Completion, SamplingParams
from agentrl.engines.server import BackgroundServer, create_app
from agentrl.envs import AgentEnv, StatefulTool, tool
from agentrl.episodes import (
    Action,
    EnvPool,
    EpisodeJob,
    EpisodeLimits,
    TokenPolicy,
    collect,
    run_episode,
)
from agentrl.harmony import HarmonyFormat, Message, Trajectory

FMT = HarmonyFormat()
ENV = "episode-parity"
MAX_TURNS = 3
TOOL_RESULT = re.compile(r"<\|start\|>functions\.add to=assistant<\|channel\|>commentary<\|message\|>(.*?)<\|end\|>", re.S)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class ParityEnv(AgentEnv):
    """Add two numbers with a tool. ``kind`` picks the script: ``add`` (call, answer), ``ghost`` (an unknown
    tool first, then add, then answer), ``loop`` (call add until the turn limit)."""

    instructions = "Use the add tool, then answer with the sum in \\boxed{}."

    def make_tools(self):
        return [add]

    @classmethod
    def generate_task(cls, rng, split="train"):
        a, b = (int(x) for x in rng.integers(1, 99, size=2))
        kind = ["add", "ghost", "loop"][int(rng.integers(3))]
        return {"prompt": f"{kind}: {a} and {b}", "answer": str(a + b)}

    def reward(self, ctx):
        ok = ctx.final is not None and f"\\boxed{{{self.task['answer']}}}" in ctx.final
        return float(ok), {"correct": float(ok)}


def script(prompt: str, sampling: SamplingParams) -> list[Message]:
    """The scripted policy: reads the conversation so far (decoded) and returns the next assistant messages."""
    request = prompt.rsplit("<|start|>user<|message|>", 1)[1]
    kind, a, b = re.match(r"(\w+): (\d+) and (\d+)", request).groups()
    results = TOOL_RESULT.findall(prompt)
    call = json.dumps({"a": int(a), "b": int(b)})
    if kind == "ghost" and "functions.ghost" not in prompt:
        return [Message("assistant", "{}", channel="commentary", recipient="functions.ghost", content_type="json")]
    if results and kind != "loop":
        return [
            Message("assistant", "The tool answered.", channel="analysis"),
            Message("assistant", f"The sum is \\boxed{{{results[-1]}}}.", channel="final"),
        ]
    return [
        Message("assistant", f"I add {a} and {b}.", channel="analysis"),
        Message("assistant", call, channel="commentary", recipient="functions.add", content_type="json"),
    ]


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry.register(ENV, f"{__name__}:ParityEnv")


#: what each caller records about who ran an episode and how (the rest is the episode itself); ``task`` is the
#: task as the caller loaded it (a task file's loader adds an ``id``)
_CALLER_FIELDS = ("task", "task_id", "group", "sample", "policy_version", "sampling", "model", "api", "requests",
                  "latency_s", "usage", "logprobs_missing", "metadata")


def _core(traj: Trajectory) -> dict:
    """Everything a trajectory records about the episode, minus wall-clock latencies and caller bookkeeping."""
    data = traj.to_dict()
    for turn in data["turns"]:
        for rec in turn["tools"]:
            rec["latency_s"] = 0.0
    for name in _CALLER_FIELDS:
        data.pop(name)
    return data


def _trainer_trajectories(tmp_path) -> tuple[list[dict], list[Trajectory]]:
    """The held-out evaluation of a real Trainer (tiny GPT-OSS loaded, its engine swapped for the script)."""
    from agentrl.train.config import build_config
    from agentrl.train.trainer import Trainer

    cfg = build_config([
        f"env={ENV}", *TINY, "data.tasks=env", "eval.num_tasks=6",
        "trainer.progress=false", f"rollout.max_turns={MAX_TURNS}", "rollout.max_new_tokens=64",
        f"run_dir={tmp_path / 'train'}",
    ])
    trainer = Trainer(cfg)
    trainer.actor.engine = TrainerEngine(trainer.format, script)

    async def go():
        pool = EnvPool(trainer.make_env, 4)
        try:
            await trainer.evaluate(pool)
        finally:
            await pool.aclose()

    asyncio.run(go())
    tasks = [task for _, task in trainer.heldout.items]
    saved = (tmp_path / "train" / "eval" / "before" / "trajectories.jsonl").read_text().splitlines()
    by_item = {t.task_id: t for t in map(Trajectory.from_json, saved)}
    return tasks, [by_item[item] for item, _ in trainer.heldout.items]


async def _eval_trajectories(tmp_path, url: str, tasks: list[dict], api: str) -> list[Trajectory]:
    from agentrl.evaluation import EvalConfig, Evaluation

    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    out = tmp_path / f"eval-{api}"
    config = EvalConfig(env=ENV, model=url, api=api, tasks=str(path), limit=len(tasks), n=1, concurrency=3,
                        max_new_tokens=64, temperature=1.0, out=str(out), env_kwargs={"max_turns": MAX_TURNS})
    await Evaluation(config).run()
    by_item = {}
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        traj = Trajectory.from_json(line)
        by_item[traj.task_id] = traj
    return [by_item[str(i)] for i in range(len(tasks))]


async def _verl_trajectories(tasks: list[dict]) -> list[dict]:
    """The verl agent loop itself, its server manager answering from the same script."""
    pytest.importorskip("verl")
    engine = ScriptedEngine(FMT, script)
    loop = scripted_verl_agent_loop(engine, response_length=4096)
    outs = []
    for task in tasks:
        spec = {"env": ENV, "format": "harmony", "task": task, "max_new_tokens": 64,
                "env_kwargs": {"max_turns": MAX_TURNS}}
        outs.append(await loop.run({"temperature": 1.0}, agentrl=json.dumps(spec)))
    return outs


async def _agent_trajectories(url: str, tasks: list[dict]) -> list[Trajectory]:
    import agentrl
    from agentrl.runtime import Agent

    trajs = []
    async with Agent(agentrl.make(ENV, max_turns=MAX_TURNS), base_url=url, time_limit_s=None,
                     sampling={"max_completion_tokens": 64}) as agent:
        for task in tasks:
            trajs.append((await agent.run_task(task)).trajectory)
    return trajs


def test_trainer_eval_verl_and_agent_give_identical_trajectories(tmp_path):
    tasks, trainer = _trainer_trajectories(tmp_path)
    kinds = {t["prompt"].split(":")[0] for t in tasks}
    assert kinds == {"add", "ghost", "loop"}, "the held-out tasks must cover every script"

    async def others():
        with BackgroundServer(create_app(ScriptedEngine(FMT, script), FMT, model_name="script")) as srv:
            completions = await _eval_trajectories(tmp_path, srv.base_url, tasks, "completions")
            chat = await _eval_trajectories(tmp_path, srv.base_url, tasks, "chat")
            agent = await _agent_trajectories(srv.base_url, tasks)
        verl = await _verl_trajectories(tasks)
        return completions, chat, agent, verl

    completions, chat, agent, verl = asyncio.run(others())
    expected = [_core(t) for t in trainer]
    # the episodes are what the script says: real tool results, the error taxonomy, the turn limit
    for task, traj in zip(tasks, trainer, strict=True):
        kind = task["prompt"].split(":")[0]
        assert traj.stop_reason == {"add": "answer", "ghost": "answer", "loop": "turn_limit"}[kind]
        assert traj.reward == (0.0 if kind == "loop" else 1.0)
        assert traj.turns[0].tools[0].error == ("unknown_tool" if kind == "ghost" else None)
        assert 0 in traj.response_mask and 1 in traj.response_mask
    assert [_core(t) for t in completions] == expected
    assert [_core(t) for t in chat] == expected
    assert [_core(t) for t in agent] == expected
    for out, traj in zip(verl, trainer, strict=True):
        assert out.prompt_ids == traj.prompt_ids and out.response_ids == traj.response_ids
        assert out.response_mask == traj.response_mask and out.response_logprobs == traj.rollout_logprobs
        assert out.reward_score == traj.reward and out.extra_fields["truncated"] == traj.truncated


# ---------------------------------------------------------------------------- the runner's own contract
class _Replay:
    """A policy that plays back fixed texts, one or several actions per call."""

    def __init__(self, *replies: list[str]):
        self.replies = list(replies)
        self.seen_contexts: list[list[int]] = []

    async def act(self, episode):
        self.seen_contexts.append(episode.context)
        texts = self.replies.pop(0)
        return [Action(FMT.encode(t, allow_special=True), [-0.5] * len(FMT.encode(t, allow_special=True)))
                for t in texts]


CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>'
FINAL = "<|channel|>final<|message|>\\boxed{3}<|return|>"


async def test_runner_steps_several_actions_and_hooks_see_each_step():
    env = ParityEnv(format=FMT)
    seen = []
    policy = _Replay([CALL, CALL], [FINAL])  # one reply with two calls, then the answer
    result = await run_episode(env, policy, task={"prompt": "add: 1 and 2", "answer": "3"}, on_step=seen.append)
    assert result.stop_reason == "answer" and result.trajectory.reward == 1.0
    assert len(result.steps) == 3 and seen == result.steps
    assert [rec.result for s in seen for rec in s.turn.tools] == ["3", "3"]
    # the second call of a reply is stepped on the context that includes the first one's tool result
    assert policy.seen_contexts[1] == [*result.trajectory.prompt_ids, *result.trajectory.response_ids[: result.steps[1].turn.env_span[1]]]
    assert result.has_logprobs and result.policy_s >= 0 and result.env_s > 0
    await env.aclose()


async def test_runner_drops_actions_after_the_episode_ends():
    env = ParityEnv(format=FMT)
    result = await run_episode(env, _Replay([FINAL, CALL]), task={"prompt": "add: 1 and 2", "answer": "3"})
    assert len(result.steps) == 1 and result.stop_reason == "answer"
    await env.aclose()


async def test_limits_override_the_env_for_one_episode_only():
    env = ParityEnv(format=FMT)
    task = {"prompt": "add: 1 and 2", "answer": "3"}
    tools = await run_episode(env, _Replay([CALL], [CALL], [CALL]), task=task, limits=EpisodeLimits(max_tool_calls=2))
    assert tools.stop_reason == "tool_limit" and tools.trajectory.truncated
    turns = await run_episode(env, _Replay([CALL], [CALL]), task=task, limits=EpisodeLimits(max_turns=2))
    assert turns.stop_reason == "turn_limit" and len(turns.steps) == 2
    assert env.limits == ParityEnv.default_limits
    budget = await run_episode(env, _Replay([CALL], [CALL]), task=task, limits=EpisodeLimits(max_response_tokens=30))
    assert budget.stop_reason == "token_limit"
    assert len(budget.trajectory.response_ids) <= 30 and env.limits == ParityEnv.default_limits
    with pytest.raises(ValueError, match="max_turns must be > 0"):
        EpisodeLimits(max_turns=0)
    await env.aclose()


async def test_token_policy_never_samples_past_the_token_budget():
    class Greedy:
        def __init__(self):
            self.asked = []

        async def generate(self, prompts, sampling):
            self.asked.append(sampling.max_new_tokens)
            ids = FMT.encode("x" * 5000)[: sampling.max_new_tokens]
            return [Completion(ids, [0.0] * len(ids), "length")]

    env = ParityEnv(format=FMT, max_total_tokens=200)
    engine = Greedy()
    result = await run_episode(env, TokenPolicy(engine, SamplingParams(max_new_tokens=1000)),
                               task={"prompt": "add: 1 and 2", "answer": "3"})
    prompt = len(result.trajectory.prompt_ids)
    assert engine.asked[0] == 200 - prompt
    assert len(result.trajectory.prompt_ids) + len(result.trajectory.response_ids) <= 200
    await env.aclose()


async def test_time_limit_stops_a_slow_policy():
    class Slow:
        async def act(self, episode):
            await asyncio.sleep(10)

    env = ParityEnv(format=FMT)
    result = await run_episode(env, Slow(), task={"prompt": "add: 1 and 2", "answer": "3"},
                               limits=EpisodeLimits(time_s=0.2))
    assert result.stop_reason == "time_limit" and result.wall_s < 5 and result.steps == []
    assert result.trajectory.stop_reason == "time_limit" and not result.trajectory.terminated
    await env.aclose()


async def test_collect_keeps_failed_episodes_and_replaces_their_env():
    made = []

    def make_env():
        made.append(ParityEnv(format=FMT))
        return made[-1]

    class Flaky:
        async def act(self, episode):
            if "boom" in episode.task["prompt"]:
                raise RuntimeError("policy exploded")
            return [Action(FMT.encode(FINAL, allow_special=True))]

    pool = EnvPool(make_env, 1)
    jobs = [EpisodeJob({"prompt": "add: 1 and 2", "answer": "3"}, 0, "ok", 0),
            EpisodeJob({"prompt": "boom: 1 and 2", "answer": "3"}, 1, "boom", 1)]
    finished = []
    results = await collect(pool, Flaky(), jobs, on_episode=finished.append)
    await pool.aclose()
    ok, boom = results
    assert ok.usable and ok.trajectory.reward == 1.0 and ok.task_id == "ok" and not ok.has_logprobs
    assert not boom.usable and boom.stop_reason == "error" and "policy exploded" in boom.error
    assert boom.trajectory.error == boom.error and boom.trajectory.prompt_ids
    assert ok.trajectory.stop_reason == "answer"  # the earlier episode's record is untouched
    assert len(made) == 2 and sorted(r.task_id for r in finished) == ["boom", "ok"]


async def test_a_policy_must_act():
    class Mute:
        async def act(self, episode):
            return []

    env = ParityEnv(format=FMT)
    with pytest.raises(ValueError, match="returned no action"):
        await run_episode(env, Mute(), task={"prompt": "add: 1 and 2", "answer": "3"})
    await env.aclose()


async def test_collect_stops_starting_episodes_when_told():
    """Once should_stop() is true, jobs that have not started are skipped (eval's unreachable endpoint)."""

    class Down:
        async def act(self, episode):
            raise ConnectionError("endpoint down")

    failures = []
    pool = EnvPool(lambda: ParityEnv(format=FMT), 2)
    jobs = [EpisodeJob({"prompt": f"add: {i} and 1", "answer": str(i + 1)}, i, str(i), i, 0) for i in range(10)]
    results = await collect(pool, Down(), jobs, on_episode=failures.append, should_stop=lambda: len(failures) >= 3)
    await pool.aclose()
    assert 3 <= len(results) <= 4 and all(r.error == "ConnectionError: endpoint down" for r in results)
    assert [r.task_id for r in results] == [str(i) for i in range(len(results))]  # job order, skipped left out


class CountingTool(StatefulTool):
    """A stateful tool whose backend admits ``capacity`` live sessions; it records how many are live at most. Its
    calls block until ``gate`` is set (forever, by default)."""

    name = "counter"
    parameters = {"type": "object", "properties": {}}

    def __init__(self, shared: dict):
        self.shared = shared

    async def create_session(self):
        self.shared["live"] += 1
        self.shared["peak"] = max(self.shared["peak"], self.shared["live"])
        return object()

    async def release_session(self, session):
        self.shared["live"] -= 1

    async def session_capacity(self):
        return self.shared["capacity"]

    async def request_sessions(self, sessions):
        self.shared["requested"].append(sessions)
        if self.shared["grows_to"] is not None:  # a backend that sizes itself up to what backs it
            self.shared["capacity"] = max(self.shared["capacity"], min(sessions, self.shared["grows_to"]))

    async def call(self, arguments, session=None):
        await self.shared["gate"].wait()
        await asyncio.sleep(0.01)  # the episodes in flight overlap
        return "counted"


class CounterEnv(ParityEnv):
    def __init__(self, shared, **kw):
        self.shared = shared
        super().__init__(format=FMT, **kw)

    def make_tools(self):
        return [CountingTool(self.shared)]


COUNT = '<|channel|>commentary to=functions.counter <|constrain|>json<|message|>{}<|call|>'


class _CountThenAnswer:
    async def act(self, episode):
        return [Action(FMT.encode(FINAL if episode.steps else COUNT, allow_special=True))]


def _counter_state(capacity=None, open_gate=False):
    gate = asyncio.Event()
    if open_gate:
        gate.set()
    return {"live": 0, "peak": 0, "capacity": capacity, "gate": gate, "requested": [], "grows_to": None}


async def test_sessions_are_released_when_an_episode_ends_by_time_limit_error_or_cancellation():
    shared = _counter_state()
    env = CounterEnv(shared)
    task = {"prompt": "add: 1 and 2", "answer": "3"}
    timed = await run_episode(env, _Replay([COUNT]), task=task, limits=EpisodeLimits(time_s=0.2))
    assert timed.stop_reason == "time_limit" and shared["peak"] == 1 and shared["live"] == 0

    class CallThenFail:
        async def act(self, episode):
            if episode.steps:
                raise RuntimeError("policy exploded")
            return [Action(FMT.encode(COUNT, allow_special=True))]

    shared["gate"].set()
    with pytest.raises(RuntimeError, match="exploded"):
        await run_episode(env, CallThenFail(), task=task)
    assert shared["live"] == 0
    shared["gate"].clear()
    episode = asyncio.create_task(run_episode(env, _Replay([COUNT]), task=task))
    while not shared["live"]:
        await asyncio.sleep(0.01)
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    assert shared["live"] == 0
    await env.aclose()


async def test_collect_keeps_episodes_in_flight_within_the_tools_session_capacity():
    shared = _counter_state(capacity=3, open_gate=True)
    made = []
    pool = EnvPool(lambda: made.append(CounterEnv(shared)) or made[-1], 8)
    jobs = [EpisodeJob({"prompt": f"add: {i} and 1", "answer": str(i + 1)}, i, str(i), i) for i in range(12)]
    results = await collect(pool, _CountThenAnswer(), jobs)
    await pool.aclose()
    assert pool.in_flight == 3 and len(made) == 3 and shared["peak"] == 3 and shared["live"] == 0
    assert all(r.usable for r in results) and len(results) == 12


@pytest.mark.parametrize("grows_to, in_flight", [(6, 6), (100, 8)])
async def test_collect_asks_the_tools_to_admit_its_pool_size_before_bounding_it(grows_to, in_flight):
    """The pool asks its tools for ``size`` sessions first; a backend that can back more raises its capacity, and
    the episodes in flight follow it (up to the pool's size), still never beyond it."""
    shared = _counter_state(capacity=3, open_gate=True)
    shared["grows_to"] = grows_to
    pool = EnvPool(lambda: CounterEnv(shared), 8)
    jobs = [EpisodeJob({"prompt": f"add: {i} and 1", "answer": str(i + 1)}, i, str(i), i) for i in range(16)]
    results = await collect(pool, _CountThenAnswer(), jobs)
    await pool.aclose()
    assert shared["requested"] == [8] and pool.in_flight == in_flight
    assert shared["peak"] == in_flight <= shared["capacity"] and shared["live"] == 0
    assert all(r.usable for r in results) and len(results) == 16
