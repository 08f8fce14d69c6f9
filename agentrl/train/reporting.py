"""What a run reports: the console (start line, progress bar, one line per step and per evaluation), the metrics
sinks (``RUN_DIR/metrics.jsonl``, TensorBoard, W&B; :mod:`agentrl.train.metrics`) and ``RUN_DIR/summary.json``.

``summary.json`` starts with the run's headline: ``complete`` (every one of ``total_steps`` RL steps ran, and no
infrastructure error or incomplete evaluation remains), ``stopped_by`` (null, or the budget that stopped the run
before ``total_steps``: ``"max_wall_s"``), ``steps``, ``total_steps``, ``infra_errors`` (episodes, of RL steps and
evaluations, that a tool's backend ended even after their runs again: left out, never scored), ``infra_retries``
(runs again after such a failure), ``incomplete_evaluations`` (held-out evaluations that left an episode out),
``commit`` (the git commit of the agentrl source that ran, when it is a git checkout), then the held-out figures, each evaluation once: ``eval_before`` (before anything; absent with
``eval.before=false``), ``eval_after_sft`` (after the SFT stage, when RL steps followed), ``eval_after`` (the last
one; :func:`agentrl.evaluation.
metrics.headline`: ``mean``, ``sem``, ``tool_call_rate``, ``tool_success_rate``, ``tool_calls_mean``,
``turns_mean``, ``pass@k``, ``episodes``, ``errors``, ``incomplete``, ``infra_errors``, ``infra_retries``, and the
``step`` it was taken at), ``eval_tasks``, the SFT
stage's ``sft`` info, data position, wall times and memory: ``peak_rss_gb``, the trainer process's resident-set
high-water mark, and ``peak_rss_children_gb``, the largest of its ended child processes' (GiB, ``getrusage``). :func:`headline` is the same headline as the console's last
line.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentrl import rundir
from agentrl.train.metrics import MetricsSink, NullSink

#: step-line label -> metric key
_STEP_LINE = (
    ("reward", "critic/score/mean"), ("len", "response_length/mean"), ("tools/ep", "episode/tool_calls_mean"),
    ("tool err", "episode/tool_error_rate"), ("turns", "episode/turns_mean"), ("ent", "actor/entropy"),
    ("gnorm", "actor/grad_norm"), ("clip", "actor/pg_clipfrac"), ("|Δlp|", "rollout_corr/logprob_abs_diff_mean"),
    ("s", "timing_s/step"),
)


class Reporter:
    """The console and the metrics sinks of one run (only rank 0 writes: other ranks get a quiet console and a
    :class:`~agentrl.train.metrics.NullSink`)."""

    def __init__(self, cfg: DictConfig, run_dir: str, *, is_main: bool, console: Any = None) -> None:
        from rich.console import Console

        self.cfg, self.run = cfg, rundir.TrainRun(run_dir)
        self.console = console or Console(soft_wrap=True, quiet=not is_main)
        self.is_main = is_main
        self.sink: MetricsSink | NullSink = NullSink()

    def open(self) -> None:
        """The run starts: open the metrics sinks (rank 0), print their warnings."""
        if self.is_main:
            cfg = self.cfg
            self.sink = MetricsSink(
                str(self.run.root), tensorboard=cfg.trainer.tensorboard, wandb=cfg.trainer.wandb,
                wandb_project=cfg.trainer.wandb_project, config=OmegaConf.to_container(cfg, resolve=True),
            )
        for warning in self.sink.warnings:
            self.print(f"[yellow]warning:[/] {warning}")

    def print(self, text: str, **kwargs: Any) -> None:
        self.console.print(text, **kwargs)
        self.console.file.flush()

    def progress(self) -> Any:
        """A rich progress bar (a null context when ``trainer.progress=false``)."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if not self.cfg.trainer.progress:
            return nullcontext(None)
        return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)

    def step_line(self, step: int, metrics: dict[str, float]) -> None:
        """Print step ``step``'s line (its headline metrics)."""
        parts = [f"step {step}/{self.cfg.trainer.total_steps}"]
        parts += [f"{label} {metrics[key]:.3g}" for label, key in _STEP_LINE if key in metrics]
        self.print("  ".join(parts))

    def evaluation(self, figures: dict[str, Any], label: str, seconds: float) -> None:
        """Print one held-out evaluation's headline figures."""
        success = "-" if figures["tool_success_rate"] is None else f"{figures['tool_success_rate']:.2f}"
        self.print(
            f"eval {label}: reward {figures['mean']:.3f} ± {figures['sem']:.3f} (n={figures['episodes']})  "
            f"tool calls {figures['tool_call_rate']:.2f} of episodes, {figures['tool_calls_mean']:.2f}/episode, "
            f"success {success}  turns {figures['turns_mean']:.2f}  {seconds:.0f} s"
            + (f"  INCOMPLETE: {figures['incomplete']} episodes left out ({figures.get('infra_errors', 0)} "
               "infrastructure errors; errors.log)" if figures.get("incomplete") else "")
        )

    def summary(self, state: Any, *, wall_s: float, t_created: float, load_s: float,
                stopped_by: str | None) -> dict[str, Any]:
        """The run's summary (module docstring), written to ``summary.json`` by rank 0. ``stopped_by``: the
        budget that ended the RL stage before ``trainer.total_steps`` (``"max_wall_s"``), or None."""
        total = int(self.cfg.trainer.total_steps)
        evals = list(state.eval_history.values())
        infra_errors = state.infra["errors"] + sum(int(e.get("infra_errors", 0)) for e in evals)
        incomplete = sum(1 for e in evals if e.get("incomplete", 0))
        summary: dict[str, Any] = {
            "complete": stopped_by is None and state.step >= total and not infra_errors and not incomplete,
            "stopped_by": stopped_by, "steps": state.step, "total_steps": total,
            "infra_errors": infra_errors,
            "infra_retries": state.infra["retries"] + sum(int(e.get("infra_retries", 0)) for e in evals),
            "incomplete_evaluations": incomplete, "commit": source_commit(),
        }
        summary.update(_eval_figures(state.eval_history))
        if state.eval_history:
            summary["eval_tasks"] = self.cfg.eval.num_tasks
        if stopped_by == "max_wall_s":
            summary["max_wall_s"] = float(self.cfg.trainer.max_wall_s)
        summary.update({
            "run_dir": str(self.run.root), "data_position": state.data_position,
            "wall_s_this_process": time.perf_counter() - t_created, "fit_s": wall_s, "model_load_s": load_s,
            **peak_rss_gb(),
        })
        if state.sft_info:
            summary["sft"] = state.sft_info
        if self.is_main:
            rundir.write_json(self.run.summary, summary)
        return summary

    def close(self) -> None:
        self.sink.close()


