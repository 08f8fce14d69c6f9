"""Asynchronous rollouts with a staleness bound: the next steps' groups decode while the current step trains.

:class:`AsyncRollouts` is the trainer's rollout when ``rollout.max_staleness`` (``k``) is set. Step ``s``
(1-based) trains on the batch of ``rollout.batch_size`` groups (tasks x ``rollout.n`` samples) that the
synchronous trainer would draw at step ``s``: the same tasks, env seeds and group ids, in the same order. What
changes is when they are sampled: the batch of step ``s`` may start once the weights have version ``s - 1 - k``
(version ``v``: the weights after ``v`` updates), so up to ``k + 1`` batches are in flight, and the update of step
``s`` runs (in a worker thread) while the batches of steps ``s + 1 .. s + k`` keep decoding.

Guarantees:

- **Staleness bound.** Every token trained at step ``s`` (proximal weights: version ``s - 1``) was sampled with a
  version in ``[s - 1 - k, s - 1]``: its batch did not start before version ``s - 1 - k``, and the trainer waits
  for the batch before it updates. No group is started that could exceed the bound, so none is ever discarded
  for staleness (groups are dropped only as the synchronous trainer drops them:
  :func:`~agentrl.train.rollout.trainable`). :meth:`AsyncRollouts.next_batch` checks the bound on every token's
  recorded version and raises if it were broken.
- **Oldest first.** Batches are trained in the order they were started, each whole (the trainer waits for the
  oldest batch's slowest episode while the newer batches decode), so no group waits behind newer ones and the
  batches are the synchronous trainer's.
- **Exact correction.** Each token records the version whose weights computed its logits and its exact
  behaviour log-prob (:class:`~agentrl.harmony.trajectory.Trajectory`'s ``token_versions`` and
  ``rollout_logprobs``); the update's decoupled PPO loss (:mod:`agentrl.train.algorithms.decoupled`) clips the
  ratio against the weights before the update (the proximal policy) and corrects behaviour -> proximal with
  ``algorithm.rollout_correction``.
- **Resume.** A checkpoint holds the weights and the data position of the next step to train; batches in flight
  are not saved. A resumed run collects them again from that position with the restored weights (their
  staleness is then lower, never higher), so no group is lost or trained twice.

How the weights reach the sampler: the episodes sample from a separate rollout copy of the model served by an
engine of ``rollout.engine``'s kind (:class:`~agentrl.engines.decode.decode_engine.DecodeEngine` or
:class:`~agentrl.engines.transformers_engine.TransformersEngine`); after each update the trainer's new trainable
tensors are copied into it with the engine's ``update_weights`` (the LoRA adapter alone with ``update_lora``),
which lands between two decode steps and sets the engine's policy version. Episodes in flight go on with the new
weights and keep their KV cache (the engines' module docstrings say why that keeps the correction exact). The
copy costs one more set of weights; it is also what lets the rollout live on a GPU of its own later
(disaggregated), with only this copy step changing.

With ``max_staleness=0`` :class:`AsyncRollouts` reduces to the synchronous trainer: one batch in flight, started
after the previous update, on the trainer's own engine, reseeded per step as :meth:`Trainer.train_step
<agentrl.train.trainer.Trainer.train_step>` does (the trainer itself takes its plain path at 0; the equality is a
test).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from agentrl import seeds
from agentrl.episodes import EnvPool, EpisodeResult
from agentrl.train.rollout import RolloutResult, rollout


class StalenessError(RuntimeError):
    """A token's recorded policy version is outside the bound (a bug: the bound holds by construction)."""


