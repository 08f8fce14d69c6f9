"""What drives an episode: a :class:`Policy` sees the episode so far and returns the next action(s).

A policy is anything with ``async act(episode) -> Sequence[action]``. An action is what
:meth:`AgentEnv.astep <agentrl.envs.AgentEnv.astep>` accepts: an object with ``token_ids`` and
``logprobs`` (an engine's ``Completion`` or an :class:`Action`), token ids, or text. Returning several
actions lets one model reply become several env steps (a chat reply with parallel tool calls); the
runner steps them in order and drops the rest once the env ends the episode.

Policies in the library:

- :class:`TokenPolicy`: samples from any token engine (``engine.generate(prompts, sampling)``: the
  local transformers engine, an OpenAI-compatible ``/v1/completions`` endpoint, a scripted engine) on
  the exact token stream so far. Used by the trainer, ``agentrl eval`` and the verl agent loop.
- :class:`agentrl.runtime.ChatPolicy`: a chat-completions endpoint with tools (product agents, hosted
  models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from agentrl.episodes.state import EpisodeState
from agentrl.harmony.trajectory import SamplingRecord


@dataclass
class Action:
    """One env action: the completion's token ids and, when the policy sampled them, their log-probs.

    ``token_ids``: ids after the assistant header, stop token included when one was emitted.
    ``logprobs``: natural-log probability of each id under the sampling distribution (same length), or
    ``None`` when the ids were not sampled here (rendered from a chat reply); the trajectory then holds
    0.0 for them. ``finish_reason``: ``"stop"`` or ``"length"``. ``routing``: optional MoE routing
    recorded while sampling (routing replay).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    routing: Any = None


@runtime_checkable
class Policy(Protocol):
    """Chooses the next action(s) of an episode."""

    async def act(self, episode: EpisodeState) -> Sequence[Any]:
        """The next action(s) for ``episode`` (at least one).

        Args:
            episode: the episode so far; ``episode.context`` is the exact token stream (prompt, model
                tokens and env tokens) the next action continues, ``episode.tokens_left`` the room left
                under the env's ``max_total_tokens``.

        Returns:
            A non-empty sequence of actions (see the module docstring), stepped in order.

        Raises:
            Any exception: the episode stops and the exception propagates to the caller of
            :func:`~agentrl.episodes.run_episode` (collection keeps the partial trajectory).
        """
        ...


class TokenSampler(Protocol):
    """What :class:`TokenPolicy` needs of an engine (:class:`agentrl.engines.base.RolloutEngine`)."""

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> Sequence[Any]: ...


class TokenPolicy:
    """Samples one completion per step from a token engine, token-in-token-out.

    Args:
        engine: ``await engine.generate([context], sampling)`` returns one completion with
            ``token_ids`` and ``logprobs`` (and optionally ``routing``).
        sampling: an :class:`agentrl.engines.base.SamplingParams` (a dataclass with
            ``max_new_tokens``); ``max_new_tokens`` is lowered to the episode's ``tokens_left`` so a
            trajectory never exceeds the env's ``max_total_tokens``. Recorded in the trajectory's
            ``sampling``.

    Raises (from :meth:`act`): ``ValueError`` when the prompt alone fills ``max_total_tokens``.
    """

    def __init__(self, engine: TokenSampler, sampling: Any):
        self.engine = engine
        self.sampling = sampling

    async def act(self, episode: EpisodeState) -> list[Any]:
        budget = episode.tokens_left
        if budget < 1:
            raise ValueError(
                f"no room for a completion: the context has {len(episode.context)} tokens and the env's "
                f"max_total_tokens is {episode.env.limits.max_total_tokens}; raise max_total_tokens or "
                "shorten the prompt"
            )
        sampling = self.sampling
        episode.trajectory.sampling = SamplingRecord.of(sampling)
        if sampling.max_new_tokens > budget:
            sampling = replace(sampling, max_new_tokens=budget)
        (completion,) = await self.engine.generate([episode.context], sampling)
        return [completion]
