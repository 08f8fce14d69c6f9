"""A deterministic scripted :class:`~agentrl.engines.base.RolloutEngine` for tests and ``benchmarks/eval_bench.py``
(not part of the package: nothing in agentrl runs it).

It answers with assistant messages chosen by a Python function instead of a neural network, rendered
token-exactly by the format (``format.render_completion``, e.g. :class:`~agentrl.harmony.HarmonyFormat`).
Served behind ``agentrl.engines.server.create_app`` it is a real OpenAI-compatible endpoint whose
answers are known in advance, so eval metrics such as pass@k can be checked in closed form, and with
``delay_s`` it stands in for a served model's latency.

Contract: ``policy(prompt_text, sampling) -> list[Message]`` gets the decoded prompt (the whole
conversation so far, special tokens literal) and the sampling parameters (``sampling.seed`` tells
samples apart) and returns the assistant messages of the completion. The policy is deterministic, so
every emitted token has probability 1: log-probs are ``0.0``. ``max_new_tokens`` truncates the
completion (``finish_reason="length"``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from agentrl.engines.base import Completion, SamplingParams
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.types import Message

Policy = Callable[[str, SamplingParams], list[Message]]


class ScriptedEngine:
    """Plays back ``policy``'s messages as token ids after ``delay_s`` seconds per request."""

    def __init__(self, fmt: ChatFormat, policy: Policy, *, delay_s: float = 0.0):
        if not hasattr(fmt, "render_completion"):
            raise TypeError(
                f"{type(fmt).__name__} cannot render completions; ScriptedEngine needs render_completion"
            )
        self.format = fmt
        self.policy = policy
        self.delay_s = delay_s
        self.requests = 0

    def _one(self, prompt: Sequence[int], sampling: SamplingParams) -> Completion:
        messages = self.policy(self.format.decode(prompt), sampling)
        ids = list(self.format.render_completion(messages))  # type: ignore[attr-defined]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """One completion per prompt, after the fixed delay (the delay overlaps across concurrent calls)."""
        self.requests += len(prompts)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return [self._one(p, sampling) for p in prompts]


def scripted_verl_agent_loop(engine: ScriptedEngine, *, response_length: int):
    """verl's ``AgentrlAgentLoop`` whose server manager answers from ``engine`` (needs verl installed), with
    verl's prompt length 1024 and ``response_length`` tokens of response."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.workers.rollout.replica import TokenOutput

    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.train.verl_backend.agent_loop import AgentrlAgentLoop

    class ServerManager:
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            sampling = SamplingParams(max_new_tokens=sampling_params["max_tokens"],
                                      stop_token_ids=sampling_params["stop_token_ids"])
            (c,) = await engine.generate([prompt_ids], sampling)
            return TokenOutput(token_ids=c.token_ids, log_probs=c.logprobs)

    rollout = {"prompt_length": 1024, "response_length": response_length}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    return AgentrlAgentLoop(DictConfigWrap(config), ServerManager(), harmony_hf_tokenizer(), None, None,
                            DictConfigWrap(OmegaConf.create({})))


class TrainerEngine(ScriptedEngine):
    """The scripted engine with the two things the trainer asks of its local engine: ``stats`` and ``reseed``
    (a scripted policy has no random state to reseed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = {"generate_s": 0.0, "generated_tokens": 0}

    def reseed(self, seed: int) -> None:
        pass

    async def generate(self, prompts, sampling):
        out = await super().generate(prompts, sampling)
        self.stats["generated_tokens"] += sum(len(c.token_ids) for c in out)
        return out
