"""``agentrl eval``: evaluate a model on an env, or compare two eval runs.

    agentrl eval env=gsm8k model=http://127.0.0.1:8000/v1 tasks=data/gsm8k/test.jsonl n=4 limit=50
    agentrl eval --compare runs/eval/a runs/eval/b

Keys are the fields of :class:`~agentrl.evaluation.runner.EvalConfig` (``k=1,2,4`` sets ``ks``);
``env.<name>=<value>`` is passed to the env constructor. Without ``model=``, ``$OPENAI_BASE_URL`` is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from agentrl.evaluation.report import compare_table, load_metrics, metrics_table
from agentrl.evaluation.runner import EvalConfig, Evaluation, run_async

USAGE = """usage: agentrl eval env=NAME model=URL_OR_PATH [n=1] [k=1,2,4] [limit=100] [tasks=FILE] [api=completions|chat]
                    [concurrency=32] [processes=1] [temperature=1.0] [top_p=1.0] [max_new_tokens=1024] [seed=0] [out=DIR]
                    [format=auto|harmony|HF_TOKENIZER] [served_model=NAME] [api_key=KEY] [retries=4] [timeout_s=300]
                    [sandbox=local] [split=test] [progress=true] [env.FIELD=VALUE ...]
       agentrl eval --compare RUN_A RUN_B

model: an OpenAI-compatible base URL (vLLM, SGLang, agentrl serve model, hosted APIs; key from api_key= or
$OPENAI_API_KEY), or a local model (tiny-gpt-oss, smollm2-135m, a directory, a hub id).
api=completions sends token ids and keeps exact tokens + log-probs; api=chat uses chat completions with tools.
processes=P splits the episodes over P client processes (endpoints only) when one Python process's CPU
is the bottleneck. Rerunning with the same out= resumes: finished episodes are skipped."""


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_args(argv: Sequence[str]) -> tuple[EvalConfig, bool]:
    """``key=value`` arguments to an :class:`EvalConfig` and the progress flag. Raises ``ValueError``."""
    fields = {f.name: f for f in dataclasses.fields(EvalConfig)}
    kwargs: dict[str, Any] = {}
    env_kwargs: dict[str, Any] = {}
    progress = True
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not sep:
            raise ValueError(f"arguments are key=value, got {arg!r}")
        if key.startswith("env."):
            env_kwargs[key[4:]] = _value(value)
        elif key == "progress":
            progress = value.lower() in ("1", "true", "yes")
        elif key in ("k", "ks"):
            kwargs["ks"] = [int(x) for x in value.split(",") if x]
        elif key in fields:
            typ = fields[key].type
            kwargs[key] = int(value) if typ == "int" else float(value) if typ == "float" else value
        else:
            raise ValueError(
                f"unknown key {key!r}; valid keys: {', '.join(sorted([*fields, 'k', 'progress']))}"
            )
    if "model" not in kwargs and os.environ.get("OPENAI_BASE_URL"):
        kwargs["model"] = os.environ["OPENAI_BASE_URL"]
    missing = [k for k in ("env", "model") if k not in kwargs]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)}=...")
    return EvalConfig(**kwargs, env_kwargs=env_kwargs), progress


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

    def update(done: int, total: int, failed: int) -> None:
        bar.update(task_id, completed=done, total=total, failed=failed)

    with bar:
        return await Evaluation(config, on_progress=update).run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl eval``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--compare":
        if len(argv) != 3:
            print("usage: agentrl eval --compare RUN_A RUN_B", file=sys.stderr)
            return 2
        try:
            a, b = load_metrics(argv[1]), load_metrics(argv[2])
        except FileNotFoundError as exc:
            print(f"agentrl eval: {exc}", file=sys.stderr)
            return 1
        console.print(compare_table(a, b, argv[1], argv[2]))
        return 0
    try:
        config, progress = parse_args(argv)
    except (ValueError, TypeError) as exc:
        print(f"agentrl eval: {exc}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        metrics = run_async(run_eval(config, progress=progress, console=console))
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 1
    console.print(metrics_table(metrics))
    run = metrics["run"]
    console.print(
        f"wrote {config.out_dir() / 'trajectories.jsonl'} ({run['episodes_run']} new episodes, "
        f"{run['episodes_skipped']} already done, {run['episodes_failed']} failed; see errors.jsonl)"
    )
    return 0 if not run["episodes_failed"] else 3
