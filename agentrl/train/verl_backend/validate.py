"""Compose and validate a verl config exactly as ``verl.trainer.main_ppo`` would, without launching.

:func:`compose_verl_config` runs Hydra's compose API on the installed verl's own
``trainer/config/ppo_trainer.yaml`` with our overrides, offline, so an unknown key or a bad value fails
the way ``main_ppo`` would fail. :func:`validate_verl_config` then runs verl's own checks
(``verl.utils.config.validate_config``, the same call ``main_ppo.main`` makes first) and builds verl's
config dataclasses for the sections we set. Every failure is re-raised as
:class:`~agentrl.train.verl_backend.config_map.VerlConfigError` naming what was wrong and what to do.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from omegaconf import DictConfig

from agentrl.train.verl_backend.config_map import VerlConfigError


def verl_config_dir() -> str:
    """The installed verl's Hydra config directory (``verl/trainer/config``)."""
    try:
        import verl
    except ImportError as exc:
        raise VerlConfigError(
            f"backend=verl needs verl installed: pip install 'agentrl-sdk[verl]' ({exc})"
        ) from exc
    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose_verl_config(overrides: Sequence[str]) -> DictConfig:
    """verl's ``ppo_trainer`` config with ``overrides`` applied (Hydra compose, no launch)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return compose(config_name="ppo_trainer", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        message = str(exc).strip()
        hint = ""
        if "Could not override" in message or "not in struct" in message:
            hint = (
                "\nThe key does not exist in verl's ppo_trainer config. List the valid keys with "
                "`python -m verl.trainer.main_ppo --cfg job`, fix the spelling, or drop it from "
                "verl.overrides."
            )
        raise VerlConfigError(f"verl rejects the generated config: {message}{hint}") from exc


def validate_verl_config(cfg: DictConfig) -> None:
    """Run verl's own config checks on a composed config; raise VerlConfigError on the first failure."""
    from hydra.errors import HydraException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Disabled critic ..." is expected for GRPO
            validate_config(
                config=_without_vllm_lora_check(cfg),
                use_reference_policy=need_reference_policy(cfg),
                use_critic=need_critic(cfg),
            )
            omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
            omega_conf_to_dataclass(cfg.algorithm)
    except (AssertionError, ValueError, TypeError, KeyError, HydraException) as exc:
        cause = exc.__cause__ if isinstance(exc, HydraException) and exc.__cause__ is not None else exc
        raise VerlConfigError(
            f"verl's config validation failed: {cause}\n"
            "Fix the agentrl setting behind the verl key named above (e.g. rollout.batch_size x rollout.n "
            "must be divisible by the GPU count, as must (rollout.batch_size / actor.num_mini_batches) x "
            "rollout.n); raw verl keys can be set with verl.overrides=[...]."
        ) from exc


def _without_vllm_lora_check(cfg: DictConfig) -> DictConfig:
    """``cfg``, or where vLLM is not installed (a plan made away from the GPU nodes) and a LoRA rank is set for
    a vllm rollout, a copy whose adapters count as merged for the check only: verl checks the rank against
    vLLM's allowed ranks by importing vLLM, which a launch needs on the nodes anyway (the plan says so)."""
    import importlib.util

    from omegaconf import open_dict

    model = cfg.actor_rollout_ref.model
    rank = (model.get("lora") or {}).get("rank", 0) or model.get("lora_rank", 0)
    if not rank or cfg.actor_rollout_ref.rollout.name != "vllm" or importlib.util.find_spec("vllm") is not None:
        return cfg
    copy = cfg.copy()
    with open_dict(copy):
        copy.actor_rollout_ref.model.lora = {**(copy.actor_rollout_ref.model.get("lora") or {}), "merge": True}
    return copy
