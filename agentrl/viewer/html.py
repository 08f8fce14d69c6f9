"""Write the trajectory viewer: trajectories + token texts as JSON inside one HTML file with inline CSS/JS.

Input: a trajectory JSONL file (one :class:`~agentrl.harmony.trajectory.Trajectory` per line, as written
by ``agentrl eval`` or the trainer) or a run directory (every ``*.jsonl`` under it that holds trajectories).
Lines that are not trajectories are kept and listed in the page as load errors, never silently dropped.

Per trajectory the page shows the turns (role, Harmony channel and recipient), tool calls with
arguments, results, latency and error kind, the prompt and response token strips coloured by loss mask
(model token / env token / prompt), and, when the trajectory carries training log-probs
(``metadata["train_logprobs"]`` or ``metadata["old_logprobs"]``, one per response token), a heat map of
``|rollout - train|`` per model token.

Token texts come from a :class:`~agentrl.harmony.format.ChatFormat` (``format=harmony``, the default,
or ``format=none`` to show raw ids).
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agentrl.cli_args import CommandSpec, UsageError, run
from agentrl.evaluation.metrics import turn_errors
from agentrl.harmony.trajectory import Trajectory

TRAIN_LOGPROB_KEYS = ("train_logprobs", "old_logprobs")


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if files:
            return files
        raise FileNotFoundError(f"no .jsonl files under {path}")
    raise FileNotFoundError(f"{path} does not exist")


def load_trajectories(path: str | Path) -> tuple[list[tuple[str, Trajectory]], list[dict[str, Any]]]:
    """Read trajectories from a JSONL file or run directory.

    Returns ``(trajectories, problems)``: ``trajectories`` as ``(source "file:line", Trajectory)``;
    ``problems`` one ``{"source", "error", "line"}`` per line that is not a valid trajectory. JSONL files
    whose first valid-JSON line is not a trajectory (metrics, configs) are skipped in directories.
    """
    root = Path(path)
    out: list[tuple[str, Trajectory]] = []
    problems: list[dict[str, Any]] = []
    for f in _jsonl_files(root):
        rel = f.name if f == root else str(f.relative_to(root))
        file_items: list[tuple[str, Trajectory]] = []
        file_problems: list[dict[str, Any]] = []
        with f.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    traj = Trajectory.from_json(line)
                    traj.validate()
                    file_items.append((f"{rel}:{lineno}", traj))
                except (ValueError, KeyError, TypeError) as exc:
                    file_problems.append(
                        {
                            "source": f"{rel}:{lineno}",
                            "error": f"{type(exc).__name__}: {exc}",
                            "line": line[:2000],
                        }
                    )
        if f != root and not file_items:
            continue  # a non-trajectory JSONL inside a run directory (metrics, configs)
        out += file_items
        problems += file_problems
    return out, problems


class _TokenText:
    """Token id -> display text, cached; without a format the text is ``⟨id⟩``."""

    def __init__(self, fmt: Any | None):
        self.fmt = fmt
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        if tid not in self.cache:
            if self.fmt is None:
                self.cache[tid] = f"⟨{tid}⟩"
            elif hasattr(self.fmt, "token_bytes"):
                self.cache[tid] = self.fmt.token_bytes(tid).decode("utf-8", errors="backslashreplace")
            else:
                self.cache[tid] = self.fmt.decode([tid])
        return self.cache[tid]


def _errors_of(traj: Trajectory) -> list[str]:
    kinds = {k for k, n in turn_errors(traj).items() if n}
    env_errors = traj.metadata.get("errors")
    if isinstance(env_errors, dict):
        kinds.update(k for k, n in env_errors.items() if n)
    if traj.truncated:
        kinds.add("truncation")
    return sorted(kinds)


def _item_of(meta: dict[str, Any]) -> str:
    task = meta.get("task")
    item = meta.get("item_id", task.get("id") if isinstance(task, dict) else None)
    return "" if item is None else str(item)


def _train_logprobs(traj: Trajectory) -> list[float] | None:
    for key in TRAIN_LOGPROB_KEYS:
        values = traj.metadata.get(key)
        if isinstance(values, list) and len(values) == len(traj.response_ids):
            return [float(v) for v in values]
    return None


def build_payload(items: Sequence[tuple[str, Trajectory]], fmt: Any | None) -> list[dict[str, Any]]:
    """The JSON the page renders: one compact record per trajectory.

    Token strips are ``[text, kind, rollout_logprob, gap]`` rows; ``kind`` is ``"p"`` (prompt), ``"m"``
    (model, mask 1) or ``"e"`` (env, mask 0); ``gap`` is ``|rollout - train|`` or ``null``.
    """
    text = _TokenText(fmt)
    records = []
    for i, (source, t) in enumerate(items):
        train = _train_logprobs(t)
        response = []
        for j, tid in enumerate(t.response_ids):
            model = t.response_mask[j] == 1
            gap = abs(t.rollout_logprobs[j] - train[j]) if (train is not None and model) else None
            response.append(
                [
                    text(tid),
                    "m" if model else "e",
                    round(t.rollout_logprobs[j], 5),
                    None if gap is None else round(gap, 6),
                ]
            )
        meta = {k: v for k, v in t.metadata.items() if k not in TRAIN_LOGPROB_KEYS}
        records.append(
            {
                "id": i,
                "source": source,
                "env": str(meta.get("env_name") or meta.get("env", "")),
                "item": _item_of(meta),
                "reward": t.reward,
                "reward_components": t.reward_components,
                "terminated": t.terminated,
                "truncated": t.truncated,
                "errors": _errors_of(t),
                "turns": [tr.to_dict() for tr in t.turns],
                "prompt": [[text(tid), "p", 0.0, None] for tid in t.prompt_ids],
                "response": response,
                "has_gap": train is not None,
                "max_gap": max((r[3] for r in response if r[3] is not None), default=None),
                "metadata": meta,
            }
        )
    return records


def _asset(name: str) -> str:
    return resources.files("agentrl.viewer").joinpath(name).read_text(encoding="utf-8")


def _script_json(data: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>``, ``&`` and line separators escaped."""
    s = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        s = s.replace(ch, esc)
    return s


