"""``agentrl train env=NAME [key=value ...]``: build the config, run the trainer, print the summary.

``backend=verl`` hands the config to :mod:`agentrl.train.verl_backend.launch` (``--dry-run`` prints the
verl command and resolved config without launching); ``trainer.n_gpus=N`` (N > 1) re-launches under
torchrun with FSDP2 (:func:`agentrl.train.trainer.run_distributed`).

``resume=RUN_DIR`` (or ``--resume RUN_DIR``) continues a run from its latest checkpoint with the run's saved
``config.yaml`` (further overrides, e.g. a larger ``trainer.total_steps``, apply on top). A run directory is
written only once the run starts (env, model and engine ready); one that already holds a run is refused
unless ``resume=`` continues it or ``overwrite=true`` starts it afresh, and another command's directory (an
``agentrl eval`` one) is refused. Exit codes: 0 done, 2 bad config, arguments or run directory (one line, no
traceback), 1 training failed (one line naming the first exception). The full traceback of a fatal error (other
than a usage error) goes to ``RUN_DIR/errors.log`` when the run directory exists (a run that failed to start writes nothing), with those of
failed episodes; ``AGENTRL_DEBUG=1`` re-raises instead (:mod:`agentrl.errorlog`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from omegaconf import OmegaConf

from agentrl import errorlog, rundir
from agentrl.cli_args import CommandSpec, UsageError, fail, interrupted, is_help, split_args
from agentrl.train.config import SPEC, ConfigError, build_config, help_text


def load_run_config(argv: list[str], *, spec: CommandSpec = SPEC, profile: str | None = None):
    """Resolve the config for ``argv`` (``resume=RUN_DIR`` in any spelling: the run's saved config plus the
    other overrides); raises ConfigError or RunDirError (one line)."""
    overrides, bare = split_args(spec, argv)
    resume = next((t.split("=", 1)[1] for t in reversed(overrides) if t.startswith("resume=")), None)
    if not resume:
        return build_config(argv, spec=spec, profile=profile)
    base = rundir.read_config_yaml(resume, fix="point resume= at a directory written by agentrl train")
    kept = [t for t in overrides if not t.startswith(("resume=", "run_dir="))]
    cfg = build_config([*kept, *bare, f"resume={resume}", f"run_dir={resume}"], base=base, spec=spec,
                       base_name=str(rundir.TrainRun(resume).config))
    for key in IDENTITY_KEYS:
        saved, given = OmegaConf.select(base, key, default=_ABSENT), OmegaConf.select(cfg, key)
        if saved is not _ABSENT and _plain(saved) != _plain(given):
            raise ConfigError(
                f"resume={resume} continues the run as it was: {key}={_plain(given)!r} differs from its {key}="
                f"{_plain(saved)!r}; drop {key}= to resume, or start a new run (run_dir=..., model={resume} to "
                "start from its weights)"
            )
    return cfg


_ABSENT = object()

#: Keys that make a run what it is; a resume may not change them (other keys, e.g. trainer.total_steps, it may).
IDENTITY_KEYS = ("env", "env_kwargs", "model", "model_kwargs", "format", "seed", "data.tasks", "data.level", "backend",
                 "actor.lora.rank", "actor.lora.alpha", "actor.lora.target_modules")  # a LoRA checkpoint's shapes


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_run_dir(cfg) -> None:
    """Refuse a ``run_dir`` that holds a run unless ``resume=`` continues it or ``overwrite=true`` removes
    it (only a directory holding a training run's ``config.yaml`` is ever removed), and one written by another
    command."""
    if cfg.resume or not cfg.run_dir or not os.path.isdir(cfg.run_dir):
        return
    kind = rundir.run_kind(cfg.run_dir)
    if kind == rundir.EVAL:
        raise ConfigError(f"run_dir={cfg.run_dir} is an `agentrl eval` directory, not a training run; choose another run_dir=")
    if cfg.overwrite:
        if kind is None and os.listdir(cfg.run_dir):
            raise ConfigError(f"overwrite=true: run_dir={cfg.run_dir} is not a run directory (no config.yaml); not removing it")
        shutil.rmtree(cfg.run_dir)
    elif kind == rundir.TRAIN:
        raise ConfigError(
            f"run_dir={cfg.run_dir} holds a run already: resume={cfg.run_dir} continues it, "
            "overwrite=true starts it afresh, or choose another run_dir="
        )


_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _dry_run(argv: list[str]) -> tuple[bool, list[str]]:
    """``--dry-run`` (also ``--dry-run=true|false|1|0``, like every bool flag) out of ``argv``: whether it is on,
    and the other words. UsageError for another value."""
    on, rest = False, []
    for word in argv:
        flag, eq, value = word.partition("=")
        if flag.replace("_", "-") != "--dry-run":
            rest.append(word)
        elif not eq:
            on = True
        elif value.lower() in _BOOLS:
            on = _BOOLS[value.lower()]
        else:
            raise UsageError(f"--dry-run takes true or false, got {value!r}")
    return on, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_help(argv):
        print(help_text())
        return 0
    try:
        dry_run, argv = _dry_run(argv)
        cfg = load_run_config(argv)
        check_run_dir(cfg)
    except UsageError as exc:
        return fail("agentrl train", str(exc))
    if cfg.backend == "verl":
        from agentrl.train.verl_backend.launch import main as verl_main

        return verl_main(cfg, dry_run=dry_run)
    if dry_run:
        return fail("agentrl train", "--dry-run applies to backend=verl only")
    if cfg.trainer.n_gpus > 1:
        from agentrl.train.trainer import run_distributed

        return run_distributed(cfg, argv)
    return run_trainer(cfg, "agentrl train")


def run_trainer(cfg, prog: str, failures: tuple[type[BaseException], ...] = ()) -> int:
    """Build the trainer for ``cfg``, train, print the summary. A bad model, device or run directory is one
    line and exit status 2; a run stopped by its failure budget (:class:`~agentrl.train.trainer.TrainingFailed`)
    or by one of ``failures`` is one line and exit status 1."""
    from agentrl.train.reporting import headline
    from agentrl.train.trainer import Trainer, TrainingFailed

    try:
        trainer = Trainer(cfg)
    except (ValueError, RuntimeError, OSError) as exc:  # bad model/device names and missing packages
        if errorlog.debug():
            raise
        if not isinstance(exc, UsageError):  # a usage error's one line says it all; the rest may be bugs
            _log_fatal(cfg.run_dir, exc)
        return fail(prog, str(exc))
    try:
        summary = trainer.fit()
    except UsageError as exc:  # a damaged run directory found on resume
        if errorlog.debug():
            raise
        return fail(prog, str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: say how to go on
        what, code = interrupted(exc)
        ckpt = rundir.latest_checkpoint(trainer.run_dir)
        where = f"from its checkpoint {os.path.basename(ckpt)}" if ckpt else "from the start (no checkpoint yet)"
        print(f"{prog}: {what}; `{prog} resume={trainer.run_dir}` continues the run {where}", file=sys.stderr)
        return code
    except (TrainingFailed, *failures) as exc:
        if errorlog.debug():
            raise
        _log_fatal(trainer.run_dir, exc)
        print(f"{prog}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: its traceback is printed, and kept with the run
        _log_fatal(trainer.run_dir, exc)
        raise
    print(json.dumps(summary, indent=2))
    print(headline(summary, prog))  # the last line: complete or stopped by a budget, and the held-out figures
    return 0


def _log_fatal(run_dir: str | None, exc: BaseException) -> None:
    """Keep ``exc``'s full traceback in ``run_dir/errors.log`` when the run directory exists."""
    if run_dir and os.path.isdir(run_dir):
        errorlog.append(run_dir, f"fatal: {type(exc).__name__}", errorlog.format_exception(exc))
