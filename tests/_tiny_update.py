"""A tiny dense model and ragged multi-turn-like batches for update tests (shared by several test files)."""

from __future__ import annotations

import torch

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.batch import Batch, collate


def ragged_batch(n: int, seed: int = 0) -> Batch:
    """``n`` rows: ragged prompts and responses, an env observation (mask 0) inside the longer responses,
    rewards that vary within each group of 3, rollout log-probs of -1 (callers overwrite them)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        length = int(torch.randint(2, 9, (1,), generator=g))
        ids = torch.randint(6, 100, (length,), generator=g).tolist()
        mask = [1] * length
        if length > 4:
            mask[2] = mask[3] = 0
        prompt = torch.randint(6, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=ids, response_mask=mask,
                                rollout_logprobs=[-1.0] * length, reward=float(i % 3 == 0) + 0.1 * i))
    return collate(trajs, [i // 3 for i in range(n)])
