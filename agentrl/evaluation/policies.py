"""How each ``api`` drives eval episodes: the env to build and the policy of each job.

``completions`` (an endpoint or a local model): a :class:`~agentrl.episodes.TokenPolicy` on the engine,
token-in-token-out. ``chat``: a :class:`~agentrl.runtime.ChatPolicy` on the endpoint. Both run through the
shared episode loop (:func:`agentrl.episodes.run_episode`) that training, the verl agent loop and the product
``Agent`` run, so an evaluation episode is exactly a training rollout.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from typing import Any

from agentrl import seeds
from agentrl.engines.base import SamplingParams
from agentrl.episodes import (
    EpisodeClients,
    EpisodeJob,
    EpisodeResult,
    LockstepSampler,
    Policy,
    TokenPolicy,
    has_clients,
)
from agentrl.evaluation.config import EvalConfig
from agentrl.harmony.trajectory import Trajectory


async def open_runner(cfg: EvalConfig, stack: contextlib.AsyncExitStack) -> EpisodeRunner:
    """The episode runner for ``cfg.api`` and ``cfg.model``; its resources (sandbox backend, HTTP client,
    engine) are entered on ``stack`` and closed with it."""
    from agentrl.envs.registry import env_class

    cls = env_class(cfg.env)
    env_kwargs = env_kwargs_of(cfg, cls)
    if "sandbox" in inspect.signature(cls.__init__).parameters and "sandbox" not in env_kwargs:
        from agentrl.envs.sandbox import make_backend

        backend = make_backend(cfg.sandbox)  # shared by all envs
        admit = getattr(backend, "admit", None)
        if admit is not None:  # a session for every episode in flight, where the memory backs them (before it starts)
            admit(min(cfg.concurrency, cfg.limit * cfg.n) if cfg.limit else cfg.concurrency)
        backend = await stack.enter_async_context(backend)
        await backend.run("pass")  # start the pool before the first episode
        env_kwargs["sandbox"] = backend
    if cfg.api == "chat":
        from agentrl.engines.client import ChatClient, Endpoint

        client = await stack.enter_async_context(ChatClient(_endpoint(cfg, Endpoint)))
        return ChatRunner(cls, env_kwargs, cfg, client)
    if cfg.is_endpoint:
        from agentrl.engines.client import Endpoint, OpenAIEngine

        engine = await stack.enter_async_context(OpenAIEngine(_endpoint(cfg, Endpoint)))
        served = await _served_format(engine.endpoint) if cfg.format == "auto" else None
        if served is not None:  # auto: the server's own format (agentrl serve model describes it)
            fmt = served
        else:
            from agentrl.harmony import make_format

            fmt = make_format(cfg.format)
    else:
        from agentrl.engines.server import load_local_engine

        engine, fmt, _ = load_local_engine(cfg.model, format=cfg.format, seed=cfg.seed, max_batch_size=cfg.max_batch_size)
        # on the way out, above all on Ctrl-C, the sampling thread stops at its next token instead of finishing
        # its batch (which asyncio.run would wait for)
        stack.callback(engine.abort)
    return TokenRunner(cls, {**env_kwargs, "format": fmt}, cfg, engine)


def env_kwargs_of(cfg: EvalConfig, cls: type) -> dict[str, Any]:
    """The constructor arguments of the evaluation's envs: ``env_kwargs``, with the boxed-answer bonus of
    ``format_reward`` on the env's rubric when set."""
    kwargs = dict(cfg.env_kwargs)
    if cfg.format_reward:
        from agentrl.envs.rewards import with_boxed_bonus

        kwargs["rubric"] = with_boxed_bonus(cls.rubric, cfg.format_reward)
    return kwargs


def _endpoint(cfg: EvalConfig, endpoint_cls: Any) -> Any:
    return endpoint_cls(
        cfg.model,
        api_key=cfg.api_key,
        model=cfg.served_model,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.retries,
        max_concurrency=cfg.concurrency,
    )