def source_commit() -> str | None:
    """The git commit of the agentrl source that runs (with ``+dirty`` when its tracked files have changes), or
    None when it is not a git checkout or git is missing."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}+dirty" if dirty else sha or None


def peak_rss_gb() -> dict[str, float]:
    """``peak_rss_gb`` (this process's resident-set high-water mark) and ``peak_rss_children_gb`` (the largest
    of its ended and waited-for child processes'), in GiB."""
    import resource

    kib = 1024 * 1024  # ru_maxrss is in KiB on Linux
    return {
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib,
        "peak_rss_children_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib,
    }


def headline(summary: dict[str, Any], prog: str = "agentrl train") -> str:
    """The console's last line for a run's ``summary``: complete or not (what stopped it, the infrastructure errors
    and incomplete evaluations that remain), the held-out rewards, the run directory; e.g. ``agentrl train: complete (10/10 steps); held-out reward 0.000 ± 0.000
    before, 0.672 ± 0.042 after SFT, 0.773 ± 0.037 after step 10; runs/retool-...``."""
    steps = f"{summary['steps']}/{summary['total_steps']} steps" if summary["total_steps"] else "no RL step"
    broken = []
    if summary.get("infra_errors"):
        broken.append(f"{summary['infra_errors']} infrastructure errors")
    if summary.get("incomplete_evaluations"):
        broken.append(f"{summary['incomplete_evaluations']} incomplete evaluations")
    why = f": {', '.join(broken)} (tracebacks in errors.log)" if broken else ""
    if summary["complete"]:
        state = f"complete ({steps})"
    elif summary["stopped_by"] == "max_wall_s":
        state = (f"INCOMPLETE: stopped by trainer.max_wall_s={summary['max_wall_s']:g} after {steps} "
                 "(trainer.max_wall_s=0, the default, runs every step)")
        state += f"; {', '.join(broken)}" if broken else ""
    else:
        state = f"INCOMPLETE ({steps}){why}"
    labelled = [("eval_before", "before"), ("eval_after_sft", "after SFT")]
    if summary.get("eval_after", {}).get("step", 0) > 0:  # an RL step was evaluated (else: one of the above)
        labelled.append(("eval_after", f"after step {summary['eval_after']['step']}"))
    figures = [f"{summary[k]['mean']:.3f} ± {summary[k]['sem']:.3f} {label}" for k, label in labelled if k in summary]
    evals = f"; held-out reward {', '.join(figures)} ({summary['eval_tasks']} tasks)" if figures else ""
    return f"{prog}: {state}{evals}; {summary['run_dir']}"


def _eval_figures(history: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``eval_before`` / ``eval_after_sft`` / ``eval_after`` from the labelled evaluations of a run, each
    evaluation under one key: ``eval_before`` the one before anything (absent with ``eval.before=false``),
    ``eval_after`` the last one, ``eval_after_sft`` the one after the SFT stage when RL steps were evaluated
    after it (in an SFT-only run it is ``eval_after``)."""
    steps = sorted((v["step"], k) for k, v in history.items() if k not in ("before", "after_sft"))
    after = (["after_sft"] if "after_sft" in history else []) + [k for _, k in steps]
    out: dict[str, Any] = {}
    if "before" in history:
        out["eval_before"] = history["before"]
    if after:
        out["eval_after"] = history[after[-1]]
        if after[-1] != "after_sft" and "after_sft" in history:
            out["eval_after_sft"] = history["after_sft"]
    return out
