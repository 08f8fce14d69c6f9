"""verl's logger metrics into agentrl's run directory: the ``agentrl`` backend of ``trainer.logger``.

verl's trainer logs every step through ``verl.utils.tracking.Tracking`` (console, wandb, tensorboard, file,
...). verl 0.9.1 has no registry for logger backends, so :func:`register_tracking` (run by our plugin in
every verl process) adds ``agentrl`` to ``Tracking.supported_backend`` and wraps ``Tracking.__init__`` and
``Tracking.finish``: with ``"agentrl"`` in ``trainer.logger`` the tracker gets an
:class:`AgentrlTrackingBackend`, which writes each step's metrics with agentrl's own
:class:`~agentrl.train.metrics.MetricsSink`, exactly as the embedded trainer does:

- ``RUN_DIR/metrics.jsonl``: one record per logged step, ``{"step": s, <verl metric>: value, ...}``
  under verl's metric names (``timing_s/*``, ``perf/*``, ``actor/*``, ``critic/score/*``,
  ``rollout_corr/*``, ``training/rollout_probs_diff_*``, ...), read back by
  :func:`agentrl.rundir.read_metrics` and ``agentrl plot``;
- ``RUN_DIR/tensorboard/``: the same scalars (with ``trainer.tensorboard``).

Where it writes comes from the verl config the tracker is built with (``launch`` sets these keys):
``trainer.agentrl.run_dir`` (required) and ``trainer.agentrl.tensorboard`` (default true).

Values: Python/numpy/torch scalars are logged as floats (ints kept as ints); anything else (strings,
arrays, tables) is skipped. On a resumed run the records after the step verl resumes from are dropped
first (a step that was logged but not checkpointed is logged again, not twice): the resumed step is
found the way verl's trainer finds it (``trainer.resume_mode``: ``auto`` reads
``latest_checkpointed_iteration.txt`` under ``trainer.default_local_dir``, ``resume_path`` parses
``global_step_<N>`` from ``trainer.resume_from_path``, ``disable`` starts from step 0).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any

from agentrl.train.metrics import MetricsSink
from agentrl.train.verl_backend.config_map import TRACKING_CONFIG_KEY as CONFIG_KEY
from agentrl.train.verl_backend.config_map import TRACKING_NAME


def scalar(value: Any) -> float | int | None:
    """``value`` as a plain Python number, or None when it is not a single finite-or-infinite number
    (bools become ints; numpy and torch scalars and one-element arrays/tensors are unwrapped)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else size if isinstance(size, int) else None
    if callable(item) and (count is None or count == 1):
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return scalar(out) if isinstance(out, (bool, int, float)) else None
    return None


def resumed_step(trainer_cfg: Mapping[str, Any]) -> int:
    """The step verl's trainer resumes from for this ``trainer`` config section (0: a fresh start)."""
    mode = trainer_cfg.get("resume_mode", "auto")
    if mode == "disable":
        return 0
    if mode == "resume_path":
        match = re.search(r"global_step_(\d+)", str(trainer_cfg.get("resume_from_path") or ""))
        return int(match.group(1)) if match else 0
    root = trainer_cfg.get("default_local_dir")
    tracker = os.path.join(str(root), "latest_checkpointed_iteration.txt") if root else None
    if not tracker or not os.path.exists(tracker):
        return 0
    try:
        step = int(open(tracker, encoding="utf-8").read().strip())
    except ValueError:
        return 0
    return step if os.path.isdir(os.path.join(str(root), f"global_step_{step}")) else 0


class AgentrlTrackingBackend:
    """One verl tracking backend writing to ``RUN_DIR`` (see module docstring). verl calls
    ``log(data=..., step=...)`` once per step and ``finish()`` at the end."""

    def __init__(self, run_dir: str, *, tensorboard: bool = True, resume_from: int = 0, config: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.sink = MetricsSink(run_dir, tensorboard=tensorboard, wandb=False, wandb_project="", config=config or {})
        self.sink.truncate_after(resume_from)
        self.resume_from = resume_from
        self.closed = False

    @classmethod
    def from_verl_config(cls, config: Mapping[str, Any] | None) -> AgentrlTrackingBackend:
        trainer = dict((config or {}).get("trainer") or {})
        ours = dict(trainer.get(CONFIG_KEY) or {})
        run_dir = ours.get("run_dir")
        if not run_dir:
            raise ValueError(
                f"trainer.logger includes {TRACKING_NAME!r} but trainer.{CONFIG_KEY}.run_dir is not set; "
                f"launch through `agentrl train backend=verl` (it sets it), or add "
                f"+trainer.{CONFIG_KEY}.run_dir=<dir> to the verl command"
            )
        return cls(str(run_dir), tensorboard=bool(ours.get("tensorboard", True)), resume_from=resumed_step(trainer))

    def log(self, data: Mapping[str, Any], step: int) -> None:
        metrics: dict[str, float | int] = {}
        for key, value in data.items():
            number = scalar(value)
            if number is not None:
                metrics[str(key)] = number
        self.sink.log(int(step), metrics)

    def finish(self) -> None:
        if not self.closed:
            self.closed = True
            self.sink.close()


def register_tracking() -> list[str]:
    """Make ``agentrl`` a backend of verl's ``Tracking`` (idempotent); returns ``["agentrl"]``."""
    from verl.utils.tracking import Tracking

    if TRACKING_NAME not in Tracking.supported_backend:
        Tracking.supported_backend.append(TRACKING_NAME)
    if getattr(Tracking, "_agentrl_wrapped", False):
        return [TRACKING_NAME]
    verl_init, verl_finish = Tracking.__init__, Tracking.finish

    @functools.wraps(verl_init)
    def __init__(self, project_name, experiment_name, default_backend="console", config=None):
        verl_init(self, project_name, experiment_name, default_backend, config)
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend or [])
        if TRACKING_NAME in backends:
            self.logger[TRACKING_NAME] = AgentrlTrackingBackend.from_verl_config(config)

    @functools.wraps(verl_finish)
    def finish(self, exit_code: int = 0):
        finished = getattr(self, "_finished", False)
        verl_finish(self, exit_code)
        ours = getattr(self, "logger", {}).get(TRACKING_NAME)
        if ours is not None and not finished:
            ours.finish()

    Tracking.__init__ = __init__
    Tracking.finish = finish
    Tracking._agentrl_wrapped = True
    return [TRACKING_NAME]

