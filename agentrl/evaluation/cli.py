"""``agentrl eval``: evaluate a model on an env, or compare two eval runs.

    agentrl eval env=gsm8k model=http://127.0.0.1:8000/v1 tasks=data/gsm8k/test.jsonl n=4 limit=50
    agentrl eval --compare runs/eval/a runs/eval/b

Keys are the fields of :class:`~agentrl.evaluation.config.EvalConfig`, read by :mod:`agentrl.cli_args`
(``k=1,2,4`` sets ``ks``; ``env.<name>=<value>`` goes to the env constructor). Without ``model=``,
``$OPENAI_BASE_URL`` is used. ``model=RUN_DIR`` (a training run) starts from the run's held-out evaluation
(``RUN_DIR/eval/config.json``: its tasks, env settings, sampling and token budget; other keys override it), so
it measures the problems behind the run's ``summary.json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from agentrl import errorlog, rundir
from agentrl.cli_args import CommandSpec, UsageError, fail, is_help, run, to_object, value_of
from agentrl.evaluation.config import EvalConfig
from agentrl.evaluation.report import compare_table, compare_warnings, load_metrics, metrics_table
from agentrl.evaluation.runner import Evaluation, run_async
from agentrl.progress import ProgressLines


def _ks(value: str) -> str:
    """``k=1,2,4`` (the short form) as the list ``[1,2,4]``."""
    return value if value.strip().startswith("[") or value == "null" else f"[{value}]"


SPEC = CommandSpec(
    prog="agentrl eval",
    schema=EvalConfig,
    usage="agentrl eval env=NAME model=URL_OR_PATH [n=1] [k=1,2,4] [limit=100] [key=value ...]\n"
    "       agentrl eval --compare RUN_A RUN_B",
    aliases={"k": "ks", "env.": "env_kwargs."},
    examples={"env": "env=gsm8k model=http://127.0.0.1:8000/v1", "model": "model=http://127.0.0.1:8000/v1"},
    value_filters={"ks": _ks},
    notes="""model: an OpenAI-compatible base URL (vLLM, SGLang, agentrl serve model, hosted APIs; key from api_key= or
$OPENAI_API_KEY; without model=, $OPENAI_BASE_URL), or a local model (tiny-gpt-oss, smollm2-135m, a directory,
a hub id). api=completions sends token ids and keeps exact tokens + log-probs (format=auto uses the format
that agentrl serve model describes, else Harmony); api=chat uses chat completions with tools.
processes=P splits the episodes over P client processes (endpoints only). env.FIELD=VALUE goes to the env
constructor. Rerunning with the same out= resumes (finished episodes are skipped); overwrite=true starts afresh.""",
)


def _with_env_model(argv: list[str]) -> list[str]:
    """Adds ``model=$OPENAI_BASE_URL`` when no model is given."""
    if not any(a.split("=", 1)[0].lstrip("-") == "model" for a in argv) and os.environ.get("OPENAI_BASE_URL"):
        return [*argv, f"model={os.environ['OPENAI_BASE_URL']}"]
    return argv


def _run_base(argv: list[str]) -> Any:
    """For ``model=RUN_DIR`` (a training run with a held-out evaluation): its ``eval/config.json`` as the base."""
    from omegaconf import OmegaConf

    model = value_of(SPEC, argv, "model")
    if not model or rundir.run_kind(model) != rundir.TRAIN:
        return None
    path = rundir.TrainRun(model).held_out_config
    if not path.is_file():
        return None
    saved = rundir.read_json(path, what="the run's held-out evaluation", fix="evaluate with explicit keys instead")
    saved["model"] = model
    print(f"agentrl eval: model={model} is a training run; its held-out evaluation ({path}) is the base config")
    return OmegaConf.create(saved)


async def run_eval(config: EvalConfig, *, progress: bool, console: Console) -> dict[str, Any]:
    """Run with a rich progress bar (when ``progress``) and return the metrics."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]eval[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
    )
    task_id = bar.add_task(f"{config.env} · {config.model}", total=None, failed=0)
    lines = ProgressLines(f"eval {config.env}", interval_s=config.progress_interval_s)  # a log file's progress

    def update(done: int, total: int, failed: int) -> None:
        bar.update(task_id, completed=done, total=total, failed=failed)
        lines.update(done, total, failed)

    with bar, lines:
        return await Evaluation(config, on_progress=update).run()


def _compare(argv: list[str], console: Console) -> int:
    if len(argv) != 2:
        return fail("agentrl eval", f"--compare takes two run directories, got {len(argv)}; e.g. agentrl eval --compare runs/eval/a runs/eval/b")
    try:
        a, b = load_metrics(argv[0]), load_metrics(argv[1])
    except UsageError as exc:
        return fail("agentrl eval", str(exc))
    for warning in compare_warnings(a, b, argv[0], argv[1]):
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    console.print(compare_table(a, b, argv[0], argv[1]))
    return 0


def _evaluate(cfg: Any) -> int:
    config = to_object(SPEC, cfg)
    try:
        config.check_sources()  # before any model loads
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    console = Console()
    try:
        metrics = run_async(run_eval(config, progress=config.progress, console=console))
    except UsageError:  # a run directory that cannot be used: one line, exit status 2
        raise
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        if errorlog.debug():
            raise
        if config.out_dir().is_dir():  # the run started: its directory keeps the traceback
            errorlog.append(config.out_dir(), "agentrl eval failed", errorlog.format_exception(exc))
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 1
    console.print(metrics_table(metrics))
    run_info = metrics["run"]
    failed = run_info["episodes_failed"]
    infra = run_info.get("infra_errors", 0)
    infra_note = f", {infra} of them infrastructure errors: incomplete, not wrong" if infra else ""
    see = f"; see {config.out_dir() / rundir.EVAL_ERRORS} and {config.out_dir() / rundir.ERRORS_LOG}" if failed else ""
    console.print(
        f"wrote {config.out_dir() / 'trajectories.jsonl'} ({run_info['episodes_run']} new episodes, "
        f"{run_info['episodes_skipped']} already done, {failed} failed{infra_note}{see})", highlight=False, soft_wrap=True,
    )
    return 0 if not run_info["episodes_failed"] else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl eval``. Exit status: 0 done, 1 the run failed, 2 a usage error,
    3 some episodes failed (they are retried by the next run; an episode a tool's backend ended is one of them,
    left out of the score). Tracebacks go to ``OUT/errors.log``; ``AGENTRL_DEBUG=1`` re-raises."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--compare" and not is_help(argv):
        return _compare(argv[1:], Console())
    return run(SPEC, argv, _evaluate, prepare=_with_env_model, base=_run_base)
