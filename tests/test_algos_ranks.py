"""What must not depend on the number of ranks, with 2 and 3 CPU ranks (torchrun, gloo), against a
full-batch single-process reference (the workers are in ``tests/_algos_ranks_worker.py``):

- advantages (hypothesis examples, every estimator; REINFORCE++ and REINFORCE++-baseline whiten over
  all ranks' tokens, as verl does on its driver);
- policy updates on random batches under every loss aggregation mode (token-sum and
  seq-mean-token-sum-norm included), several mini-batches and epochs, rejection sampling, ranks with
  unequal row counts and widths, fewer rows with a model token than ranks: the weights after the update
  (each step on the rank-averaged gradient, FSDP's reduction), the number of optimizer steps and the
  rank-averaged losses and metrics equal the single-process update on all rows, and every rank runs as
  many forwards as the others; the same update with the model sharded by FSDP2 (whose collectives would
  hang or fail out of step) gives the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _algos_ranks_worker import SCENARIOS, scenario, scenario_update
from _tiny_llama import tiny_llama
from _torchrun import torchrun

from agentrl.train.algorithms import LOSS_AGG_MODES

pytestmark = pytest.mark.distributed  # two torchrun launches (2 and 3 ranks)
HERE = Path(__file__).parent
EXAMPLES = {2: 100, 3: 40}
#: metrics that must not depend on the number of ranks (timings and per-rank counts aside)
SAME_METRICS = ("actor/pg_loss", "actor/entropy", "actor/ppo_ratio_mean", "actor/ppo_ratio_max", "actor/ppo_ratio_min",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/on_policy", "actor/optimizer_steps", "actor/grad_norm",
                "actor/zero_grad_steps_skipped")


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request, tmp_path_factory) -> tuple[int, Path]:
    world = request.param
    out = tmp_path_factory.mktemp(f"ranks{world}")
    torchrun([str(HERE / "_algos_ranks_worker.py"), "--out", str(out), "--examples", str(EXAMPLES[world])],
             nproc=world, cwd=HERE, timeout=600)
    return world, out


def test_advantages_are_the_full_batch_ones_on_every_rank(ranks):
    world, out = ranks
    info = json.loads((out / "advantages.json").read_text())
    assert info == {"world": world, "examples": EXAMPLES[world]}  # every example ran, on every rank, in step


def test_scenarios_cover_every_aggregation_mode_and_the_hard_cases():
    drawn = [scenario(k, 3) for k in range(SCENARIOS)]
    assert {o.split("=")[1] for ov, _ in drawn for o in ov if o.startswith("actor.loss_agg_mode=")} == set(LOSS_AGG_MODES)
    assert any("actor.num_mini_batches=1" not in ov for ov, _ in drawn)
    assert any(len({len(rows) for rows in per_rank}) > 1 for _, per_rank in drawn)  # unequal row counts
    assert any(sum(any(t.response_mask) for rows in per_rank for t, _ in rows) < 3 for _, per_rank in drawn)


@pytest.mark.parametrize("k", range(SCENARIOS))
def test_update_on_several_ranks_equals_the_single_process_update(ranks, k):
    world, out = ranks
    result = torch.load(out / "updates.pt", weights_only=True)[k]
    overrides, per_rank = scenario(k, world)
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    single = scenario_update(model, [pair for rows in per_rank for pair in rows], overrides)
    assert len(set(result["forwards"])) == 1, result["forwards"]  # FSDP's collectives stay in step
    moved = False
    for name, p in model.named_parameters():
        scale = float((p.detach() - before[name]).abs().max()) + 1e-12
        moved |= scale > 1e-9
        torch.testing.assert_close(result["weights"][name], p.detach(), rtol=1e-5, atol=1e-5 * scale, msg=name)
        torch.testing.assert_close(result["fsdp_weights"][name], p.detach(), rtol=1e-5, atol=1e-5 * scale,
                                   msg=f"FSDP2 {name}")
    metrics = result["metrics"]
    assert moved == (single["actor/optimizer_steps"] > 0)
    for key in [*SAME_METRICS, *(m for m in single if m.startswith("rollout_corr/"))]:
        assert metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
