"""Trajectories -> verl-layout tensors; task sources."""

from __future__ import annotations

import pytest

from agentrl.envs.builtin.retool import ReToolEnv
from agentrl.envs.task_source import TaskSource, arithmetic_task
from agentrl.harmony.trajectory import Trajectory
from agentrl.train.batch import collate


def test_collate_layout_and_reward_placement():
    a = Trajectory(prompt_ids=[1, 2, 3], response_ids=[10, 11, 50, 51, 12], response_mask=[1, 1, 0, 0, 1],
                   rollout_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], reward=1.0)
    b = Trajectory(prompt_ids=[4], response_ids=[20], response_mask=[1], rollout_logprobs=[-0.5], reward=0.5)
    batch = collate([a, b], [0, 0], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 50, 51, 12], [0, 0, 4, 20, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 8, [0, 0, 1, 1, 0, 0, 0, 0]]
    assert batch.position_ids[1, 2:4].tolist() == [0, 1]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.rollout_log_probs[0].tolist() == pytest.approx([-0.1, -0.2, 0, 0, -0.3])
    assert batch.token_level_rewards.tolist() == [[0, 0, 0, 0, 1.0], [0.5, 0, 0, 0, 0]]
    assert batch.prompt_width == 3
    sub = batch.select([1])
    assert sub.input_ids.shape == (1, 8) and sub.index.tolist() == [0]


def test_collate_rejects_inconsistent_trajectories():
    bad = Trajectory(prompt_ids=[1], response_ids=[2, 3], response_mask=[1], rollout_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="lengths disagree"):
        collate([bad], [0])
    with pytest.raises(ValueError, match="empty"):
        collate([], [])


def test_task_streams_are_positional_and_disjoint():
    src = TaskSource(ReToolEnv, "arithmetic", seed=3, level=1, num_held_out=60)
    assert src.train(5) == TaskSource(ReToolEnv, "arithmetic", seed=3, level=1, num_held_out=60).train(5)
    held = src.held_out()
    assert held == src.held_out() and len(held) == 60
    held_prompts = {t["prompt"] for t in held}
    assert len(held_prompts) == 60  # distinct
    assert not held_prompts & {src.train(i)["prompt"] for i in range(200)}  # never trained on
    assert src.held_out(10) == held[:10]
    assert src.train(7, num_held_out=10) == TaskSource(ReToolEnv, "arithmetic", seed=3, num_held_out=10).train(7)
    env_src = TaskSource(ReToolEnv, "env", seed=0)
    assert "prompt" in env_src.train(0) and env_src.train(0) != env_src.train(1)
    with pytest.raises(ValueError, match="distinct held-out"):
        TaskSource(ReToolEnv, "arithmetic", seed=0, level=1, num_held_out=82)
    with pytest.raises(ValueError, match="no such file"):
        TaskSource(ReToolEnv, "/nonexistent/tasks.jsonl", seed=0)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_arithmetic_answers_are_right(level):
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(20):
        task = arithmetic_task(rng, level)
        expr = task["prompt"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expr)) == task["answer"]  # noqa: S307


def test_boxed_bonus_adds_a_component():
    from types import SimpleNamespace

    from agentrl.envs.rewards import with_boxed_bonus

    reward = with_boxed_bonus(lambda ctx: (1.0, {"correct": 1.0}), 0.25)
    assert reward(SimpleNamespace(final="so \\boxed{12}")) == (1.25, {"correct": 1.0, "boxed": 1.0})
    assert reward(SimpleNamespace(final="12")) == (1.0, {"correct": 1.0, "boxed": 0.0})
    assert with_boxed_bonus(None, 0.5)(SimpleNamespace(final=None)) == (0.0, {"boxed": 0.0})
