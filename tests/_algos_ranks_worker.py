"""One torchrun rank of ``tests/test_algos_ranks.py`` (CPU, gloo): what does not depend on the number of ranks.

1. Advantages (hypothesis, derandomized, so every rank draws the same examples): each rank holds its own
   rows (its own response width, its own group ids 0..k-1, whole groups, ragged and empty masks) and calls
   :func:`agentrl.train.update.batch_advantages`; its rows must equal those of the single-process
   ``compute_advantages`` on the concatenated batch, for every estimator (the whitened REINFORCE++ ones
   are the point). Every rank checks its own rows and the verdicts are gathered, so the ranks stay in step.
2. A policy update: each rank runs ``update_policy`` on its share of :func:`scenario_trajectories` (an
   unsharded tiny model and plain SGD at lr 0), the gradients are averaged over the ranks (what FSDP's
   reduction does) and rank 0 saves them with the rank-averaged metrics, for the test to compare with
   the single-process update on all the rows.

usage: torchrun --standalone --nproc_per_node=2 tests/_algos_ranks_worker.py --out DIR [--examples 100]
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
from _tiny_update import tiny_llama  # noqa: E402

from agentrl.harmony.trajectory import Trajectory  # noqa: E402
from agentrl.train import distributed  # noqa: E402
from agentrl.train.algorithms import compute_advantages  # noqa: E402
from agentrl.train.batch import Batch, collate  # noqa: E402
from agentrl.train.config import build_config  # noqa: E402
from agentrl.train.update import batch_advantages, update_policy  # noqa: E402

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo", "rloo", "opo")
#: (estimator, loss_agg_mode, rejection options, thresholds) of the update scenarios
SCENARIOS = [
    ("reinforce_plus_plus", "token-mean", "token_k1", "0.5_2.0"),
    ("reinforce_plus_plus", "seq-mean-token-mean", "seq_max_k2,token_k1", "2.0,0.5_2.0"),
    ("reinforce_plus_plus_baseline", "seq-mean-token-sum", "seq_max_k2", "2.0"),
    ("reinforce_plus_plus_baseline", "seq-mean-token-sum-norm", "token_k1", "0.5_2.0"),
    ("grpo", "seq-mean-token-mean", "seq_max_k2,token_k1", "2.0,0.5_2.0"),
]
GROUPS_PER_RANK, GROUP_SIZE = (2, 3), 3


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


def scenario_trajectories(seed: int) -> list[tuple[Trajectory, int]]:
    """``(trajectory, group)`` for ``sum(GROUPS_PER_RANK)`` groups of ``GROUP_SIZE``: ragged prompts and
    responses with env tokens inside, rewards varying within groups, rollout log-probs around the tiny
    model's (about -4.6 on its 100-token vocabulary) so that the rejection options reject some tokens and
    some whole rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(sum(GROUPS_PER_RANK) * GROUP_SIZE):
        length = int(torch.randint(2, 9, (1,), generator=g))
        ids = torch.randint(6, 100, (length,), generator=g).tolist()
        mask = [1] * length
        if length > 4:
            mask[2] = mask[3] = 0
        prompt = torch.randint(6, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        logprobs = (-4.6 + torch.randn(length, generator=g)).tolist()
        reward = float(torch.rand(1, generator=g)) * (i % 2)
        out.append((Trajectory(prompt_ids=prompt, response_ids=ids, response_mask=mask, rollout_logprobs=logprobs,
                               reward=reward), i // GROUP_SIZE))
    return out


def scenario_config(estimator: str, mode: str, rs: str, threshold: str):
    return build_config([
        "env=retool", f"algorithm.adv_estimator={estimator}", f"actor.loss_agg_mode={mode}", "actor.grad_clip=1e9",
        f"algorithm.rollout_correction.rollout_rs={rs}", f"algorithm.rollout_correction.rollout_rs_threshold='{threshold}'",
        "actor.micro_batch_size=2", "actor.share_prompt_prefix=false",
    ])


def run_updates(out: Path) -> None:
    rank = distributed.rank()
    first = sum(GROUPS_PER_RANK[:rank])
    results = []
    for k, scenario in enumerate(SCENARIOS):
        mine = [(t, grp - first) for t, grp in scenario_trajectories(k)
                if first <= grp < first + GROUPS_PER_RANK[rank]]
        batch = collate([t for t, _ in mine], [grp for _, grp in mine])
        model = tiny_llama()
        metrics = update_policy(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), batch=batch,
                                cfg=scenario_config(*scenario), temperature=1.0)
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            grads[name] = grad / distributed.world_size()
        results.append({"grads": grads, "metrics": distributed.average_metrics(metrics)})
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
