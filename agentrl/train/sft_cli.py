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
(``eval.num_tasks``, greedy) goes to ``summary.json``. Its own defaults are the keys declared with ``sft=``
(:data:`~agentrl.train.config.SFT_SPEC`); keys of the ``sft`` section may be given without their prefix
(``steps=12`` is ``sft.steps=12``, ``data=PATH`` is ``sft.data=PATH``). Without ``env=``, the env is read from
the data's trajectories. Exit codes: 0 done, 2 bad config, 1 failed.
"""

from __future__ import annotations

import sys

from agentrl.cli_args import UsageError, fail, is_help, plain_text, value_of
from agentrl.train.config import SFT_SPEC, ConfigError, help_text


def _with_env(argv: list[str]) -> list[str]:
    """``argv`` with ``env=`` read from the data's trajectories when it names none (and does not resume)."""
    if value_of(SFT_SPEC, argv, "resume") or value_of(SFT_SPEC, argv, "env"):
        return argv
    from agentrl.train.sft_data import infer_env

    data = value_of(SFT_SPEC, argv, "sft.data")
    env = infer_env(data) if data else None
    if env is None:
        raise ConfigError(
            "env is required (e.g. `agentrl sft env=retool`); with data=PATH it is read from the trajectories, "
            "but these do not name a registered env"
        )
    return [f"env={env}", *argv]


def main(argv: list[str] | None = None) -> int:
    from agentrl.envs.registry import env_class
    from agentrl.train.cli import check_run_dir, load_run_config, run_trainer

    argv = list(sys.argv[1:] if argv is None else argv)
    if is_help(argv):
        print(help_text(SFT_SPEC, profile="sft") + "\n\n" + plain_text(__doc__.strip()))
        return 0
    try:
        cfg = load_run_config(_with_env(argv), spec=SFT_SPEC, profile="sft")
        check_run_dir(cfg)
        if cfg.sft.steps < 1:
            raise ConfigError("agentrl sft needs sft.steps >= 1 (steps=N)")
        if not cfg.sft.data and cfg.sft.teacher in ("auto", "scripted") and env_class(cfg.env).scripted_teacher() is None:
            raise ConfigError(
                f"env {cfg.env!r} has no scripted teacher (AgentEnv.scripted_teacher); give data=PATH (trajectories "
                "from `agentrl eval` / `agentrl train`) or teacher=http://HOST:PORT/v1"
            )
    except (UsageError, ValueError) as exc:
        return fail("agentrl sft", str(exc))
    # an SFT stage that its filters leave empty, an unreachable teacher: one line, exit status 1
    return run_trainer(cfg, "agentrl sft", failures=(ValueError, RuntimeError))