def write_html(
    items: Sequence[tuple[str, Trajectory]],
    out: str | Path,
    *,
    fmt: Any | None = None,
    title: str = "agentrl trajectories",
    problems: Iterable[dict[str, Any]] = (),
) -> Path:
    """Write the self-contained viewer to ``out`` and return its path."""
    data = {"title": title, "trajectories": build_payload(items, fmt), "problems": list(problems)}
    page = (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>\n<style>{_asset('viewer.css')}</style></head>\n"
        '<body><div id="app"></div>\n'
        f'<script id="data" type="application/json">{_script_json(data)}</script>\n'
        f"<script>{_asset('viewer.js')}</script></body></html>\n"
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def _load_format(name: str) -> Any | None:
    """``none``: no token strip decoding; any other name goes to :func:`agentrl.harmony.make_format`."""
    if name == "none":
        return None
    from agentrl.harmony import make_format

    return make_format(name)


@dataclass
class ViewConfig:
    """``src``: a trajectory JSONL file or a run directory. ``out``: the HTML file (default: next to the
    input). ``format``: token texts from ``harmony``, ``none`` (raw ids) or an HF tokenizer path.
    ``limit``: keep the first N trajectories (the page holds every token of each)."""

    src: str
    out: str | None = None
    format: str = "harmony"
    title: str | None = None
    limit: int | None = None


SPEC = CommandSpec(
    prog="agentrl view",
    schema=ViewConfig,
    usage="agentrl view RUN_OR_JSONL [out=FILE.html] [format=harmony|none|HF_TOKENIZER_PATH] [title=TEXT] [limit=N]",
    positional="src",
    examples={"src": "runs/eval/gsm8k-a"},
    notes="Writes one self-contained HTML file (default: next to the input, named trajectories.html) that\n"
    "opens offline in any browser.",
)


def _view(cfg: Any) -> int:
    src = Path(cfg.src)
    if cfg.limit is not None and cfg.limit < 1:
        raise UsageError(f"limit must be >= 1, got {cfg.limit}; e.g. limit=20")
    try:
        items, problems = load_trajectories(src)
    except FileNotFoundError as exc:
        print(f"agentrl view: {exc}", file=sys.stderr)
        return 1
    if cfg.limit is not None:
        items = items[: cfg.limit]
    try:
        fmt = _load_format(cfg.format)
    except (OSError, ValueError) as exc:
        raise UsageError(f"format={cfg.format}: {exc}; use harmony, none or an HF tokenizer path") from None
    default_out = (src if src.is_dir() else src.parent) / f"{src.stem if src.is_file() else 'trajectories'}.html"
    out = write_html(items, cfg.out or default_out, fmt=fmt, title=cfg.title or f"agentrl: {src}", problems=problems)
    print(f"wrote {out} ({len(items)} trajectories{f', {len(problems)} unreadable lines' if problems else ''})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl view``."""
    return run(SPEC, argv, _view)
