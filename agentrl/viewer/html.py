"""Write the trajectory viewer: trajectories + token texts as JSON inside one HTML file with inline CSS/JS.

Input: a trajectory JSONL file (one :class:`~agentrl.harmony.trajectory.Trajectory` per line, any schema
version, as written by ``agentrl eval`` or the trainer) or a run directory (its trajectory files,
:func:`agentrl.rundir.trajectory_files`). Lines that are not trajectories are kept and listed in the page as
load errors, never silently dropped (a torn last line, a writer killed mid-line, is skipped).

Per trajectory the page shows the turns (role, Harmony channel and recipient), tool calls with
arguments, results, latency and error kind, the prompt and response token strips coloured by loss mask
(model token / env token / prompt), and, when the trajectory carries training log-probs
(``train_logprobs``, one per response token: the trainer records them for every episode it trained on), a
heat map of ``|rollout - train|`` per model token.

Token texts come from a :class:`~agentrl.harmony.format.ChatFormat`: by default (``format=auto``) the one of
the model that wrote the run (its ``config.yaml`` / ``config.json``, e.g. SmolLM2's chat template), or
``format=harmony``, an HF tokenizer path, or ``format=none`` to show raw ids.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agentrl import rundir
from agentrl.cli_args import CommandSpec, UsageError, key, run
from agentrl.harmony.trajectory import Trajectory


def load_view_items(path: str | Path) -> tuple[list[tuple[str, Trajectory]], list[dict[str, Any]]]:
    """Read trajectories from a JSONL file or a run directory (every trajectory file of an ``agentrl eval`` or
    ``agentrl train`` run, :func:`agentrl.rundir.trajectory_files`), any schema version.

    Returns ``(trajectories, problems)``: ``trajectories`` as ``(source "file:line", Trajectory)``;
    ``problems`` one ``{"source", "error", "line"}`` per line that is not a valid trajectory (a torn last line
    is skipped). Raises :class:`~agentrl.rundir.RunDirError` for a path without trajectories.
    """
    loaded = rundir.load_trajectories(path)
    return loaded.items, [p.to_dict() for p in loaded.problems]


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


def _item_of(traj: Trajectory) -> str:
    item = traj.task_id if traj.task_id is not None else (traj.task or {}).get("id")
    return "" if item is None else str(item)


#: typed fields shown in the page's metadata panel (with the user's ``metadata``)
_SHOWN = ("stop_reason", "error", "task", "group", "sample", "policy_version", "sampling", "model", "api",
          "requests", "latency_s", "usage")


def build_payload(items: Sequence[tuple[str, Trajectory]], fmt: Any | None) -> list[dict[str, Any]]:
    """The JSON the page renders: one compact record per trajectory.

    Token strips are ``[text, kind, rollout_logprob, gap]`` rows; ``kind`` is ``"p"`` (prompt), ``"m"``
    (model, mask 1) or ``"e"`` (env, mask 0); ``gap`` is ``|rollout - train|`` or ``null``.
    """
    text = _TokenText(fmt)
    records = []
    for i, (source, t) in enumerate(items):
        train = t.train_logprobs
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
        shown = t.to_dict()
        meta = {**{k: shown[k] for k in _SHOWN if shown[k] not in (None, {}, [])}, **t.metadata}
        records.append(
            {
                "id": i,
                "source": source,
                "env": t.env or "",
                "item": _item_of(t),
                "reward": t.reward,
                "reward_components": t.reward_components,
                "terminated": t.terminated,
                "truncated": t.truncated,
                "errors": sorted(t.error_counts()),
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


def _load_format(name: str, src: Path, items: Sequence[tuple[str, Trajectory]]) -> Any | None:
    """``none``: no token strip decoding; ``auto``: the format of the model that wrote the run
    (:func:`run_model`); any other name goes to :func:`agentrl.harmony.make_format`."""
    if name == "none":
        return None
    if name == "auto":
        from agentrl.models.loading import chat_format_of

        model, fmt = run_model(src, items)
        return chat_format_of(model, fmt) if model else None
    from agentrl.harmony import make_format

    return make_format(name)


def run_model(src: Path, items: Sequence[tuple[str, Trajectory]]) -> tuple[str | None, str]:
    """``(model, format)`` of the run that wrote ``src``: a training run's ``config.yaml``, an ``agentrl eval``
    run's ``config.json`` (a file's run is found from its folder), else the trajectories' recorded ``model``."""
    for root in (src, src.parent, src.parent.parent) if src.is_file() else (src,):
        kind = rundir.run_kind(root)
        if kind == rundir.TRAIN:
            cfg = rundir.read_config_yaml(root, fix="view with format=harmony|none|HF_TOKENIZER_PATH")
            return str(cfg.get("model") or "") or None, str(cfg.get("format") or "auto")
        if kind == rundir.EVAL and (root / rundir.EVAL_CONFIG).is_file():
            cfg = rundir.read_json(root / rundir.EVAL_CONFIG, what="the eval config",
                                   fix="view with format=harmony|none|HF_TOKENIZER_PATH")
            model = cfg.get("model")
            if model and not str(model).startswith(("http://", "https://")):
                return str(model), str(cfg.get("format") or "auto")
    model = next((t.model for _, t in items if t.model), None)
    return model, "auto"


@dataclass
class ViewConfig:
    """Settings of ``agentrl view``."""

    src: str = key(doc="a trajectory JSONL file or a run directory")
    out: str | None = key(None, "the HTML file (default: next to the input, named trajectories.html)")
    format: str = key("auto", "token texts from auto (the format of the model that wrote the run), harmony, none "
                      "(raw ids) or an HF tokenizer path")
    title: str | None = key(None, "the page's title (default: agentrl: SRC)")
    limit: int | None = key(None, "keep the first N trajectories (the page holds every token of each)", min=1)


SPEC = CommandSpec(
    prog="agentrl view",
    schema=ViewConfig,
    usage="agentrl view RUN_OR_JSONL [out=FILE.html] [format=auto|harmony|none|HF_TOKENIZER_PATH] [title=TEXT] [limit=N]",
    positional="src",
    examples={"src": "runs/eval/gsm8k-a"},
    notes="Writes one self-contained HTML file (default: next to the input, named trajectories.html) that\n"
    "opens offline in any browser.",
)


def _view(cfg: Any) -> int:
    src = Path(cfg.src)
    items, problems = load_view_items(src)  # a RunDirError is a usage error: one line, exit 2
    if not items:
        first = f": {problems[0]['source']}: {problems[0]['error'][:160]}" if problems else ""
        files = ", ".join(str(f) for f in rundir.trajectory_files(src))
        raise UsageError(
            f"{files} holds no readable trajectory ({len(problems)} unreadable lines{first}); give a trajectories "
            "file or run directory written by agentrl eval / train"
        )
    if cfg.limit is not None:
        items = items[: cfg.limit]
    try:
        fmt = _load_format(cfg.format, src, items)
    except (OSError, ValueError) as exc:
        raise UsageError(f"format={cfg.format}: {exc}; use auto, harmony, none or an HF tokenizer path") from None
    default_out = (src if src.is_dir() else src.parent) / f"{src.stem if src.is_file() else 'trajectories'}.html"
    out = write_html(items, cfg.out or default_out, fmt=fmt, title=cfg.title or f"agentrl: {src}", problems=problems)
    print(f"wrote {out} ({len(items)} trajectories{f', {len(problems)} unreadable lines' if problems else ''})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl view``."""
    return run(SPEC, argv, _view)
