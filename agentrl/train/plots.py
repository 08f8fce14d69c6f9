"""``agentrl plot RUN_DIR [RUN_DIR ...] [out=DIR]``: per-step curves of one or more runs, overlaid.

Writes one PNG per panel (``reward.png``, ``eval_reward.png``, ``tool_calls.png``, ``tool_error_rate.png``,
``turns.png``, ``eval_tool_call_rate.png``, ``kl.png``, ``entropy.png``, ``grad_norm.png``, ``clip_fraction.png``,
``rollout_train_gap.png``) plus ``overview.png`` with all panels, into ``out``
(default: the first run's ``plots/`` directory). A panel shows the first metric key of its list that a
run logged; runs without any of them are skipped in that panel. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from agentrl.cli_args import CommandSpec, UsageError, key, run
from agentrl.rundir import read_metrics

#: panel file stem -> (title, candidate metric keys in order of preference)
PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("mean reward (train batch)", ("critic/score/mean",)),
    "eval_reward": ("held-out reward (eval)", ("eval/mean_reward", "eval/critic/score/mean")),
    "tool_calls": ("tool calls per episode (train batch)", ("episode/tool_calls_mean",)),
    "tool_error_rate": ("tool error rate (failed calls / calls)", ("episode/tool_error_rate",)),
    "turns": ("turns per episode (train batch)", ("episode/turns_mean",)),
    "eval_tool_call_rate": ("held-out: share of episodes with a tool call",
                            ("eval/tool_call_rate", "eval/episode/tool_call_rate")),
    "kl": ("KL to reference (or PPO KL)", ("actor/kl_loss", "actor/ppo_kl")),
    "entropy": ("entropy (nats/token)", ("actor/entropy",)),
    "grad_norm": ("grad norm (before clipping)", ("actor/grad_norm",)),
    "clip_fraction": ("PPO clip fraction", ("actor/pg_clipfrac",)),
    "rollout_train_gap": ("rollout vs train log-prob, mean |Δ|", ("rollout_corr/logprob_abs_diff_mean",)),
}

#: held-out panels: the evaluation before the SFT stage (logged at step 0 beside the after-SFT one), drawn as
#: its own point so a run with a cold start shows before -> after SFT -> after RL (older runs' names second)
BEFORE_SFT: dict[str, tuple[str, ...]] = {
    "eval_reward": ("eval_before/mean_reward", "eval_before/critic/score/mean"),
    "eval_tool_call_rate": ("eval_before/tool_call_rate", "eval_before/episode/tool_call_rate"),
}


def _series(records: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str, list[int], list[float]] | None:
    for name in keys:
        points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
        if points:
            return name, [p[0] for p in points], [float(p[1]) for p in points]
    return None


def plot_runs(run_dirs: list[str], out_dir: str, *, dpi: int = 80) -> list[str]:
    """Write the panels for ``run_dirs`` into ``out_dir`` at ``dpi`` (the overview at 7/8 of it); returns
    the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d) for d in run_dirs}
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    overview, axes = plt.subplots(3, 4, figsize=(20, 12))
    for ax_unused in axes.flat[len(PANELS) :]:
        ax_unused.axis("off")
    for ax_all, (stem, (title, keys)) in zip(axes.flat[: len(PANELS)], PANELS.items(), strict=True):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs.items():
            found = _series(records, keys)
            if found is None:
                continue
            key, steps, values = found
            for target in (ax, ax_all):
                target.plot(steps, values, marker="o", markersize=3, label=f"{label} ({key})" if len(keys) > 1 else label)
            before = _series(records, BEFORE_SFT[stem]) if stem in BEFORE_SFT else None
            if before is not None:
                for target in (ax, ax_all):
                    target.plot(before[1], before[2], marker="x", markersize=7, linestyle="none",
                                label=f"{label} (before SFT)")
        for target in (ax, ax_all):
            target.set_title(title)
            target.set_xlabel("step")
            target.grid(alpha=0.3)
            if target.lines:
                target.legend(fontsize=7)
            else:
                target.text(0.5, 0.5, "not logged", ha="center", va="center", transform=target.transAxes)
        path = os.path.join(out_dir, f"{stem}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    overview.tight_layout()
    path = os.path.join(out_dir, "overview.png")
    overview.savefig(path, dpi=max(1, dpi * 7 // 8))
    plt.close(overview)
    written.append(path)
    return written


@dataclass
class PlotConfig:
    """Settings of ``agentrl plot``."""

    runs: list[str] = key([], "run directories holding metrics.jsonl (bare words)")
    out: str | None = key(None, "the output directory (default: the first run's plots/)")
    dpi: int = key(80, "resolution of the panels", min=10)


SPEC = CommandSpec(
    prog="agentrl plot",
    schema=PlotConfig,
    usage="agentrl plot RUN_DIR [RUN_DIR ...] [out=DIR]",
    positional="runs",
    notes="--out DIR works too. One PNG per panel plus overview.png.",
)


def _plot(cfg: Any) -> int:
    runs = list(cfg.runs)
    if not runs:
        raise UsageError("no run directory given; e.g. agentrl plot runs/retool-20261130-133143")
    paths = plot_runs(runs, cfg.out or os.path.join(runs[0], "plots"), dpi=cfg.dpi)  # RunDirError: one line
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``agentrl plot``."""
    return run(SPEC, argv, _plot)
