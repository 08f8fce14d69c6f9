"""Evaluation episodes on an engine with clients (the decode engine, as the trainer's held-out evaluation runs it):
one client per episode, seeded per item and sample, so two items whose prompts are equal do not share their
sampling randomness at temperature > 0, and every client is closed when the episodes end."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from agentrl import seeds  # noqa: E402
from agentrl.engines.server import load_local_engine  # noqa: E402
from agentrl.envs.registry import env_class  # noqa: E402
from agentrl.evaluation import EvalConfig  # noqa: E402
from agentrl.evaluation.config import load_tasks  # noqa: E402
from agentrl.evaluation.policies import TokenRunner, env_kwargs_of  # noqa: E402
from agentrl.evaluation.runner import eval_jobs, run_jobs  # noqa: E402


class _Store:
    """The result store :func:`run_jobs` writes to, in memory."""

    def __init__(self) -> None:
        self.written, self.errors = [], []

    def write(self, traj):
        self.written.append(traj)

    def write_error(self, item_id, sample, error):
        self.errors.append((item_id, sample, error))

    def log_error(self, what, text):
        pass


async def test_items_with_equal_prompts_sample_through_their_own_clients(tmp_path):
    engine, fmt, _ = load_local_engine("tiny-gpt-oss", engine="decode")
    cfg = EvalConfig(env="gsm8k", model="tiny-gpt-oss", limit=1, n=2, max_new_tokens=8, temperature=1.0,
                     out=str(tmp_path))
    (_, task), = load_tasks(cfg)
    items = [("a", task), ("b", task)]  # the same prompt under two ids: only the client seed tells them apart
    cls = env_class("gsm8k")
    runner = TokenRunner(cls, {**env_kwargs_of(cfg, cls), "format": fmt}, cfg, engine)
    assert runner.lockstep is None and runner.clients is not None
    store = _Store()
    await run_jobs(runner, eval_jobs(cfg, items), store, concurrency=4)
    assert not store.errors and len(store.written) == 4
    sampled = {(t.task_id, t.sample): tuple(t.response_ids) for t in store.written}
    assert len(set(sampled.values())) == 4, sampled  # before: ("a", j) and ("b", j) sampled the same tokens
    assert not engine._clients  # each episode's client was closed
    assert len({seeds.eval_client_seed(cfg.seed, i, j) for i in "ab" for j in range(2)}) == 4
