"""The random streams of a run, named once: every seed and task index a run derives from ``seed`` (the config's)
is made here, so that two streams never meet by accident and a changed constant changes every user of it.

- Training tasks: task ``i`` of the training stream is drawn with ``seed`` (:class:`~agentrl.envs.task_source.
  TaskSource`); RL reads indices from 0 on, the SFT stage's teacher demonstrations from :data:`DEMO_TASKS` on.
- Held-out tasks: drawn with :func:`held_out_seed` (``seed + eval.seed_offset``, by default
  :data:`HELD_OUT_OFFSET`): problems disjoint from the training stream.
- Sampling: the engine is re-seeded at each RL step with :func:`engine_seed`, and the rollout's episodes get
  :func:`rollout_seed`; both are ``seed * ``:data:`SAMPLING_STRIDE` plus a position, so that no two steps,
  ranks or tasks share one.
- SFT data: the teacher's episodes run with :func:`sft_data_seed`.
- Evaluation: sample ``j`` of an item runs with env seed ``seed + j``; an engine with clients samples it through
  a client seeded with :func:`eval_client_seed`, distinct for every item and sample.
"""

from __future__ import annotations

import hashlib

#: the default ``eval.seed_offset``: the held-out tasks' seed is ``seed + HELD_OUT_OFFSET``
HELD_OUT_OFFSET = 1_000_000
#: the first training-task index of the SFT stage's demonstrations (RL's tasks start at 0)
DEMO_TASKS = 1_000_000_000
#: a prime above any step or task count: ``seed * SAMPLING_STRIDE + position`` keeps runs' sampling seeds apart
SAMPLING_STRIDE = 1_000_003
#: the SFT teacher episodes' seed is ``seed + SFT_DATA_OFFSET``
SFT_DATA_OFFSET = 31_337


def held_out_seed(seed: int, offset: int = HELD_OUT_OFFSET) -> int:
    """The held-out tasks' seed (``offset``: ``eval.seed_offset``)."""
    return seed + offset


def engine_seed(seed: int, step: int, world_size: int, rank: int) -> int:
    """The engine's sampling seed for RL step ``step`` (1-based) on ``rank`` of ``world_size``."""
    return seed * SAMPLING_STRIDE + step * world_size + rank


def rollout_seed(seed: int, first_task: int, n: int) -> int:
    """The seed of a rollout whose first task is ``first_task`` (its index in the training stream), ``n``
    samples per task."""
    return seed * SAMPLING_STRIDE + first_task * n


def sft_data_seed(seed: int) -> int:
    """The seed of the SFT stage's teacher episodes."""
    return seed + SFT_DATA_OFFSET


def eval_client_seed(seed: int, item_id: object, sample: int) -> int:
    """The engine-client seed of sample ``sample`` of item ``item_id`` in an evaluation with seed ``seed``: a
    62-bit hash of the three, the same on every machine and process (not Python's salted ``hash``), so a resumed
    evaluation samples what the first run would have."""
    digest = hashlib.blake2b(repr((int(seed), str(item_id), int(sample))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)
