"""Bit-identical re-runs: the same config and seed, run twice in separate processes (with different hash seeds,
so that set and dict orders of strings differ), give the same ``metrics.jsonl`` (timing keys aside) and the same
final weights. The config is a tiny GPT-OSS on retool with its real code sandbox: a short cold start on scripted
demonstrations (run through the sandbox), two RL steps of 8 concurrent episodes and three held-out evaluations
of 4; and a run that trains for real (``tests/_repro_env.py``: varied rewards, tool calls, optimizer steps on
a MoE model), both at torch's default thread count. (That the engine's batches do not depend on how long tools
take is tested with tools of random duration in ``tests/test_episodes_lockstep.py``.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.train.repro import differing_keys, is_timing_key

ROOT = Path(__file__).resolve().parents[1]
TINY = ["env=retool", "model=tiny-gpt-oss", "model_kwargs.num_layers=1", "rollout.batch_size=2", "rollout.n=4",
        "rollout.max_new_tokens=24", "eval.num_tasks=4", "sft.steps=2", "sft.num_demos=4", "sft.batch_size=4",
        "sft.micro_batch_size=4", "trainer.total_steps=2", "trainer.progress=false", "trainer.tensorboard=false",
        "env_kwargs.sandbox_kwargs.workers=2"]


#: a run that trains for real at the default thread count: varied rewards, tool calls, optimizer steps
TRAINING = ["env=tests/_repro_env.py:ToolParityEnv", "model=tiny-gpt-oss", "model_kwargs.num_layers=1",
            "rollout.batch_size=2", "rollout.n=4", "rollout.max_new_tokens=8", "eval.num_tasks=2", "sft.steps=0",
            "trainer.total_steps=3", "trainer.progress=false", "trainer.tensorboard=false", "actor.lr=1e-3",
            "actor.num_mini_batches=2"]


def _start(run_dir: Path, hash_seed: int, config: list[str] = TINY) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)  # torch's default thread count
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *config, f"run_dir={run_dir}"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_runs_that_train_with_tools_at_the_default_thread_count_are_identical(tmp_path):
    """MoE expert gradients used to differ in the last bit between such runs (CPU ``index_put_`` accumulation
    in transformers' experts path); ``deterministic`` (on by default) removes it."""
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [_start(run, seed, TRAINING) for run, seed in zip(runs, (1, 2), strict=True)]
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
    steps = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["actor/optimizer_steps"] for r in steps) >= 2  # the weights train (two mini-batches a step)
    assert all(r["critic/score/max"] > r["critic/score/min"] for r in steps)  # rewards vary
    assert all(r["episode/tool_calls_mean"] > 0 for r in steps)  # tools are called
    assert differing_keys(*runs) == []


@pytest.mark.slow
def test_two_runs_of_one_seed_are_identical(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [_start(run, seed) for run, seed in zip(runs, (1, 2), strict=True)]  # side by side: timings differ
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert differing_keys(*runs) == []

    # the comparison notices a changed metric and a changed weight
    copy = tmp_path / "copy"
    shutil.copytree(runs[0], copy)
    records[1]["critic/score/mean"] += 1e-12
    records[1]["timing_s/step"] += 1.0  # timings are left out
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = copy / "checkpoints" / "step_000002" / "model.pt"
    state = torch.load(model, weights_only=True)
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1e-6
    torch.save(state, model)
    assert differing_keys(runs[0], copy) == ["step 1: critic/score/mean", f"weights: model.pt:{name}"]


def test_timing_keys():
    assert all(map(is_timing_key, ["timing_s/step", "perf/gen_tokens_per_s", "eval/timing_s", "eval/latency_s_p95"]))
    assert not any(map(is_timing_key, ["critic/score/mean", "eval/mean_reward", "actor/grad_norm", "sft/steps"]))
