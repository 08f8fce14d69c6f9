"""One torchrun rank of ``tests/test_algos_ranks.py`` (CPU, gloo): what does not depend on the number of ranks.

1. Advantages (hypothesis, derandomized, so every rank draws the same examples): each rank holds its own
   rows (its own response width, its own group ids 0..k-1, whole groups, ragged and empty masks) and calls
   :func:`agentrl.train.update.batch_advantages`; its rows must equal those of the single-process
   ``compute_advantages`` on the concatenated batch, for every estimator (the whitened REINFORCE++ ones
   are the point). Every rank checks its own rows and the verdicts are gathered, so the ranks stay in step.
2. Policy updates on random :func:`scenario` batches (every loss aggregation mode, several mini-batches and
   epochs, unequal row counts, rows without a model token): each rank runs ``run_update`` on its rows (an
   unsharded tiny model, plain SGD whose gradients are averaged over the ranks before clipping, as FSDP's
   reduction does) and rank 0 saves the weights after the update, the rank-averaged metrics and each rank's
   forward count, for the test to compare with the single-process update on all the rows.

usage: torchrun --standalone --nproc_per_node=N tests/_algos_ranks_worker.py --out DIR [--examples 100]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_llama import tiny_llama  # noqa: E402

from agentrl.harmony.trajectory import Trajectory  # noqa: E402
from agentrl.train import distributed  # noqa: E402
from agentrl.train.algorithms import LOSS_AGG_MODES, compute_advantages  # noqa: E402
from agentrl.train.batch import Batch, collate  # noqa: E402
from agentrl.train.config import build_config  # noqa: E402
from agentrl.train.update import batch_advantages, run_update  # noqa: E402

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo", "rloo", "opo")
#: random update scenarios per world size; each loss aggregation mode comes up in several of them
SCENARIOS = 15
GROUP_SIZE = 3


def _batch(rewards: torch.Tensor, mask: torch.Tensor, index: list[int]) -> Batch:
    """A batch holding only what the estimators read (rewards, mask, group ids)."""
    b = len(index)
    ids = torch.zeros(b, 1, dtype=torch.long)
    return Batch(input_ids=ids, attention_mask=ids, position_ids=ids, responses=ids, response_mask=mask,
                 rollout_log_probs=torch.zeros_like(mask), token_level_rewards=rewards,
                 index=torch.tensor(index, dtype=torch.long))


@st.composite
def shards(draw, world: int):
    """Per rank ``(rewards [B_r, T_r], mask [B_r, T_r], local group ids)``: whole groups on each rank."""
    out = []
    outcome = draw(st.booleans())  # one reward per row (outcome) or rewards on many tokens
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    for _ in range(world):
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
        b, t = sum(sizes), draw(st.integers(1, 10))
        kinds = draw(st.lists(st.sampled_from(["empty", "prefix", "holes", "full"]), min_size=b, max_size=b))
        mask = torch.zeros(b, t)
        for i, kind in enumerate(kinds):
            if kind == "prefix":
                mask[i, : int(torch.randint(1, t + 1, (1,), generator=g))] = 1
            elif kind == "holes":
                mask[i] = (torch.rand(t, generator=g) < 0.6).float()
            elif kind == "full":
                mask[i] = 1
        if outcome:
            rewards = torch.zeros(b, t)
            rewards[:, -1] = torch.randint(0, 3, (b,), generator=g).float() * scale  # ties: constant groups
        else:
            rewards = torch.randn(b, t, generator=g) * scale * (torch.rand(b, t, generator=g) < 0.5)
        index = [k for k, size in enumerate(sizes) for _ in range(size)]
        out.append((rewards, mask, index))
    return out


def check_advantages(examples: int) -> int:
    world, rank = distributed.world_size(), distributed.rank()
    seen = [0]
    configs: dict[tuple[str, float], object] = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(parts=shards(world), name=st.sampled_from(ESTIMATORS), gamma=st.sampled_from([1.0, 0.9]))
    def check(parts, name, gamma):
        seen[0] += 1
        if (name, gamma) not in configs:
            overrides = ["env=retool", f"algorithm.adv_estimator={name}", f"algorithm.gamma={gamma}"]
            configs[name, gamma] = build_config(overrides).algorithm
        algo = configs[name, gamma]
        rewards, mask, index = parts[rank]
        ours = batch_advantages(_batch(rewards, mask, index), algo)
        width = max(p[0].shape[1] for p in parts)
        pad = torch.nn.functional.pad
        whole, _ = compute_advantages(  # the single-process reference on the concatenated batch
            name, token_level_rewards=torch.cat([pad(p[0], (0, width - p[0].shape[1])) for p in parts]),
            response_mask=torch.cat([pad(p[1], (0, width - p[1].shape[1])) for p in parts]),
            index=[f"{r}-{i}" for r, p in enumerate(parts) for i in p[2]], gamma=gamma)
        start = sum(len(p[2]) for p in parts[:rank])
        mine = whole[start : start + len(index), : mask.shape[1]]
        ok = ours.shape == mine.shape and bool(torch.allclose(ours, mine, rtol=1e-6, atol=1e-7))
        verdicts = distributed.gather_objects([(rank, ok, (ours - mine).abs().max().item() if ok else None)])
        assert all(v[1] for v in verdicts), (name, verdicts)

    check()
    return seen[0]


def scenario(k: int, world: int) -> tuple[list[str], list[list[tuple[Trajectory, int]]]]:
    """Update scenario ``k`` on ``world`` ranks: the config overrides, and per rank its ``(trajectory, group)``
    pairs (whole groups of :data:`GROUP_SIZE`, group ids global and increasing with the rank). Drawn from
    ``k`` alone: every loss aggregation mode in turn, an estimator, 1-3 mini-batches, 1-2 epochs, micro-batches
    of 1-3 rows, rejection sampling or none, ``loss_scale_factor`` set or not; 1-3 groups per rank (ranks
    with unequal row counts and response widths), rows without a model token (a failed episode), and some
    scenarios where fewer rows hold a model token than there are ranks. Rollout log-probs lie around the
    tiny model's (about -4.6 on its 100-token vocabulary) so that rejection rejects some tokens and rows."""
    g = torch.Generator().manual_seed(1000 + k)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    mode = LOSS_AGG_MODES[k % len(LOSS_AGG_MODES)]
    sparse = k % 4 == 3  # one row in the whole batch holds a model token (GRPO gives it a nonzero advantage)
    rs = pick([None, ("token_k1", "0.5_2.0"), ("seq_max_k2,token_k1", "2.0,0.5_2.0")])
    estimator = pick(ESTIMATORS)
    if sparse:
        rs, estimator = None, "grpo"
    overrides = [f"algorithm.adv_estimator={estimator}", f"actor.loss_agg_mode={mode}",
                 f"actor.num_mini_batches={pick([1, 2, 3])}", f"actor.ppo_epochs={pick([1, 2])}",
                 f"actor.micro_batch_size={pick([1, 2, 3])}"]
    if rs is not None:
        overrides += [f"algorithm.rollout_correction.rollout_rs={rs[0]}",
                      f"algorithm.rollout_correction.rollout_rs_threshold='{rs[1]}'"]
    if pick([False, True]):
        overrides.append(f"actor.loss_scale_factor={pick([3, 16])}")
    per_rank, group = [], 0
    for _rank in range(world):
        mine = []
        for _ in range(pick([1, 2, 3])):
            for _i in range(GROUP_SIZE):
                length = int(torch.randint(2, 9, (1,), generator=g))
                ids = torch.randint(6, 100, (length,), generator=g).tolist()
                mask = [1] * length
                if length > 4:
                    mask[2] = mask[3] = 0
                if sparse or float(torch.rand(1, generator=g)) < 0.15:
                    mask = [0] * length
                prompt = torch.randint(6, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                logprobs = (-4.6 + torch.randn(length, generator=g)).tolist()
                reward = float(torch.rand(1, generator=g)) * int(torch.randint(0, 2, (1,), generator=g))
                mine.append((Trajectory(prompt_ids=prompt, response_ids=ids, response_mask=mask,
                                        rollout_logprobs=logprobs, reward=reward), group))
            group += 1
        per_rank.append(mine)
    if sparse:  # the first row of the last rank's batch keeps its model tokens, and the only reward of its group
        for i, (t, _) in enumerate(per_rank[-1][:GROUP_SIZE]):
            t.reward = float(i == 0)
        per_rank[-1][0][0].response_mask = [1] * len(per_rank[-1][0][0].response_ids)
    return overrides, per_rank


def scenario_config(overrides: list[str]):
    return build_config(["env=retool", "actor.grad_clip=1e9", "actor.share_prompt_prefix=false",
                         "rollout.batch_size=6", "rollout.n=2", *overrides])


def scenario_update(model: torch.nn.Module, trajectories: list[tuple[Trajectory, int]], overrides: list[str]):
    """One update of ``model`` (plain SGD at lr 0.5, one fixed mini-batch shuffle) on ``trajectories``;
    returns its metrics."""
    first = trajectories[0][1]
    batch = collate([t for t, _ in trajectories], [grp - first for _, grp in trajectories])
    return run_update(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), batch=batch,
                      cfg=scenario_config(overrides), temperature=1.0,
                      generator=torch.Generator().manual_seed(5)).metrics


