"""Human-readable tables of eval metrics: one run, or two runs side by side (``--compare``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from agentrl import rundir
from agentrl.evaluation.metrics import ERROR_KINDS


def load_metrics(run: str | Path) -> dict[str, Any]:
    """``metrics.json`` of an eval directory (or the file itself); RunDirError (one line) when it is missing or
    damaged."""
    path = Path(run)
    path = path / rundir.EVAL_METRICS if path.is_dir() else path
    return rundir.read_json(path, what="an eval run's metrics",
                            fix="rerun that agentrl eval command (it rewrites metrics.json) or pass another directory")


def compare_warnings(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> list[str]:
    """Why two runs' numbers may not be comparable: a different env, or different items (count or
    contents, from ``items_digest``)."""
    out = []
    if a.get("env") != b.get("env"):
        out.append(f"the runs evaluate different envs ({name_a}: {a.get('env')}, {name_b}: {b.get('env')})")
    if a.get("items") != b.get("items"):
        out.append(f"the runs cover different numbers of items ({name_a}: {a.get('items')}, {name_b}: {b.get('items')})")
    elif a.get("items_digest") and b.get("items_digest") and a["items_digest"] != b["items_digest"]:
        out.append(f"the runs evaluate different items (same count, other tasks: {name_a} and {name_b} differ in split, tasks= or seed)")
    elif not (a.get("items_digest") and b.get("items_digest")):
        out.append("cannot tell whether the runs cover the same items (a metrics.json from an older agentrl)")
    return out


def rows(m: dict[str, Any]) -> list[tuple[str, Any]]:
    """The metrics to show, in display order (absent ones are skipped)."""
    keys = [k for k in m if k.startswith(("pass@", "maj@", "mean@"))]
    out = [(k, m[k]) for k in ["items", "episodes", "samples_per_item", *keys, "mean_reward"] if k in m]
    out += [(k, m.get(k)) for k in ("tool_calls_per_episode", "tool_success_rate")]
    out += [(f"errors/{k} per ep", m.get("errors_per_episode", {}).get(k)) for k in ERROR_KINDS]
    out += [
        (k, m.get(k))
        for k in (
            "latency_s_mean",
            "latency_s_p50",
            "latency_s_p95",
            "gen_tokens_per_episode",
            "prompt_tokens_per_episode",
            "requests_per_episode",
        )
    ]
    run = m.get("run") or {}
    out += [(f"run/{k}", run[k]) for k in ("episodes_run", "episodes_failed", "infra_errors", "infra_retries", "episodes_per_s") if k in run]
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:.1f}"
    return str(v)


def metrics_table(m: dict[str, Any], title: str = "") -> Table:
    table = Table(title=title or f"{m.get('env', '?')} · {m.get('model', '?')}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows(m):
        table.add_row(key, _fmt(value))
    return table


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> Table:
    """Side-by-side table with the difference ``B - A`` for numeric metrics."""
    table = Table(title=f"{name_a}  vs  {name_b}")
    for col, justify in (("metric", "left"), (name_a, "right"), (name_b, "right"), ("B - A", "right")):
        table.add_column(col, justify=justify)
    rows_a, rows_b = dict(rows(a)), dict(rows(b))
    for key in list(dict.fromkeys([*rows_a, *rows_b])):
        va, vb = rows_a.get(key), rows_b.get(key)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        table.add_row(key, _fmt(va), _fmt(vb), f"{vb - va:+.4f}" if numeric else "")
    return table