async def _served_format(endpoint: Any) -> Any:
    """The endpoint's own ChatFormat, or ``None`` if it describes none or cannot be reached now (the
    episodes then fail, are recorded in ``errors.jsonl`` and retried by the next run)."""
    from agentrl.engines.client import EndpointError

    try:
        return await endpoint.served_format()
    except EndpointError:
        return None


class EpisodeRunner(abc.ABC):
    """How one ``api`` drives episodes: the env to build, the policy of each job and, for a local engine, the
    :class:`~agentrl.episodes.LockstepSampler` its policies sample through (``lockstep``; None otherwise)."""

    lockstep: LockstepSampler | None = None

    def __init__(self, cls: type, env_kwargs: dict[str, Any], cfg: EvalConfig, backend: Any):
        self.cls, self.env_kwargs, self.cfg, self.backend = cls, env_kwargs, cfg, backend

    def make_env(self) -> Any:
        return self.cls(**self.env_kwargs)

    @abc.abstractmethod
    def policy(self, job: EpisodeJob) -> Policy:
        """The policy of one episode (sample ``job.sample`` is drawn with seed ``cfg.seed + job.sample``)."""

    def finished(self, result: EpisodeResult) -> None:  # noqa: B027 - optional hook
        """The episode of ``result`` ended (finished or failed): release what :meth:`policy` opened for it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The episodes are over: release what :meth:`policy` opened and is still open."""

    def label(self, result: EpisodeResult) -> Trajectory:
        """The finished episode's trajectory with what this evaluation knows about it: ``model``,
        ``latency_s``, ``api`` and ``requests`` (when the policy did not record them)."""
        traj = result.trajectory
        traj.model, traj.latency_s = self.cfg.model, result.wall_s
        if traj.api is None:
            traj.api = self.cfg.api
        if traj.requests is None:
            traj.requests = len(result.steps)
        return traj


class TokenRunner(EpisodeRunner):
    """Token-in-token-out episodes: a :class:`~agentrl.episodes.TokenPolicy` on the engine. A local engine with
    clients (the decode engine) samples each episode through its own client, seeded by
    :func:`agentrl.seeds.eval_client_seed` (distinct for every item and sample); the transformers engine is
    sampled in lockstep. Either way the episodes' figures do not depend on timing (an endpoint batches its own
    requests)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        # looked up once: openai-harmony computes them on each call
        self.stop_ids = list(self.env_kwargs["format"].stop_token_ids)
        self.clients: EpisodeClients | None = None
        if not self.cfg.is_endpoint and has_clients(self.backend):
            self.clients = EpisodeClients(
                self.backend, lambda job: seeds.eval_client_seed(self.cfg.seed, job.task_id, job.sample),
                lambda client, job: TokenPolicy(client, self.sampling(job)),
            )
        elif not self.cfg.is_endpoint:
            self.lockstep = LockstepSampler(self.backend)

    def sampling(self, job: EpisodeJob) -> SamplingParams:
        cfg = self.cfg
        given = {name: getattr(cfg, name) for name in ("max_new_tokens", "temperature", "top_p", "top_k")}
        return SamplingParams(**given, stop_token_ids=self.stop_ids, seed=cfg.seed + job.sample)

    def policy(self, job: EpisodeJob) -> Policy:
        if self.clients is not None:
            return self.clients.policy(job)
        return TokenPolicy(self.lockstep or self.backend, self.sampling(job))

    def finished(self, result: EpisodeResult) -> None:
        if self.clients is not None:
            self.clients.finished(result)

    def close(self) -> None:
        if self.clients is not None:
            self.clients.close()


class ChatRunner(EpisodeRunner):
    """Chat-completions episodes: a :class:`~agentrl.runtime.ChatPolicy` on the endpoint (it records
    ``api``, ``requests`` and token usage in the trajectory)."""

    def policy(self, job: EpisodeJob) -> Policy:
        from agentrl.runtime import ChatPolicy

        cfg = self.cfg
        sampling = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_completion_tokens": cfg.max_new_tokens,
            "seed": cfg.seed + job.sample,
        }
        return ChatPolicy(self.backend, sampling)

