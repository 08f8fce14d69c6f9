"""A small offline AgentEnv for the verl backend tests: add two numbers, one action, reward 1 if right."""

from __future__ import annotations

from agentrl.envs import AgentEnv


class AddEnv(AgentEnv):
    instructions = "Answer with the sum only."
    single_turn = True

    @classmethod
    def generate_task(cls, rng, split="train"):
        a, b = (int(x) for x in rng.integers(0, 50, size=2))
        return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}

    def reward(self, ctx):
        ok = ctx.final is not None and ctx.final.strip() == self.task["answer"]
        return float(ok), {"correct": float(ok)}


def register() -> str:
    import agentrl

    agentrl.envs.register("verl_add", "_verl_test_env:AddEnv")
    return "verl_add"


class AddEnvMultiTurn(AddEnv):
    """AddEnv whose episode continues (with an env note) until a final answer or ``max_turns``; a wrong
    episode scores minus its response length / 1000 (so rewards differ between episodes)."""

    single_turn = False

    def reward(self, ctx):
        total, parts = super().reward(ctx)
        if not total:
            total = -len(ctx.trajectory.response_ids) / 1000
        return total, parts


def register_multi_turn() -> str:
    import agentrl

    agentrl.envs.register("verl_add_multi", "_verl_test_env:AddEnvMultiTurn")
    return "verl_add_multi"