def _averaging_clip(original):
    """``clip_grad_norm_`` that first averages the gradients over the ranks: FSDP's reduction, for this
    unsharded model, so that every rank steps on the global gradient and its norm."""

    def clip(params, *args, **kwargs):
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad /= distributed.world_size()
        return original(params, *args, **kwargs)

    return clip


def run_updates(out: Path) -> None:
    """Every scenario on this rank's rows: the rank-averaged metrics, the weights after the update (every
    step taken on the rank-averaged gradient) and, per rank, the number of model forwards (equal on every
    rank, else FSDP's collectives would deadlock)."""
    world, rank = distributed.world_size(), distributed.rank()
    results = []
    for k in range(SCENARIOS):
        overrides, per_rank = scenario(k, world)
        # FSDP2 (gloo): a collective out of step would hang or fail here
        sharded = distributed.shard(tiny_llama())
        scenario_update(sharded, per_rank[rank], overrides)
        fsdp = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in sharded.named_parameters()}
        model = tiny_llama()
        forwards = [0]
        model.model.register_forward_pre_hook(lambda *_, c=forwards: c.__setitem__(0, c[0] + 1))
        original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _averaging_clip(original)
        try:
            metrics = scenario_update(model, per_rank[rank], overrides)
        finally:
            torch.nn.utils.clip_grad_norm_ = original
        results.append({"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "fsdp_weights": fsdp,
                        "metrics": distributed.average_metrics(metrics),
                        "forwards": distributed.gather_objects([forwards[0]])})
    if rank == 0:
        torch.save(results, out / "updates.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--examples", type=int, default=100)
    args = ap.parse_args()
    distributed.init("cpu")
    out = Path(args.out)
    examples = check_advantages(args.examples)
    run_updates(out)
    if distributed.rank() == 0:
        (out / "advantages.json").write_text(json.dumps({"world": distributed.world_size(), "examples": examples}))
    distributed.destroy()


if __name__ == "__main__":
    main()
