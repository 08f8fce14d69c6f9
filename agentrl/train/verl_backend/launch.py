"""``agentrl train backend=verl ...``: write the dataset, map and validate the config, launch verl.

:func:`plan` does everything short of launching: it writes ``<run_dir>/verl_data/{train,val}.parquet``
from the env's tasks, maps our config to verl Hydra overrides, composes them with verl's own
``ppo_trainer.yaml``, chooses the policy loss on that resolved config (the on-policy fix composed with
the user's loss exactly when verl will make one optimizer step per batch:
:func:`~agentrl.train.verl_backend.config_map.choose_policy_loss`), runs verl's own validation (any
failure: :class:`VerlConfigError` before launch), and writes our config to ``<run_dir>/config.yaml`` (what
``resume=RUN_DIR`` reloads, as for the embedded trainer) and the fully resolved verl config to
``<run_dir>/verl_config.yaml``. The run directory is made absolute (verl's Ray workers may run elsewhere);
verl writes its checkpoints under ``<run_dir>/checkpoints``, our logger backend ``metrics.jsonl`` and
``tensorboard/``, the agent loop ``trajectories/`` (with ``trainer.save_trajectories``), and Hydra its
``.hydra/`` record and ``main_ppo.log`` under ``<run_dir>/hydra`` (``hydra.run.dir``; never ``./outputs``).
:func:`main` prints the plan (the exact command and the settings as verl resolved them) and, unless
``dry_run``, runs ``python -m verl.trainer.main_ppo <overrides>`` and returns its exit code. The plan
names the rollout engine (``verl.rollout``) and why; launching with vLLM/SGLang when it is not installed
here stops first with a message suggesting ``verl.rollout=agentrl``.

verl starts (or, with ``RAY_ADDRESS`` set / ``ray start`` done on this node, joins) a Ray cluster; the
agentrl plugin is loaded in every worker through the ``verl.plugins`` entry point, so agentrl must be
installed on every node.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentrl import rundir
from agentrl.seeds import HELD_OUT_OFFSET, held_out_seed
from agentrl.train.verl_backend.config_map import (
    LOSS_MODE_KEY,
    VerlConfigError,
    choose_policy_loss,
    hydra_value,
    rollout_choice,
    select,
    verl_overrides,
    verl_settings,
    with_verl_defaults,
)
from agentrl.train.verl_backend.dataset import write_env_dataset
from agentrl.train.verl_backend.rollout_backend import RolloutChoice
from agentrl.train.verl_backend.validate import compose_verl_config, validate_verl_config


@dataclass
class LaunchPlan:
    """What :func:`main` runs: ``command`` (argv), the ``settings`` we set, verl's ``resolved`` config,
    the ``rollout`` engine chosen (with why, and whether it is installed here), why the policy loss is what it
    is (``loss_reason``) and the device-defaults line (``defaults_line``)."""

    command: list[str]
    settings: dict[str, Any]
    resolved: DictConfig
    run_dir: Path
    config_path: Path
    rollout: RolloutChoice
    loss_reason: str = ""
    defaults_line: str = ""


def _run_dir(cfg: Any) -> Path:
    run_dir = select(cfg, "run_dir")
    if run_dir:
        return Path(run_dir)
    return Path("runs") / f"verl-{select(cfg, 'env')}-{time.strftime('%Y%m%d-%H%M%S')}"


def _defaults_line(cfg: Any) -> str:
    """The device-defaults line of a full agentrl config (empty for a partial config, e.g. in tests)."""
    from agentrl.train.config import DEVICE_KEYS, describe_device_defaults

    if select(cfg, "backend") is None or any(select(cfg, k) is None for k in DEVICE_KEYS):
        return ""
    return describe_device_defaults(cfg)


def plan(cfg: Any) -> LaunchPlan:
    """Dataset, overrides, composed + validated verl config; see module docstring."""
    cfg = with_verl_defaults(cfg)
    env = select(cfg, "env")
    if not env:
        raise VerlConfigError("env is not set; pass env=<name>, e.g. env=retool")
    run_dir = _run_dir(cfg).resolve()
    cfg.run_dir = str(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _plan_in(cfg, env, run_dir)
    except BaseException:
        if created:  # a refused plan leaves no run directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _plan_in(cfg: Any, env: str, run_dir: Path) -> LaunchPlan:
    """:func:`plan` once ``run_dir`` exists: its config, the dataset, the composed and validated verl config."""
    (run_dir / rundir.CONFIG_YAML).write_text(rundir.config_yaml_text(cfg))  # what resume=RUN_DIR starts from
    max_turns = select(cfg, "rollout.max_turns")
    env_kwargs = dict(select(cfg, "env_kwargs") or {})
    if max_turns is not None:
        env_kwargs.setdefault("max_turns", int(max_turns))
    seed = int(select(cfg, "seed") or 0)
    train_file, val_file = write_env_dataset(
        run_dir / "verl_data",
        env,
        tasks=str(select(cfg, "data.tasks") or "env"),
        n_train=int(select(cfg, "verl.n_train_tasks")),
        n_val=int(select(cfg, "verl.n_val_tasks")),
        seed=seed,
        level=int(select(cfg, "data.level") or 1),
        eval_seed=held_out_seed(seed, int(select(cfg, "eval.seed_offset") or HELD_OUT_OFFSET)),
        env_kwargs=env_kwargs,
        format=str(select(cfg, "format") or "auto"),
        max_new_tokens=select(cfg, "rollout.max_new_tokens"),
        format_reward=float(select(cfg, "data.format_reward") or 0.0),
        trajectory_dir=str(run_dir / "trajectories") if select(cfg, "trainer.save_trajectories") is not False else None,
    )
    files = ([str(Path(train_file).resolve())], [str(Path(val_file).resolve())])
    settings = verl_settings(cfg, *files)
    overrides = verl_overrides(cfg, *files)
    resolved = compose_verl_config(overrides)
    # the on-policy fix is decided on what verl resolved, raw verl.overrides included
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY  # verl imported: every plugin has loaded

    fix = select(cfg, "actor.onpolicy_fix")
    loss_mode, why = choose_policy_loss(resolved, onpolicy_fix=True if fix is None else bool(fix),
                                        registered=set(POLICY_LOSS_REGISTRY))
    overrides = verl_overrides(cfg, *files, loss_mode=loss_mode)
    resolved = compose_verl_config(overrides)
    settings.pop(LOSS_MODE_KEY, None)
    settings[LOSS_MODE_KEY] = loss_mode
    validate_verl_config(resolved)
    config_path = run_dir / "verl_config.yaml"
    config_path.write_text(OmegaConf.to_yaml(resolved))
    # Hydra's own output (.hydra/, main_ppo.log) goes into the run directory, not ./outputs/ of wherever
    # the user (or a test) started from; it changes nothing in verl's job config
    hydra_dir = f"hydra.run.dir={hydra_value(str(run_dir / 'hydra'))}"
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, hydra_dir]
    return LaunchPlan(command, settings, resolved, run_dir, config_path, rollout_choice(cfg), why,
                      _defaults_line(cfg))


def describe(p: LaunchPlan) -> str:
    """Human-readable plan: the command, then each key we set as verl resolved it."""
    lines = [f"rollout backend: {p.rollout.name}", f"  why: {p.rollout.reason}"]
    if not p.rollout.installed:
        lines.append(f"  warning: {p.rollout.name} is not installed here: launching from this machine stops before "
                     f"verl starts; install {p.rollout.name} on every node, or set verl.rollout=agentrl")
    if p.defaults_line:
        lines[:0] = [p.defaults_line]
    lines += ["", "verl command:", "  " + shlex.join(p.command), "", "resolved verl settings (ours):"]
    for key in p.settings:
        value = OmegaConf.select(p.resolved, key.lstrip("+"))
        shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        lines.append(f"  {key.lstrip('+')} = {shown!r}")
    trainer = p.resolved.trainer
    if trainer.resume_mode == "resume_path":
        resume = f"resume: from {trainer.resume_from_path}"
    else:
        resume = f"resume: {trainer.resume_mode} (continues from {trainer.default_local_dir} if it holds a checkpoint)"
    lines += [
        "",
        f"run directory: {p.run_dir} (config.yaml, metrics.jsonl, tensorboard/, trajectories/, checkpoints/, hydra/)",
        resume,
        f"policy loss: {OmegaConf.select(p.resolved, LOSS_MODE_KEY)}: {p.loss_reason}",
        f"dataset: {p.run_dir / 'verl_data'} (train.parquet, val.parquet)",
        f"full resolved verl config: {p.config_path}",
    ]
    return "\n".join(lines)


def main(cfg: Any, dry_run: bool = False) -> int:
    """Plan, print, and (unless ``dry_run``) launch verl; returns the exit code (2 on a config error)."""
    try:
        launch = plan(cfg)
    except VerlConfigError as exc:
        print(f"agentrl train backend=verl: {exc}", file=sys.stderr)
        return 2
    print(describe(launch), flush=True)
    if dry_run:
        print("\n--dry-run: nothing launched.")
        return 0
    if not launch.rollout.installed:
        print(f"agentrl train backend=verl: {launch.rollout.missing_message()}", file=sys.stderr)
        return 2
    return subprocess.run(launch.command, env=dict(os.environ)).returncode
