"""The eval run directory: every finished episode appended as it finishes, failures, the config.

Layout (``out``, see :mod:`agentrl.rundir`): ``trajectories.jsonl`` (one finished episode per line, appended
as it finishes; each carries its ``task_id``, ``sample``, ``env``, ``model``, ``latency_s``), ``errors.jsonl``
(episodes that failed, e.g. an endpoint down after retries; they are retried on the next run), ``errors.log``
(the full traceback of each failure, :mod:`agentrl.errorlog`),
``config.json`` and ``metrics.json``. Rerunning with the same ``out`` skips finished ``(item, sample)`` pairs
(a last line torn by a crash is moved to ``trajectories.torn`` and its episode runs again; any other unreadable
line is a :class:`~agentrl.rundir.RunDirError` naming it);
a config that changes what is measured (:data:`~agentrl.evaluation.config.RESUME_KEYS`) is refused unless
``overwrite=True``, which starts the directory afresh. A training run's directory is refused as ``out``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from agentrl import errorlog, rundir
from agentrl.evaluation.config import RESUME_KEYS, EvalConfig
from agentrl.harmony.trajectory import Trajectory


class ResultStore:
    """The run directory: finished episodes (``trajectories.jsonl``), failures (``errors.jsonl``), config.

    Raises :class:`~agentrl.rundir.RunDirError` for an ``out`` that holds a training run, or a run with another
    config (unless ``config.overwrite``), or a damaged ``config.json``."""

    #: what a run writes into its directory (``overwrite`` removes exactly these)
    FILES = rundir.EVAL_FILES

    def __init__(self, out: Path, config: EvalConfig, *, write_config: bool = True):
        self.out = Path(out)
        self.traj_path = self.out / rundir.EVAL_TRAJECTORIES
        self.error_path = self.out / rundir.EVAL_ERRORS
        self.unreadable = 0
        self.problem: str | None = None  # one line about unreadable lines, after load()
        if write_config:  # a child process of a multi-process run skips this: the parent checked the config
            self._check_and_save(config)
        self._trajectories = rundir.AppendFile(self.traj_path)
        self._errors = rundir.AppendFile(self.error_path)

    def _check_and_save(self, config: EvalConfig) -> None:
        if rundir.run_kind(self.out) == rundir.TRAIN:
            raise rundir.RunDirError(
                f"out={self.out} is a training run directory; give agentrl eval its own out=DIR "
                f"(model={self.out} evaluates that run)"
            )
        if config.overwrite:
            for name in self.FILES:
                (self.out / name).unlink(missing_ok=True)
        cfg_path = self.out / rundir.EVAL_CONFIG
        current = {f.name: getattr(config, f.name) for f in fields(config)}  # shallow: env_kwargs may hold objects
        if cfg_path.exists():
            previous = rundir.read_json(
                cfg_path, what="the config of the eval run there",
                fix=f"use another out=..., or overwrite=true to start {self.out} afresh",
            )
            now = json.loads(json.dumps({k: current[k] for k in RESUME_KEYS}, default=repr))
            # a key the saved config lacks was added since that run: it ran with the key's default
            diff = {k: (previous.get(k), now[k]) for k in RESUME_KEYS if k in previous and previous[k] != now[k]}
            if diff:
                changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
                raise rundir.RunDirError(
                    f"{self.out} holds a run with a different config ({changes}); "
                    "use another out=..., or overwrite=true to start it afresh"
                )
        rundir.write_json(cfg_path, {k: v for k, v in current.items() if k != "api_key"})

    def load(self, *, resuming: bool = False) -> list[Trajectory]:
        """Every readable finished trajectory; unreadable lines are counted in ``unreadable`` and described in
        ``problem`` (a torn last line is skipped). ``resuming`` (the load before a run appends): a torn last
        line is moved to ``trajectories.torn`` (kept, out of the way of the lines appended next), and any other
        unreadable line raises :class:`~agentrl.rundir.RunDirError` (one line naming it and the fix)."""
        if not self.traj_path.exists():
            self.unreadable, self.problem = 0, None
            return []
        loaded = rundir.load_trajectories(self.traj_path)
        if resuming and loaded.problems:
            first = loaded.problems[0]
            more = f" ({len(loaded.problems)} unreadable lines in all)" if len(loaded.problems) > 1 else ""
            raise rundir.RunDirError(
                f"{first.source}: {first.error}{more}; repair or delete that line (its episode then runs again), "
                f"or overwrite=true to start {self.out} afresh"
            )
        if resuming and loaded.torn:
            self._set_torn_line_aside()
        self.unreadable, self.problem = len(loaded.problems), loaded.report()
        return loaded.records

    def _set_torn_line_aside(self) -> None:
        """Move the torn last line of ``trajectories.jsonl`` (no newline after it) to ``trajectories.torn``."""
        data = self.traj_path.read_bytes()
        cut = data.rfind(b"\n") + 1
        with rundir.AppendFile(self.out / rundir.EVAL_TORN) as torn:
            torn.write(data[cut:].decode("utf-8", errors="replace"))
        os.truncate(self.traj_path, cut)

    def write(self, traj: Trajectory) -> None:
        self._trajectories.write(traj.to_json())

    def write_error(self, item_id: str, sample: int, error: str) -> None:
        """Record a failed episode (``error``: ``"ExceptionType: message"``); it is retried next run."""
        record = {"item_id": item_id, "sample": sample, "error": error, "time": time.time()}
        self._errors.write(json.dumps(record))

    def log_error(self, what: str, text: str) -> None:
        """Append a failure's full traceback to the directory's ``errors.log`` (:mod:`agentrl.errorlog`)."""
        errorlog.append(self.out, what, text)

    def last_error(self) -> str | None:
        """The error of the latest failed episode recorded, or None."""
        errors = rundir.read_jsonl(self.error_path).records if self.error_path.exists() else []
        return str(errors[-1].get("error")) if errors and isinstance(errors[-1], dict) else None

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        rundir.write_json(self.out / rundir.EVAL_METRICS, metrics)

    def close(self) -> None:
        self._trajectories.close()
        self._errors.close()


def items_digest(items: list[tuple[str, dict[str, Any]]]) -> str:
    """A fingerprint of the evaluated items (ids and task contents), so runs over different items can be
    told apart (``agentrl eval --compare`` warns)."""
    blob = json.dumps([[i, t] for i, t in items], sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
