"""Per-step metrics: episode statistics, and the sinks they go to (JSONL, TensorBoard, W&B, console).

Names follow verl where the concept is the same: ``critic/score/mean`` (episode reward),
``response_length/mean``, ``actor/entropy``, ``actor/grad_norm``, ``actor/pg_clipfrac``,
``actor/ppo_kl``, ``actor/kl_loss``, ``rollout_corr/*``, ``timing_s/*``, ``perf/*``. Ours:
``reward/<component>/mean``, ``episode/turns_mean``, ``episode/tool_calls_mean``,
``episode/tool_call_rate`` (episodes with at least one tool call / episodes), ``episode/tool_error_rate``
(tool calls with an error kind / tool calls: the record's own tool statistics,
:attr:`~agentrl.harmony.trajectory.Trajectory.tool_errors`, as in ``agentrl eval``), ``episode/parse_error_rate``
(model turns with a parse error / model turns), ``episode/truncated_frac``, ``episode/rollout_errors``,
``episode/infra_errors`` (episodes a tool's backend ended, after their runs again: left out of the update and of
``critic/score/*``), ``episode/infra_retries`` (runs again after such a failure), ``actor/dropped_groups``
(task groups with no episode trained on).
Held-out evaluations are ``agentrl eval``'s metrics (:mod:`agentrl.train.heldout`), logged as ``eval/*``.

Files go through :mod:`agentrl.rundir`: each record is one appended line of ``RUN_DIR/metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from agentrl import rundir
from agentrl.episodes import EpisodeResult
from agentrl.evaluation.metrics import mean_and_sem

__all__ = ["MetricsSink", "NullSink", "episode_metrics", "mean_and_sem"]


def episode_metrics(episodes: Sequence[EpisodeResult], prefix: str = "") -> dict[str, float]:
    """Reward, length, turn, tool and error statistics over ``episodes`` (failed ones count as reward 0
    in ``critic/score/*`` so that breakage shows up as a drop, and are counted in ``episode/rollout_errors``;
    those whose reward function raised are also counted in ``episode/reward_errors``). An episode a tool's
    backend ended is not the model's: it is left out of ``critic/score/*`` (NaN when every episode is one) and
    counted in ``episode/infra_errors``."""
    if not episodes:
        return {}
    trajs = [e.trajectory for e in episodes]
    rewards = [t.reward if e.usable else 0.0 for e, t in zip(episodes, trajs, strict=True) if not e.infrastructure]
    model_tokens = [sum(t.response_mask) for t in trajs]
    env_tokens = [len(t.response_mask) - sum(t.response_mask) for t in trajs]
    turns = [len(t.turns) for t in trajs]
    tool_calls = sum(t.tool_calls for t in trajs)
    model_turns = [turn for t in trajs for turn in t.turns]
    mean_r, sem_r = mean_and_sem(rewards)
    out: dict[str, float] = {
        "critic/score/mean": mean_r,
        "critic/score/sem": sem_r,
        "critic/score/max": max(rewards, default=math.nan),
        "critic/score/min": min(rewards, default=math.nan),
        "response_length/mean": sum(model_tokens) / len(trajs),
        "response_length/max": float(max(model_tokens)),
        "response_length/env_tokens_mean": sum(env_tokens) / len(trajs),
        "prompt_length/mean": sum(len(t.prompt_ids) for t in trajs) / len(trajs),
        "episode/turns_mean": sum(turns) / len(trajs),
        "episode/tool_calls_mean": tool_calls / len(trajs),
        "episode/tool_call_rate": sum(1 for t in trajs if t.tool_calls) / len(trajs),
        "episode/tool_error_rate": sum(t.tool_errors for t in trajs) / tool_calls if tool_calls else 0.0,
        "episode/parse_error_rate": (
            sum(1 for turn in model_turns if turn.parsed.errors) / len(model_turns) if model_turns else 0.0
        ),
        "episode/truncated_frac": sum(1 for e in episodes if e.trajectory.truncated and not e.infrastructure) / len(trajs),
        "episode/rollout_errors": float(sum(1 for e in episodes if not e.usable)),
        "episode/reward_errors": float(sum(1 for e in episodes if e.reward_error is not None)),
        "episode/infra_errors": float(sum(1 for e in episodes if e.infrastructure)),
        "episode/infra_retries": float(sum(e.retries for e in episodes)),
    }
    components: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for name, value in t.reward_components.items():
            components[name].append(float(value))
    for name, values in sorted(components.items()):
        out[f"reward/{name}/mean"] = sum(values) / len(values)
    return {f"{prefix}{k}": v for k, v in out.items()}


class NullSink:
    """The metrics sink of a rank that does not write (ranks other than 0 of a parallel run)."""

    warnings: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsSink:
    """Writes one record per step to ``RUN_DIR/metrics.jsonl`` (flushed each step), TensorBoard
    (``RUN_DIR/tensorboard``) when enabled, and W&B when enabled *and* installed (else a warning).

    ``truncate_after(step)`` drops JSONL records of steps > ``step`` (used on resume, so a step that
    was logged but not checkpointed is not duplicated)."""

    def __init__(self, run_dir: str, *, tensorboard: bool, wandb: bool, wandb_project: str, config: dict[str, Any]) -> None:
        self.path = os.path.join(run_dir, rundir.METRICS)
        self._tb = None
        self._wandb = None
        self.warnings: list[str] = []
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                self.warnings.append("trainer.wandb=true but wandb is not installed; logging to JSONL/TensorBoard only")
            else:
                self._wandb = wandb_mod.init(project=wandb_project, dir=run_dir, config=config, resume="allow")

    def truncate_after(self, step: int) -> None:
        rundir.truncate_metrics(self.path, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        rundir.append_lines(self.path, [json.dumps(record)])
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
