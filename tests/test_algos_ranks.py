"""What must not depend on the number of ranks, with 2 CPU ranks (torchrun, gloo), against a full-batch
single-process reference (the workers are in ``tests/_algos_ranks_worker.py``):

- advantages (100 hypothesis examples, every estimator; REINFORCE++ and REINFORCE++-baseline whiten over
  all ranks' tokens, as verl does on its driver);
- a policy update with rejection sampling under each loss aggregation: the gradient averaged over the
  ranks (FSDP's reduction) and the rank-averaged metrics equal the single-process update on all rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _algos_ranks_worker import SCENARIOS, scenario_config, scenario_trajectories
from _tiny_update import tiny_llama

import agentrl
from agentrl.train.batch import collate
from agentrl.train.update import update_policy

HERE = Path(__file__).parent
EXAMPLES = 100
#: metrics that must not depend on the number of ranks (timings and per-rank counts aside)
SAME_METRICS = ("actor/pg_loss", "actor/entropy", "actor/ppo_ratio_mean", "actor/ppo_ratio_max", "actor/ppo_ratio_min",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/on_policy", "actor/optimizer_steps")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    here = str(Path(agentrl.__file__).parent.parent)  # the workers import the agentrl under test
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(HERE / "_algos_ranks_worker.py"), "--out", str(out), "--examples", str(EXAMPLES)],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    return out


def test_advantages_are_the_full_batch_ones_on_every_rank(ranks):
    info = json.loads((ranks / "advantages.json").read_text())
    assert info == {"world": 2, "examples": EXAMPLES}  # every example ran, on both ranks, in step


@pytest.mark.parametrize("k", range(len(SCENARIOS)), ids=["-".join(s[:2]) for s in SCENARIOS])
def test_update_on_two_ranks_equals_the_single_process_update(ranks, k):
    results = torch.load(ranks / "updates.pt", weights_only=True)
    trajectories = scenario_trajectories(k)
    batch = collate([t for t, _ in trajectories], [g for _, g in trajectories])
    model = tiny_llama()
    single = update_policy(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), batch=batch,
                           cfg=scenario_config(*SCENARIOS[k]), temperature=1.0)
    assert 0 < single["rollout_corr/rollout_rs_masked_fraction"] < 1  # rejection really rejects some tokens
    grads, metrics = results[k]["grads"], results[k]["metrics"]
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max()) + 1e-12
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    for key in [*SAME_METRICS, *(k for k in single if k.startswith("rollout_corr/"))]:
        assert metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
