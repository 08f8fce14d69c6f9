"""A reward function that raises: ``env.step`` still returns, the episode is scored 0 and kept,
the error is recorded on the trajectory and counted (trainer metrics, eval metrics and table), and a warning
shows it on the console; the trainer does not train on it."""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest
from _scripted_engine import ScriptedEngine

import agentrl.envs.registry as registry
from agentrl.engines.server import BackgroundServer, create_app
from agentrl.envs import AgentEnv, RewardErrorWarning
from agentrl.episodes import EnvPool, EpisodeJob, collect
from agentrl.harmony import HarmonyFormat, Message, Trajectory

FMT = HarmonyFormat()
ENV = "reward-raises"
FINAL = "<|channel|>final<|message|>\\boxed{3}<|return|>"


class BrokenRewardEnv(AgentEnv):
    """Answer anything; the reward function has a bug (it divides by zero)."""

    single_turn = True

    @classmethod
    def generate_task(cls, rng, split="train"):
        return {"prompt": f"say {int(rng.integers(10))}", "answer": "3"}

    def reward(self, ctx):
        return 1 / 0, {}


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry.register(ENV, f"{__name__}:BrokenRewardEnv")


def test_step_returns_scores_zero_records_and_warns():
    env = BrokenRewardEnv(format=FMT)
    env.reset(seed=0)
    with pytest.warns(RewardErrorWarning, match=r"BrokenRewardEnv raised ZeroDivisionError: division by zero \(at .*test_reward_errors.py:\d+ in reward\)"):
        obs, reward, terminated, truncated, info = env.step(FINAL)
    assert reward == 0.0 and terminated and not truncated and len(obs["tokens"]) == 0
    assert info["reward_error"].startswith("ZeroDivisionError: division by zero")
    assert "reward_error" in info["errors"]
    traj = info["trajectory"]
    assert traj.reward_error == info["reward_error"]
    assert traj.errors == {"reward_error": 1} and traj.reward == 0.0 and traj.response_ids
    # the record survives serialisation (what eval and the trainer write)
    assert Trajectory.from_json(traj.to_json()).reward_error == info["reward_error"]
    env.close()


def test_warning_does_not_raise_even_when_warnings_are_errors():
    env = BrokenRewardEnv(format=FMT)
    env.reset(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, reward, terminated, _, info = env.step(FINAL)
    assert reward == 0.0 and terminated and "reward_error" in info
    env.close()


def test_rollout_keeps_and_counts_the_episode_but_does_not_train_on_it():
    from agentrl.episodes import Action
    from agentrl.train.metrics import episode_metrics
    from agentrl.train.teachers import keep_trajectory

    class Answer:
        async def act(self, episode):
            return [Action(FMT.encode(FINAL, allow_special=True))]

    async def go():
        pool = EnvPool(lambda: BrokenRewardEnv(format=FMT), 2)
        try:
            return await collect(pool, Answer(), [EpisodeJob(None, seed=k, task_id=str(k)) for k in range(3)])
        finally:
            await pool.aclose()

    with pytest.warns(RewardErrorWarning):
        results = asyncio.run(go())
    assert len(results) == 3
    for r in results:
        assert r.error is None and r.reward_error and not r.usable and r.trajectory.response_ids
        assert not keep_trajectory(r.trajectory)  # never SFT data
    m = episode_metrics(results)
    assert m["episode/rollout_errors"] == 3.0 and m["episode/reward_errors"] == 3.0


def _answer(prompt: str, sampling) -> list[Message]:
    return [Message("assistant", "\\boxed{3}", channel="final")]


def test_eval_writes_the_trajectories_and_reports_the_errors(tmp_path):
    from agentrl.evaluation import EvalConfig, Evaluation
    from agentrl.evaluation.report import rows

    out = tmp_path / "eval"

    async def go():
        with BackgroundServer(create_app(ScriptedEngine(FMT, _answer), FMT, model_name="script")) as srv:
            cfg = EvalConfig(env=ENV, model=srv.base_url, limit=4, concurrency=2, out=str(out), progress=False)
            return await Evaluation(cfg).run()

    with pytest.warns(RewardErrorWarning):
        metrics = asyncio.run(go())
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 4  # every completion kept
    assert all(json.loads(line)["reward_error"].startswith("ZeroDivisionError") for line in lines)
    assert metrics["errors"]["reward_error"] == 4 and metrics["mean_reward"] == 0.0
    assert dict(rows(metrics))["errors/reward_error per ep"] == 1.0
