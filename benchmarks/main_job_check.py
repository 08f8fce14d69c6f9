"""The guard of the headline: does a finished main-job run hold up against the README?

    python benchmarks/main_job_check.py RUN_DIR [--readme README.md] [--before X --after-sft Y --after-rl Z]

Reads ``RUN_DIR/summary.json`` of a finished ``agentrl train env=retool`` run (the README's main job) and checks:

- no infrastructure error remains (``infra_errors == 0``: an episode that a tool's backend ended even after its runs
  again, e.g. a sandbox pool that admitted no session) and no held-out evaluation is incomplete
  (``incomplete_evaluations == 0``), and the run is ``complete``;
- no held-out score is below the README's by more than 2 sem: for each of before, after SFT and after RL,
  ``run.mean >= readme - 2 * run.sem`` (the run's own standard error of that evaluation).

The README's figures are the ones its main-job paragraph states as ``before -> after SFT -> after RL``
(e.g. ``0.000 -> 0.672 -> 0.797``), read from ``--readme`` (default: the repository's ``README.md``); ``--before``,
``--after-sft`` and ``--after-rl`` override them one by one (e.g. to check against another recorded run).

Prints one line per failed check, then last:
``main_job: before=<> after_sft=<> after_rl=<> tool_success_after=<> infra_errors=<n> wall_s=<> peak_rss_gb=<>
commit=<sha>`` (``peak_rss_gb``: the larger of the trainer's and its child processes'; ``wall_s``: the run's
``wall_s_this_process``; ``commit``: summary.json's ``commit``, ``unknown`` for a run that predates it). Exit
status 0 when every check holds, 1 when one fails, 2 when the run directory or README cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
#: the README's main-job figures: "(0.000 -> 0.672 -> 0.797, ..."
_FIGURES = re.compile(r"after RL \((\d+\.\d+) -> (\d+\.\d+) -> (\d+\.\d+)")
#: summary.json key -> the README figure it is checked against
EVALS = (("before", "eval_before"), ("after_sft", "eval_after_sft"), ("after_rl", "eval_after"))


def readme_figures(path: Path) -> dict[str, float]:
    """``{"before", "after_sft", "after_rl"}`` from the README's main-job paragraph; SystemExit(2) if absent."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SystemExit(f"main_job_check: cannot read {path}: {exc}") from None
    match = _FIGURES.search(" ".join(text.split()))
    if match is None:
        raise SystemExit(f"main_job_check: {path} states no 'after RL (X -> Y -> Z' figures; pass --before, "
                         "--after-sft and --after-rl")
    return dict(zip(("before", "after_sft", "after_rl"), map(float, match.groups()), strict=True))


def check(summary: dict, expected: dict[str, float]) -> tuple[list[str], str]:
    """``(problems, line)``: every failed check (module docstring) and the ``main_job:`` line of ``summary``."""
    problems: list[str] = []
    infra = summary.get("infra_errors")
    if infra is None:
        problems.append("summary.json has no infra_errors: the run predates the count; run it on current code")
    elif infra:
        problems.append(f"{infra} infrastructure errors remain (tracebacks in RUN_DIR/errors.log)")
    incomplete = summary.get("incomplete_evaluations")
    if incomplete:
        problems.append(f"{incomplete} held-out evaluations are incomplete (episodes left out)")
    if not summary.get("complete", False):
        problems.append(f"the run is not complete (stopped_by={summary.get('stopped_by')}, steps "
                        f"{summary.get('steps')}/{summary.get('total_steps')})")
    means: dict[str, str] = {}
    for name, key in EVALS:
        figures = summary.get(key)
        if not figures:
            problems.append(f"summary.json has no {key}")
            means[name] = "nan"
            continue
        mean, sem = float(figures["mean"]), float(figures["sem"])
        means[name] = f"{mean:.3f}"
        if mean < expected[name] - 2 * sem:
            problems.append(f"{name}: held-out reward {mean:.3f} ± {sem:.3f} is below the README's "
                            f"{expected[name]:.3f} by more than 2 sem")
    success = (summary.get("eval_after") or {}).get("tool_success_rate")
    rss = max(summary.get("peak_rss_gb", float("nan")), summary.get("peak_rss_children_gb", 0.0))
    line = (f"main_job: before={means['before']} after_sft={means['after_sft']} after_rl={means['after_rl']} "
            f"tool_success_after={'nan' if success is None else f'{success:.3f}'} "
            f"infra_errors={'unknown' if infra is None else infra} "
            f"wall_s={summary.get('wall_s_this_process', float('nan')):.0f} peak_rss_gb={rss:.2f} "
            f"commit={summary.get('commit') or 'unknown'}")
    return problems, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished main-job run directory")
    parser.add_argument("--readme", type=Path, default=README, help="the README whose figures are expected")
    for name in ("before", "after-sft", "after-rl"):
        parser.add_argument(f"--{name}", type=float, help=f"the expected held-out reward {name} (overrides README)")
    args = parser.parse_args(argv)
    try:
        summary = json.loads((args.run_dir / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"main_job_check: cannot read {args.run_dir / 'summary.json'}: {exc}", file=sys.stderr)
        return 2
    given = {"before": args.before, "after_sft": args.after_sft, "after_rl": args.after_rl}
    try:
        expected = given if all(v is not None for v in given.values()) else {
            **readme_figures(args.readme), **{k: v for k, v in given.items() if v is not None}}
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    problems, line = check(summary, expected)
    for problem in problems:
        print(f"FAIL: {problem}")
    print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