class AsyncRollouts:
    """The batches in flight of one run (module docstring). ``trainer``: the
    :class:`~agentrl.train.trainer.Trainer` (its config, state, task stream, sampling and engine);
    ``max_staleness``: ``k`` (default ``rollout.max_staleness``)."""

    def __init__(self, trainer: Any, max_staleness: int | None = None) -> None:
        cfg = trainer.cfg
        self.trainer = trainer
        self.bound = int(cfg.rollout.max_staleness if max_staleness is None else max_staleness)
        if self.bound < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.bound}")
        if trainer.parallel.world_size > 1:
            raise ValueError("asynchronous rollouts run in one process (trainer.n_gpus=1)")
        self.pending: dict[int, asyncio.Future[RolloutResult]] = {}
        #: step -> the version its batch (last) started at, for every batch this object started
        self.launched: dict[int, int] = {}
        self.pool: EnvPool | None = None
        self.lora = False
        if self.bound == 0:
            self.engine = trainer.engine
        else:
            self.engine = self._rollout_engine()

    # ------------------------------------------------------------------ the rollout copy
    def _rollout_engine(self) -> Any:
        """An engine of ``rollout.engine``'s kind over a copy of the trainer's model, at the trainer's current
        version."""
        from agentrl.engines.factory import make_engine
        from agentrl.models.lora import has_lora

        trainer, cfg = self.trainer, self.trainer.cfg
        model = copy.deepcopy(trainer.model).eval()
        model.requires_grad_(False)
        self.lora = has_lora(trainer.model)
        engine = make_engine(model, kind=cfg.rollout.engine, pad_token_id=trainer.actor.pad_token_id,
                             max_batch_size=cfg.rollout.max_batch_size, seed=cfg.seed,
                             record_routing=cfg.actor.routing_replay)
        engine.policy_version = trainer.state.step
        return engine

    def publish(self) -> None:
        """After an update (``trainer.state.step`` already counts it): copy the new weights into the rollout
        engine as version ``state.step``, then start the batches that version admits (``k > 0``). Updates land
        between decode steps; episodes in flight go on with the new weights."""
        if self.bound == 0:
            return  # the trainer's own engine samples from the trained model itself, started lazily
        model, version = self.trainer.model, self.trainer.state.step
        if self.lora:
            from agentrl.models.lora import adapter_state_dict

            self.engine.update_lora(adapter_state_dict(model), version=version)
        else:
            self.engine.update_weights({n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
                                       version=version)
        if self.pool is not None:
            self._launch()

    # ------------------------------------------------------------------ batches
    def _launch(self) -> None:
        """Start every batch the current version admits: steps up to ``state.step + 1 + k`` (and at most
        ``trainer.total_steps``) not started yet."""
        trainer, cfg, state = self.trainer, self.trainer.cfg, self.trainer.state
        last = min(int(cfg.trainer.total_steps), state.step + 1 + self.bound)
        for step in range(state.step + 1, last + 1):
            if step in self.pending:
                continue
            start = state.data_position + (step - state.step - 1) * cfg.rollout.batch_size
            tasks = [trainer.train_task(start + i) for i in range(cfg.rollout.batch_size)]
            if self.bound == 0:  # as the synchronous trainer: one batch in flight, its engine reseeded per step
                self.engine.reseed(seeds.engine_seed(cfg.seed, step, 1, 0))  # one rank: async needs one GPU
            self.pending[step] = asyncio.ensure_future(rollout(
                self.pool, self.engine, trainer.sampling(cfg.rollout.temperature), tasks, n=cfg.rollout.n,
                seed=seeds.rollout_seed(cfg.seed, start, cfg.rollout.n),
                progress_interval_s=cfg.trainer.progress_interval_s if self.bound == 0 else 0.0))
            self.launched[step] = state.step

    async def next_batch(self, pool: EnvPool) -> RolloutResult:
        """The batch of step ``state.step + 1``, once all its episodes ended (started now if it was not yet).
        Each episode's ``policy_version`` is the version it started with; raises :class:`StalenessError` if a
        token's version is outside ``[state.step - k, state.step]``."""
        self.pool = pool
        self._launch()
        step, version = self.trainer.state.step + 1, self.trainer.state.step
        task, launched = self.pending.pop(step), self.launched[step]
        result = await task
        for e in result.episodes:
            e.trajectory.policy_version = min(_model_versions(e), default=launched)
            _check_bound(e, version, self.bound, launched)
        return result

    async def update(self, fn: Callable[[list[EpisodeResult]], dict[str, float]],
                     episodes: list[EpisodeResult]) -> dict[str, float]:
        """``fn(episodes)`` (the trainer's update): in a worker thread while other batches decode (``k > 0``),
        inline otherwise."""
        if self.bound == 0 or not self.pending:
            return fn(episodes)
        return await asyncio.to_thread(fn, episodes)

    async def aclose(self) -> None:
        """Cancel the batches in flight (the run stopped early; a resumed run collects them again)."""
        tasks, self.pending = list(self.pending.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def staleness_metrics(episodes: list[EpisodeResult], version: int) -> dict[str, float]:
    """``async/staleness_mean`` and ``async/staleness_max``: ``version`` (the proximal weights) minus the
    recorded version of each model token of ``episodes``; ``async/stale_token_fraction``: the share of tokens
    with a positive staleness. Empty without a model token."""
    lags = [version - v for e in episodes for v in _model_versions(e)]
    if not lags:
        return {}
    return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags)),
            "async/stale_token_fraction": sum(1 for x in lags if x > 0) / len(lags)}


def _model_versions(episode: EpisodeResult) -> list[int]:
    traj = episode.trajectory
    if traj.token_versions is None:
        return []
    return [v for v, m in zip(traj.token_versions, traj.response_mask, strict=True) if m]


def _check_bound(episode: EpisodeResult, version: int, bound: int, launched: int) -> None:
    versions = _model_versions(episode)
    if launched < version - bound or any(not version - bound <= v <= version for v in versions):
        raise StalenessError(
            f"episode {episode.trajectory.task_id}/{episode.sample} was started at version {launched} with token "
            f"versions {sorted(set(versions))}, outside [{version - bound}, {version}] for the update at version "
            f"{version} (rollout.max_staleness={bound})")
