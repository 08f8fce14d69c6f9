"""``agentrl train env=NAME [key=value ...]``: build the config, run the trainer, print the summary.

``backend=verl`` hands the config to :mod:`agentrl.train.verl_backend.launch` (``--dry-run`` prints the
verl command and resolved config without launching); ``trainer.n_gpus=N`` (N > 1) re-launches under
torchrun with FSDP2 (:func:`agentrl.train.trainer.run_distributed`).

``resume=RUN_DIR`` continues a run from its latest checkpoint with the run's saved ``config.yaml``
(further overrides, e.g. a larger ``trainer.total_steps``, apply on top). A run directory is written
only once the run starts (env, model and engine ready); one that already holds a run is refused unless
``resume=`` continues it or ``overwrite=true`` starts it afresh. Exit codes: 0 done, 2 bad config or
arguments (one line, no traceback), 1 training failed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from omegaconf import OmegaConf

from agentrl.cli_args import UsageError, fail, is_help
from agentrl.train.config import SPEC, ConfigError, build_config, help_text  # noqa: F401 (SPEC: the CLI's keys)


def load_run_config(argv: list[str]):
    """Resolve the config for ``argv`` (handles ``resume=RUN_DIR``); raises ConfigError."""
    resume = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), None)
    if not resume:
        return build_config(argv)
    saved = os.path.join(resume, "config.yaml")
    if not os.path.exists(saved):
        raise ConfigError(f"resume={resume}: no config.yaml there; point resume= at a run directory")
    base = OmegaConf.load(saved)
    overrides = [a for a in argv if not a.startswith(("resume=", "run_dir="))]
    return build_config(overrides + [f"resume={resume}", f"run_dir={resume}"], base=base)


def check_run_dir(cfg) -> None:
    """Refuse a ``run_dir`` that holds a run unless ``resume=`` continues it or ``overwrite=true`` removes
    it (only a directory holding a run's ``config.yaml`` is ever removed)."""
    if cfg.resume or not cfg.run_dir or not os.path.isdir(cfg.run_dir):
        return
    holds_run = os.path.exists(os.path.join(cfg.run_dir, "config.yaml"))
    if cfg.overwrite:
        if not holds_run and os.listdir(cfg.run_dir):
            raise ConfigError(f"overwrite=true: run_dir={cfg.run_dir} is not a run directory (no config.yaml); not removing it")
        shutil.rmtree(cfg.run_dir)
    elif holds_run:
        raise ConfigError(
            f"run_dir={cfg.run_dir} holds a run already: resume={cfg.run_dir} continues it, "
            "overwrite=true starts it afresh, or choose another run_dir="
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_help(argv):
        print(help_text())
        return 0
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        cfg = load_run_config(argv)
        check_run_dir(cfg)
    except UsageError as exc:
        return fail("agentrl train", str(exc))
    if cfg.backend == "verl":
        from agentrl.train.verl_backend.launch import main as verl_main

        return verl_main(cfg, dry_run=dry_run)
    if dry_run:
        print("agentrl train: --dry-run applies to backend=verl only", file=sys.stderr)
        return 2
    if cfg.trainer.n_gpus > 1:
        from agentrl.train.trainer import run_distributed

        return run_distributed(cfg, argv)
    from agentrl.train.trainer import Trainer

    try:
        trainer = Trainer(cfg)
    except (ValueError, RuntimeError, OSError) as exc:  # bad model/device names and missing packages
        return fail("agentrl train", str(exc))
    summary = trainer.fit()
    print(json.dumps(summary, indent=2))
    return 0
