"""The RolloutEngine contract shared by the local transformers engine and OpenAI-compatible servers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class SamplingParams:
    """How to sample. ``max_new_tokens`` bounds one assistant action; ``stop_token_ids`` end it
    (the stop token itself is included in the returned ids)."""

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """One sampled continuation.

    ``token_ids``: sampled ids (stop token included when one was hit). ``logprobs``: natural-log
    probability of each sampled id under the sampling distribution's model (same length).
    ``finish_reason``: ``"stop"`` (hit a stop token) or ``"length"`` (hit ``max_new_tokens``).
    ``routing``: optional per-token MoE expert choices recorded during sampling (for routing replay).
    ``policy_versions``: per sampled id, the policy version of the weights that computed its logits, from an
    engine that takes weight updates while requests run (``DecodeEngine.update_weights``); None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routing: Any = None
    policy_versions: list[int] | None = None


class AsyncClosing:
    """``async with obj:`` gives ``obj`` and closes it on exit (``await obj.aclose()``)."""

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release what the object holds (subclasses)."""


class EngineAborted(RuntimeError):
    """Generation was stopped because the engine is shutting down (e.g. the server got SIGTERM)."""


class RolloutEngine(Protocol):
    """Samples completions for a batch of token prompts.

    An engine that can stream also accepts ``generate(..., on_token=fn)`` and calls
    ``fn(prompt_index, token_id)`` on the event loop as each token is sampled (the transformers engine
    does); ``agentrl serve model`` then streams chat completions incrementally."""

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """Return one :class:`Completion` per prompt, in order."""
        ...


def checked_parameters(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``model``'s parameters by name, after checking that every tensor of ``state`` (an ``update_weights``
    payload) names one of them and has its shape: ValueError naming the key otherwise, before anything is
    copied."""
    params = dict(model.named_parameters())
    for name, value in state.items():
        if name not in params:
            raise ValueError(f"update_weights: the engine's model has no parameter {name!r}")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, the engine's model "
                             f"{tuple(params[name].shape)}")
    return params
