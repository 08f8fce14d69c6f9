"""The eval run directory: every finished episode appended as it finishes, failures, the config.

Layout (``out``): ``trajectories.jsonl`` (one finished episode per line, appended and flushed as it
finishes; ``metadata`` carries ``item_id``, ``sample``, ``correct``, ``answer``, ``latency_s``),
``errors.jsonl`` (episodes that failed, e.g. an endpoint down after retries; they are retried on the next
run), ``config.json`` and ``metrics.json``. Rerunning with the same ``out`` skips finished
``(item, sample)`` pairs; a config that changes what is measured (:data:`~agentrl.evaluation.config.RESUME_KEYS`)
is refused unless ``overwrite=True``, which starts the directory afresh.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from agentrl.evaluation.config import RESUME_KEYS, EvalConfig
from agentrl.harmony.trajectory import Trajectory


class ResultStore:
    """The run directory: finished episodes (``trajectories.jsonl``), failures (``errors.jsonl``), config."""

    #: what a run writes into its directory (``overwrite`` removes exactly these)
    FILES = ("trajectories.jsonl", "errors.jsonl", "config.json", "metrics.json", "trajectories.html")

    def __init__(self, out: Path, config: EvalConfig, *, write_config: bool = True):
        self.out = out
        if write_config and config.overwrite:
            for name in self.FILES:
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.traj_path = out / "trajectories.jsonl"
        self.error_path = out / "errors.jsonl"
        cfg_path = out / "config.json"
        self.unreadable = 0
        self._fd = self._err = -1
        if not write_config:  # a child process of a multi-process run: the parent checked the config
            self._open()
            return
        current = {
            f.name: getattr(config, f.name) for f in fields(config)
        }  # shallow: env_kwargs may hold live objects
        if cfg_path.exists():
            previous = json.loads(cfg_path.read_text())
            now = json.loads(json.dumps({k: current[k] for k in RESUME_KEYS}, default=repr))
            diff = {k: (previous.get(k), now[k]) for k in RESUME_KEYS if previous.get(k) != now[k]}
            if diff:
                raise ValueError(
                    f"{out} holds a run with a different config ({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                    "use another out=..., or overwrite=true to start it afresh"
                )
        saved = {k: v for k, v in current.items() if k != "api_key"}
        cfg_path.write_text(json.dumps(saved, indent=1, default=repr))
        self._ensure_newline(self.traj_path)
        self._ensure_newline(self.error_path)
        self._open()

    def _open(self) -> None:
        """Append-only descriptors: each record is one ``write`` of a whole line, so records from several
        processes never interleave."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._fd = os.open(self.traj_path, flags, 0o644)
        self._err = os.open(self.error_path, flags, 0o644)

    @staticmethod
    def _ensure_newline(path: Path) -> None:
        """A line torn by a crash is kept; new lines start after it."""
        if path.exists() and path.stat().st_size:
            with path.open("rb+") as fh:
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def load(self) -> list[Trajectory]:
        """Every readable finished trajectory (torn or foreign lines are counted in ``unreadable``)."""
        out, self.unreadable = [], 0
        if self.traj_path.exists():
            for line in self.traj_path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    out.append(Trajectory.from_json(line))
                except (ValueError, KeyError, TypeError):
                    self.unreadable += 1
        return out

    def write(self, traj: Trajectory) -> None:
        os.write(self._fd, (traj.to_json() + "\n").encode("utf-8"))

    def write_error(self, item_id: str, sample: int, error: str) -> None:
        """Record a failed episode (``error``: ``"ExceptionType: message"``); it is retried next run."""
        record = {"item_id": item_id, "sample": sample, "error": error, "time": time.time()}
        os.write(self._err, (json.dumps(record) + "\n").encode("utf-8"))

    def close(self) -> None:
        for fd in (self._fd, self._err):
            if fd >= 0:
                os.close(fd)
        self._fd = self._err = -1


def items_digest(items: list[tuple[str, dict[str, Any]]]) -> str:
    """A fingerprint of the evaluated items (ids and task contents), so runs over different items can be
    told apart (``agentrl eval --compare`` warns)."""
    import hashlib

    blob = json.dumps([[i, t] for i, t in items], sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

