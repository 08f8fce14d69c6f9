"""The smallest env a random tiny model trains on for real: one action per episode, reward 1 when the first
sampled token id is even, so rewards vary within a group and every update takes a real optimizer step. The
trainer tests (``test_train_trainer.py``, ``test_train_async.py``) register it under names of their own."""

from __future__ import annotations

from agentrl.envs.env import AgentEnv


class ParityEnv(AgentEnv):
    """One action per episode; reward 1 when the first sampled token id is even (varies within a group)."""

    single_turn = True

    @classmethod
    def generate_task(cls, rng, split="train"):
        n = int(rng.integers(10**6))
        return {"id": str(n), "prompt": f"Say something about {n}.", "answer": "0"}

    def reward(self, ctx):
        first = ctx.trajectory.response_ids[0] if ctx.trajectory.response_ids else 1
        return float(first % 2 == 0), {"even": float(first % 2 == 0)}
