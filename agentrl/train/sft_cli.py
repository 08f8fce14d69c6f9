"""``agentrl sft``: supervised fine-tuning on token-exact trajectories, into a checkpoint every model key takes.

    agentrl sft env=retool teacher=scripted steps=12                      # scripted demonstrations through the env
    agentrl sft env=retool teacher=http://127.0.0.1:8001/v1 num_demos=256 # distil a served model (correct episodes)
    agentrl sft env=retool data=runs/eval/retool-big min_reward=1         # eval output -> SFT data
    agentrl sft resume=runs/retool-sft-20261201-101500                    # continue a killed run
    agentrl train env=retool model=runs/retool-sft-20261201-101500 sft.steps=0   # then RL from it

It is ``agentrl train`` with no RL steps: the same config (every ``agentrl train`` key is accepted; the
``sft.*`` section is the one that matters, see :class:`~agentrl.train.config.SFTConfig`), model loading,
metrics (``RUN_DIR/sft/metrics.jsonl``, TensorBoard), atomic checkpoints (``sft_<k>`` every
``sft.save_every`` steps, then the final one) and ``resume=``. The held-out evaluation before and after
(``eval.num_tasks``, greedy) goes to ``summary.json``. Keys of the ``sft`` section may be given without
their prefix (``steps=12`` is ``sft.steps=12``, ``data=PATH`` is ``sft.data=PATH``). Without ``env=``, the
env is read from the data's trajectories. Exit codes: 0 done, 2 bad config, 1 failed.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from agentrl.train.config import SFTConfig, TrainConfig, all_keys

#: what ``agentrl sft`` changes from ``agentrl train``'s defaults (overridable)
SFT_DEFAULTS = ["trainer.total_steps=0", "sft.steps=12", "eval.num_tasks=32", "trainer.save_every=1"]
_SFT_FIELDS = tuple(f.name for f in dataclasses.fields(SFTConfig))


def expand_shorthand(argv: list[str]) -> list[str]:
    """``steps=12`` -> ``sft.steps=12`` for the ``sft`` section's keys that are not ``agentrl train`` keys
    themselves (``data=PATH`` means ``sft.data=PATH``; ``data.tasks=...`` stays as it is)."""
    top = {k for k in all_keys() if "." not in k}
    out = []
    for token in argv:
        key, sep, value = token.partition("=")
        if sep and "." not in key and key not in top and key in _SFT_FIELDS:
            token = f"sft.{key}={value}"
        out.append(token)
    return out


def infer_env(data: str) -> str | None:
    """The registered env name of the first trajectory in ``data`` (eval runs record ``env_name``; the
    trainer records the env class), or None."""
    import agentrl.envs.registry as registry
    from agentrl.train.sft_data import trajectory_files

    for path in [p for p in str(data).split(",") if p]:
        for file in trajectory_files(path):
            with open(file, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    meta = json.loads(line).get("metadata", {})
                    if meta.get("env_name") in registry.registered():
                        return str(meta["env_name"])
                    cls = meta.get("env")
                    for name, entry in registry.registered().items():
                        if cls and entry.rsplit(":", 1)[-1] == cls:
                            return name
                    return None
    return None


def help_text() -> str:
    from omegaconf import OmegaConf

    defaults = OmegaConf.structured(TrainConfig)
    usage = "usage: agentrl sft env=NAME [steps=N] [teacher=scripted|http://...] [data=PATH] [key=value ...] [resume=RUN_DIR]"
    lines = [usage, "", __doc__.strip(), "", "sft keys (defaults):"]
    for name in _SFT_FIELDS:
        lines.append(f"  sft.{name} = {OmegaConf.select(defaults, f'sft.{name}')!r}")
    lines += [
        "",
        f"agentrl sft sets: {' '.join(SFT_DEFAULTS)}",
        "Other keys that apply: env, env_kwargs.*, model, model_kwargs.*, format, device, dtype, seed, threads, run_dir, "
        "resume, data.tasks/level (demonstration and evaluation tasks), rollout.max_new_tokens/max_turns/max_batch_size "
        "(evaluation episodes), eval.*, actor.freeze/betas/logprob_chunk_size/share_prompt_prefix, trainer.save_every/"
        "keep_checkpoints/tensorboard/max_wall_s. `agentrl train --help` lists them all.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from agentrl.cli_args import UsageError, fail, is_help
    from agentrl.train.cli import check_run_dir, load_run_config
    from agentrl.train.config import ConfigError
    from agentrl.train.teachers import SCRIPTED_TEACHERS

    argv = list(sys.argv[1:] if argv is None else argv)
    if is_help(argv):
        print(help_text())
        return 0
    argv = expand_shorthand(argv)
    resuming = any(a.startswith("resume=") for a in argv)
    try:
        if not resuming and not any(a.startswith("env=") for a in argv):
            data = next((a.split("=", 1)[1] for a in argv if a.startswith("sft.data=")), None)
            env = infer_env(data) if data else None
            if env is None:
                raise ConfigError(
                    "env is required (e.g. `agentrl sft env=retool`); with data=PATH it is read from the trajectories, "
                    "but these do not name a registered env"
                )
            argv = [f"env={env}", *argv]
        cfg = load_run_config(argv if resuming else SFT_DEFAULTS + argv)
        check_run_dir(cfg)
        if cfg.sft.steps < 1:
            raise ConfigError("agentrl sft needs sft.steps >= 1 (steps=N)")
        if not cfg.sft.data and cfg.sft.teacher in ("auto", "scripted") and cfg.env not in SCRIPTED_TEACHERS:
            raise ConfigError(
                f"env {cfg.env!r} has no scripted teacher (envs with one: {', '.join(sorted(SCRIPTED_TEACHERS))}); "
                "give data=PATH (trajectories from `agentrl eval` / `agentrl train`) or teacher=http://HOST:PORT/v1"
            )
    except (UsageError, FileNotFoundError, ValueError) as exc:
        return fail("agentrl sft", str(exc))
    from agentrl.train.trainer import Trainer

    try:
        trainer = Trainer(cfg)
    except (ValueError, RuntimeError, OSError) as exc:
        return fail("agentrl sft", str(exc))
    try:
        summary = trainer.fit()
    except (ValueError, RuntimeError) as exc:  # e.g. data that the filters empty, an unreachable teacher
        print(f"agentrl sft: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0
