"""agentrl.episodes: the one episode loop, below every caller (trainer, eval, verl agent loop, product Agent).

A :class:`Policy` chooses actions, :func:`run_episode` steps an :class:`~agentrl.envs.AgentEnv` with them
until the env ends the episode (or an :class:`EpisodeLimits` limit does) and returns the env's
token-exact trajectory; :func:`collect` runs many episodes concurrently over an :class:`EnvPool`.
Depends only on ``agentrl.envs`` and ``agentrl.harmony``; imports no torch.
"""

from agentrl.episodes.clients import EpisodeClients, has_clients
from agentrl.episodes.collect import EnvPool, EpisodeJob, collect, grouped_jobs
from agentrl.episodes.lockstep import LockstepSampler
from agentrl.episodes.policy import Action, Policy, TokenPolicy
from agentrl.episodes.runner import STOP_REASONS, EpisodeLimits, EpisodeResult, run_episode
from agentrl.episodes.state import EpisodeState, Step

__all__ = [
    "STOP_REASONS",
    "Action",
    "EnvPool",
    "EpisodeClients",
    "EpisodeJob",
    "EpisodeLimits",
    "EpisodeResult",
    "EpisodeState",
    "LockstepSampler",
    "Policy",
    "Step",
    "TokenPolicy",
    "collect",
    "grouped_jobs",
    "has_clients",
    "run_episode",
]
