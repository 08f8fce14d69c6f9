"""``agentrl eval`` with a local transformers model (tiny random GPT-OSS): the trainer's engine and episode
loop, real log-probs in the written trajectories, and the truncation taxonomy when max_new_tokens cuts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from agentrl.evaluation import EvalConfig, Evaluation  # noqa: E402
from agentrl.harmony import Trajectory  # noqa: E402


async def test_eval_local_tiny_model(tmp_path):
    # no tasks=: gsm8k evaluates on the GSM8K test split shipped in agentrl.data (offline)
    cfg = EvalConfig(env="gsm8k", model="tiny-gpt-oss", limit=2, n=2, max_new_tokens=4, out=str(tmp_path))
    metrics = await Evaluation(cfg).run()
    assert metrics["episodes"] == 4 and metrics["run"]["episodes_failed"] == 0
    assert metrics["gen_tokens_per_episode"] == 4
    trajs = [Trajectory.from_json(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    for t in trajs:
        t.validate()
        assert all(lp < 0 for lp in t.rollout_logprobs)  # sampled by a real model: probabilities below 1
        assert t.api == "completions" and not t.correct
    # a random model cut after 4 tokens never stops on its own: every episode is a truncation, not a parse error
    assert metrics["errors"]["truncation"] == 4 and metrics["errors"]["parse_error"] == 0
    assert metrics["pass@1"] == 0.0
