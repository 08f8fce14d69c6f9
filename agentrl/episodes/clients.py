"""One engine client per episode: what makes an episode's sampling its own.

An engine with clients (``engine.client(seed)``, e.g. :class:`agentrl.engines.decode.decode_engine.DecodeEngine`)
keys the randomness of each request by its client's seed and the request itself (the prompt's length: the turns
of one episode have strictly growing prompts), never by which other requests shared its batches. Two episodes
sample independently only through clients of different seeds. :class:`EpisodeClients` opens one client per
running episode for :func:`~agentrl.episodes.collect`'s ``policy`` callable and closes it when the episode ends,
when it is run again after an infrastructure failure, and at :meth:`EpisodeClients.close` (an engine's
deterministic mode waits for every open client, so none may be left open).

An engine without clients (the transformers engine: its draws depend on the batch) is sampled in lockstep
instead (:class:`~agentrl.episodes.LockstepSampler`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrl.episodes.collect import EpisodeJob
from agentrl.episodes.policy import Policy
from agentrl.episodes.runner import EpisodeResult


def has_clients(engine: Any) -> bool:
    """Whether ``engine`` opens per-episode clients (``engine.client(seed)``; module docstring)."""
    return callable(getattr(engine, "client", None))


class EpisodeClients:
    """One client of ``engine`` per running episode. :meth:`policy` is ``collect``'s ``policy``: it opens the
    job's client with seed ``seed_of(job)`` and returns ``policy_of(client, job)``; :meth:`finished` closes the
    client of a finished (or failed) episode; :meth:`close` closes those still open."""

    def __init__(self, engine: Any, seed_of: Callable[[EpisodeJob], int],
                 policy_of: Callable[[Any, EpisodeJob], Policy]) -> None:
        self.engine, self.seed_of, self.policy_of = engine, seed_of, policy_of
        self._open: dict[tuple[Any, Any, int], Any] = {}

    def policy(self, job: EpisodeJob) -> Policy:
        key = (job.task_id, job.group, job.sample)
        previous = self._open.pop(key, None)  # the job runs again after an infrastructure failure
        if previous is not None:
            previous.close()
        self._open[key] = client = self.engine.client(self.seed_of(job))
        return self.policy_of(client, job)

    def finished(self, result: EpisodeResult) -> None:
        client = self._open.pop((result.task_id, result.group, result.sample), None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for client in self._open.values():
            client.close()
        self._open.clear()
