"""Map an ``agentrl train`` config onto verl's Hydra config (``verl/trainer/config/ppo_trainer.yaml``).

Contract: :func:`verl_settings` takes our resolved training config (an OmegaConf ``DictConfig`` or a
nested ``dict`` shaped like :class:`agentrl.train.config.TrainConfig`, with its
:class:`~agentrl.train.config.VerlSection` under ``verl``) and the dataset paths, and returns the verl keys to set with their values, in a stable
order; :func:`verl_overrides` renders them as the Hydra override strings ``verl.trainer.main_ppo`` takes,
followed by the user's raw ``verl.overrides``. Only our cross-field checks run here (:func:`check_ours`);
verl's own validation runs in :mod:`agentrl.train.verl_backend.validate`.

Names follow verl where the concept is the same, so most keys map one to one (:data:`MAPPING`, derived from the
keys declared with ``verl=`` in :mod:`agentrl.train.config`), including ``actor.policy_loss`` ->
``policy_loss.loss_mode``. The ones computed here: ``actor.num_mini_batches`` ->
``ppo_mini_batch_size = rollout.batch_size / num_mini_batches``; ``rollout.top_k=0`` -> ``-1``;
``attn_implementation`` (default ``agentrl_sink`` for GPT-OSS models) -> ``override_config``;
``actor_rollout_ref.model.use_remove_padding`` (verl's packed training rows) is on exactly when the attention
keeps packed sequences apart (:data:`PACKED_ATTENTION`, or verl's default flash_attention_2 when none is
set): GPT-OSS's eager attention would attend across the packed sequences, so with
``attn_implementation=eager`` verl trains on padded rows instead (and Ulysses, which needs packed rows,
is refused).

The on-policy fix is chosen afterwards, on verl's *resolved* config (ours plus every raw
``verl.overrides``), by :func:`choose_policy_loss`: the user's loss (``actor.policy_loss`` or a raw
``loss_mode`` override) becomes ``agentrl_onpolicy[_<loss>]`` exactly when the resolved config makes one
optimizer step per batch, and is otherwise left as it is; it is never replaced by another loss.
LoRA (``actor.lora.*``, :func:`lora_settings`): ``rank`` -> ``actor_rollout_ref.model.lora_rank``, ``alpha`` ->
``lora_alpha`` (an integer; null: ``2 * rank``), ``target_modules`` split into ``target_modules`` (linear layers;
``all-linear`` by default, GPT-OSS's attention projections) and ``+target_parameters`` (GPT-OSS's fused
experts); verl has no LoRA dropout (refused). verl then trains the adapters only, and its reference is the
actor with the adapters disabled, as in the embedded trainer.
``verl.rollout`` -> ``actor_rollout_ref.rollout.name`` as resolved on this machine by
:func:`~agentrl.train.verl_backend.rollout_backend.choose_rollout` (``auto``: vllm or sglang, whichever is
installed); with ``verl.rollout=agentrl``, ``rollout.max_batch_size`` -> ``rollout.max_num_seqs`` (the most
sequences the engine samples in one batch).

``rollout.max_staleness=k`` (asynchronous rollouts, :func:`async_settings`) -> verl 0.9.1's own asynchronous
v1 trainer instead of a re-implementation: ``trainer.v1.trainer_mode=colocate_async`` (rollout and training on the
same GPUs, partial rollouts: requests in flight are paused for the update and resumed with the new weights),
``colocate_async.num_warmup_batches=k`` (``k + 1`` batches in flight, one new batch per step),
``sampler.max_off_policy_threshold=k + 1`` (verl counts the weight versions a group spans: the step it was
submitted at through the step that trains it, so a lag of ``k`` updates spans ``k + 1``) and
``sampler.max_off_policy_strategy=wait`` (dropless: a group in flight at the bound is waited for, never dropped;
verl trains the oldest finished groups first). verl recomputes the old log-probs with the weights before the
update (the proximal policy) and corrects behaviour -> proximal with ``algorithm.rollout_correction``, which the
config requires at ``k > 0`` as for the embedded trainer. What stays verl's: which groups form a batch (the
finished ones, oldest first, not the synchronous trainer's batches) and the bound's enforcement (verl waits for a
group that reached it only while it samples a batch; the embedded trainer's per-token check has no verl
counterpart). ``k=0``: verl's synchronous trainer, as before.

Run directory, logging and resume (the embedded trainer's layout, see :mod:`agentrl.train.trainer`):
``run_dir`` (made absolute) -> ``trainer.default_local_dir = RUN_DIR/checkpoints`` (verl's checkpoints,
``global_step_<N>/`` + ``latest_checkpointed_iteration.txt``), ``trainer.experiment_name``, and
``trainer.agentrl.{run_dir,tensorboard}`` for the ``agentrl`` logger backend
(:mod:`agentrl.train.verl_backend.tracking`), which ``trainer.logger`` always includes, so verl's
per-step metrics land in ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/tensorboard`` (``trainer.wandb`` adds
verl's ``wandb`` backend). ``trainer.save_every`` -> ``trainer.save_freq`` (0: none),
``trainer.keep_checkpoints`` -> ``trainer.max_actor_ckpt_to_keep``. ``resume=RUN_DIR`` ->
``trainer.resume_mode=resume_path`` with ``trainer.resume_from_path`` = the run's latest verl checkpoint
(:func:`latest_verl_checkpoint`; VerlConfigError when there is none); without ``resume=``,
``trainer.resume_mode=auto`` (a run directory that already holds a checkpoint continues from it, as the
embedded trainer does).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.train.config import TrainConfig, VerlSection
from agentrl.train.verl_backend.rollout_backend import ROLLOUT_NAME, RolloutChoice, choose_rollout

AGENT_NAME = "agentrl"
"""The name our agent loop registers under in verl (and the ``agent_name`` of every dataset row)."""

SINK_ATTENTION = "agentrl_sink"
"""The transformers attention implementation our plugin registers in every verl worker."""

ONPOLICY_LOSS = "agentrl_onpolicy"
"""The on-policy fix with verl's ``vanilla``; ``agentrl_onpolicy_<loss>`` composes it with ``<loss>``
(registered in verl by ``agentrl.train.verl_backend.losses``)."""
LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
NOT_COMPOSABLE = {
    "bypass_mode": "it trains against the rollout log-probs (old_log_prob = rollout_log_prob) by design",
}

TRACKING_NAME = "agentrl"
"""The logger backend :mod:`agentrl.train.verl_backend.tracking` registers in verl (``trainer.logger``)."""

TRACKING_CONFIG_KEY = "agentrl"
"""The section under verl's ``trainer`` telling that backend where to write (``run_dir``, ``tensorboard``)."""

PACKED_ATTENTION = (SINK_ATTENTION, "flash_attention_2", "flash_attention_3")
"""Attention implementations that keep sequences packed into one row apart (through ``position_ids``), so
verl may train on packed rows (``use_remove_padding``); eager and sdpa would attend across sequences."""



class VerlConfigError(ValueError):
    """A config that verl would reject (or that we know cannot work), found before launch."""


def _derived_mapping() -> list[tuple[str, str, Callable[[Any], Any]]]:
    """``(our key, verl key, transform)`` for every key declared with ``verl=`` in
    :class:`~agentrl.train.config.TrainConfig`: its ``verl_value=``, else the conversion to the key's type
    (``bool``, ``int``, ``float``, ``str``; other values pass as they are)."""
    from agentrl.cli_args import declarations, field_type

    out = []
    for ours, meta in declarations(TrainConfig).items():
        targets = meta.get("verl")
        if not targets:
            continue
        tp = field_type(TrainConfig, ours)
        transform = meta.get("verl_value") or (tp if tp in (bool, int, float, str) else (lambda v: v))
        out += [(ours, theirs, transform) for theirs in ((targets,) if isinstance(targets, str) else targets)]
    return out


#: (our key, verl key, transform), from the declarations (``verl=`` in :mod:`agentrl.train.config`). A value
#: of None keeps verl's default.
MAPPING: list[tuple[str, str, Callable[[Any], Any]]] = _derived_mapping()

# Keys we always set, because verl's default does not fit an agentrl run.
FIXED: dict[str, Any] = {
    "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
    "actor_rollout_ref.rollout.calculate_log_probs": True,  # rollout log-probs: correction + on-policy check
    "actor_rollout_ref.rollout.mode": "async",
    "data.return_raw_chat": True,
    "data.filter_overlong_prompts": False,  # the env renders the prompt, not verl's chat template
    "trainer.val_before_train": False,
}


def select(cfg: Any, key: str) -> Any:
    """Plain value at dotted ``key`` of a DictConfig or nested dict; ``None`` when absent."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) and not hasattr(node, "keys"):
            return None
        if part not in node:
            return None
        node = node[part]
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    return node


_PLAIN = re.compile(r"^[A-Za-z0-9_./:@+-]+$")


def hydra_value(value: Any) -> str:
    """Render a Python value as a Hydra override value (strings quoted when they need it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def is_gpt_oss(model: str) -> bool:
    """True for a GPT-OSS model: a name containing ``gpt-oss`` or a local checkpoint of that type."""
    if "gpt-oss" in model.lower() or "gpt_oss" in model.lower():
        return True
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type") == "gpt_oss"
        except (OSError, ValueError):
            return False
    return False


def with_verl_defaults(cfg: Any) -> Any:
    """``cfg`` (DictConfig or dict) as a DictConfig whose ``verl`` section is a typed :class:`VerlSection`
    with defaults filled in; an unknown ``verl.*`` key or a badly typed value raises VerlConfigError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.create({"verl": OmegaConf.structured(VerlSection)})
    try:
        return OmegaConf.merge(base, cfg)
    except OmegaConfBaseException as exc:
        raise VerlConfigError(
            f"bad verl backend setting: {str(exc).splitlines()[0]}. "
            f"Valid verl.* keys: {', '.join(VerlSection.__dataclass_fields__)}"
        ) from None


def _n_gpus(cfg: Any) -> int:
    return int(select(cfg, "trainer.n_gpus_per_node") or 8) * int(select(cfg, "trainer.nnodes") or 1)


def rollout_choice(cfg: Any) -> RolloutChoice:
    """The rollout engine ``verl.rollout`` resolves to on this machine, and why (VerlConfigError if invalid)."""
    try:
        return choose_rollout(str(select(cfg, "verl.rollout") or "auto"))
    except ValueError as exc:
        raise VerlConfigError(str(exc)) from None


def latest_verl_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """``RUN_DIR/checkpoints/global_step_<N>`` named by verl's ``latest_checkpointed_iteration.txt``, or
    None when the run has no complete checkpoint."""
    root = Path(run_dir) / "checkpoints"
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        return None
    folder = root / f"global_step_{int(text)}"
    return folder if folder.is_dir() else None


def _resume_settings(cfg: Any) -> dict[str, Any]:
    resume = select(cfg, "resume")
    if not resume:
        return {"trainer.resume_mode": "auto"}
    folder = latest_verl_checkpoint(resume)
    if folder is None:
        raise VerlConfigError(
            f"resume={resume}: no verl checkpoint there ({Path(resume) / 'checkpoints'} has no "
            "latest_checkpointed_iteration.txt naming a global_step_<N> folder). The run saved none "
            "(trainer.save_every=0, or it stopped before its first save); start it again without resume="
        )
    return {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(folder.resolve())}


def resolved_attention(cfg: Any) -> str | None:
    """``attn_implementation``, or ``agentrl_sink`` for a GPT-OSS model when unset (None: verl's default)."""
    attention = select(cfg, "attn_implementation")
    if attention is None and is_gpt_oss(str(select(cfg, "model"))):
        attention = SINK_ATTENTION
    return None if attention is None else str(attention)


def packs_sequences(attention: str | None) -> bool:
    """True when ``attention`` keeps sequences packed in one row apart (None: verl's flash_attention_2)."""
    return attention is None or attention in PACKED_ATTENTION


def check_ours(cfg: Any) -> None:
    """Cross-field checks verl makes late (after Ray starts) or not at all. Raises VerlConfigError."""
    model = select(cfg, "model")
    if not model:
        raise VerlConfigError("model is not set; pass model=<HF id or local HF checkpoint>, e.g. model=openai/gpt-oss-20b")
    if str(model).endswith(".gguf") or str(model) == "smollm2-135m":
        raise VerlConfigError(
            f"model={model!r} is a GGUF checkpoint, which verl's FSDP and vLLM workers cannot load; "
            "pass a Hugging Face model id or a local HF checkpoint directory"
        )
    n_gpus = _n_gpus(cfg)
    for key in ("verl.tensor_parallel", "verl.ulysses_sp"):
        size = select(cfg, key)
        if size is not None and (int(size) < 1 or n_gpus % int(size)):
            raise VerlConfigError(
                f"{key}={size} must be >= 1 and divide the GPU count "
                f"(trainer.n_gpus_per_node x trainer.nnodes = {n_gpus})"
            )
    attention = resolved_attention(cfg)
    if int(select(cfg, "verl.ulysses_sp") or 1) > 1 and not packs_sequences(attention):
        raise VerlConfigError(
            f"verl.ulysses_sp needs packed sequences, which attn_implementation={attention} would attend "
            f"across; use attn_implementation={SINK_ATTENTION} (GPT-OSS) or flash_attention_2, or verl.ulysses_sp=1"
        )
    if rollout_choice(cfg).name == ROLLOUT_NAME and int(select(cfg, "verl.tensor_parallel") or 1) != 1:
        raise VerlConfigError(
            "verl.rollout=agentrl runs one engine per GPU; set verl.tensor_parallel=1, or use "
            "verl.rollout=vllm/sglang for models that need tensor parallelism"
        )
    batch = select(cfg, "rollout.batch_size")
    minis = select(cfg, "actor.num_mini_batches")
    if batch is not None and minis is not None and int(batch) % int(minis):
        raise VerlConfigError(
            f"rollout.batch_size={batch} must be divisible by actor.num_mini_batches={minis} "
            "(verl counts mini-batches in prompts)"
        )


def lora_settings(cfg: Any) -> dict[str, Any]:
    """verl's LoRA keys for ``actor.lora`` (rank > 0; the rank itself maps by its declaration):
    ``actor_rollout_ref.model.lora_alpha`` (an integer in verl; None -> ``2 * rank``), ``target_modules`` and,
    for GPT-OSS's fused experts, ``+actor_rollout_ref.model.target_parameters`` (PEFT's parameter targeting),
    split by :func:`agentrl.models.lora.split_target_names`. Raises VerlConfigError for a fractional alpha or a
    dropout (verl's FSDP LoRA has none)."""
    rank = int(select(cfg, "actor.lora.rank") or 0)
    if not rank:
        return {}
    alpha = select(cfg, "actor.lora.alpha")
    alpha = 2 * rank if alpha is None else float(alpha)
    if alpha != int(alpha):
        raise VerlConfigError(
            f"actor.lora.alpha={alpha:g}: verl's lora_alpha is an integer; set actor.lora.alpha to a whole number "
            f"(e.g. {max(1, round(alpha))}) or use backend=embedded"
        )
    dropout = float(select(cfg, "actor.lora.dropout") or 0.0)
    if dropout:
        raise VerlConfigError(
            f"actor.lora.dropout={dropout:g}: verl's LoRA has no dropout; set actor.lora.dropout=0 or use backend=embedded"
        )
    from agentrl.models.lora import split_target_names

    try:
        modules, parameters = split_target_names(list(select(cfg, "actor.lora.target_modules") or []),
                                                 gpt_oss=is_gpt_oss(str(select(cfg, "model"))))
    except ValueError as exc:
        raise VerlConfigError(str(exc)) from None
    out: dict[str, Any] = {"actor_rollout_ref.model.lora_alpha": int(alpha),
                           "actor_rollout_ref.model.target_modules": modules}
    if parameters:
        out["+actor_rollout_ref.model.target_parameters"] = parameters
    return out


def async_settings(cfg: Any) -> dict[str, Any]:
    """verl's asynchronous-trainer keys for ``rollout.max_staleness`` (the module docstring says how they map);
    empty at 0 (verl's synchronous trainer)."""
    lag = int(select(cfg, "rollout.max_staleness") or 0)
    if not lag:
        return {}
    return {"trainer.use_v1": True, "trainer.v1.trainer_mode": "colocate_async",
            "trainer.v1.colocate_async.num_warmup_batches": lag,
            "trainer.v1.sampler.max_off_policy_threshold": lag + 1,
            "trainer.v1.sampler.max_off_policy_strategy": "wait"}


def verl_settings(cfg: Any, train_files: Sequence[str], val_files: Sequence[str]) -> dict[str, Any]:
    """The verl keys we set and their values, in a stable order (see module docstring)."""
    cfg = with_verl_defaults(cfg)
    check_ours(cfg)
    out: dict[str, Any] = {"data.train_files": list(train_files), "data.val_files": list(val_files)}
    out.update(FIXED)
    out["actor_rollout_ref.rollout.name"] = rollout_choice(cfg).name
    if out["actor_rollout_ref.rollout.name"] == ROLLOUT_NAME and select(cfg, "rollout.max_batch_size") is not None:
        # the transformers engine's batch bound, as in the embedded trainer (vLLM/SGLang keep verl's own)
        out["actor_rollout_ref.rollout.max_num_seqs"] = int(select(cfg, "rollout.max_batch_size"))
    for ours, theirs, transform in MAPPING:
        value = select(cfg, ours)
        if value is not None:
            out[theirs] = transform(value)
    batch, minis = select(cfg, "rollout.batch_size"), select(cfg, "actor.num_mini_batches")
    if batch is not None and minis is not None:
        out["actor_rollout_ref.actor.ppo_mini_batch_size"] = int(batch) // int(minis)
    out["trainer.logger"] = ["console", TRACKING_NAME] + (["wandb"] if select(cfg, "trainer.wandb") else [])
    run_dir = select(cfg, "run_dir")
    if run_dir:
        run_dir = os.path.abspath(str(run_dir))
        out["trainer.default_local_dir"] = str(Path(run_dir) / "checkpoints")
        out["trainer.experiment_name"] = Path(run_dir).name
        out[f"+trainer.{TRACKING_CONFIG_KEY}.run_dir"] = run_dir
        tensorboard = select(cfg, "trainer.tensorboard")
        out[f"+trainer.{TRACKING_CONFIG_KEY}.tensorboard"] = True if tensorboard is None else bool(tensorboard)
    keep = select(cfg, "trainer.keep_checkpoints")
    if keep is not None:
        out["trainer.max_actor_ckpt_to_keep"] = int(keep)
    out.update(_resume_settings(cfg))
    out.update(lora_settings(cfg))
    out.update(async_settings(cfg))
    attention = resolved_attention(cfg)
    out["actor_rollout_ref.model.use_remove_padding"] = packs_sequences(attention)
    if attention:
        out["+actor_rollout_ref.model.override_config.attn_implementation"] = str(attention)
    return out


def verl_overrides(
    cfg: Any, train_files: Sequence[str], val_files: Sequence[str], *, loss_mode: str | None = None
) -> list[str]:
    """Hydra override strings for ``verl.trainer.main_ppo``: ours, then the user's ``verl.overrides``.

    ``loss_mode`` (the choice of :func:`choose_policy_loss`) replaces the mapped ``actor.policy_loss`` and
    comes last, after the raw overrides, so that it is what verl resolves."""
    cfg = with_verl_defaults(cfg)
    settings = verl_settings(cfg, train_files, val_files)
    if loss_mode is not None:
        settings.pop(LOSS_MODE_KEY, None)
    overrides = [f"{key}={hydra_value(value)}" for key, value in settings.items()]
    extra = select(cfg, "verl.overrides") or []
    if isinstance(extra, str):
        extra = [extra]
    overrides += [str(item) for item in extra]
    if loss_mode is not None:
        overrides.append(f"{LOSS_MODE_KEY}={hydra_value(loss_mode)}")
    return overrides


def onpolicy_loss_name(base: str) -> str:
    """The verl policy-loss name of the on-policy fix composed with ``base``."""
    return ONPOLICY_LOSS if base == "vanilla" else f"{ONPOLICY_LOSS}_{base}"


def fix_base(name: str) -> str | None:
    """``<loss>`` for a name made by :func:`onpolicy_loss_name` (the fix composed with it), else None."""
    if name == ONPOLICY_LOSS:
        return "vanilla"
    prefix = ONPOLICY_LOSS + "_"
    return name[len(prefix):] if name.startswith(prefix) and len(name) > len(prefix) else None


def optimizer_steps_per_batch(resolved: Any) -> int:
    """Optimizer steps verl's actor makes per training batch under the resolved config:
    ``ceil(data.train_batch_size / actor.ppo_mini_batch_size) * actor.ppo_epochs``."""
    batch = int(select(resolved, "data.train_batch_size"))
    mini = int(select(resolved, "actor_rollout_ref.actor.ppo_mini_batch_size"))
    epochs = int(select(resolved, "actor_rollout_ref.actor.ppo_epochs"))
    return -(-batch // max(mini, 1)) * epochs


def choose_policy_loss(
    resolved: Any, *, onpolicy_fix: bool = True, registered: Collection[str] | None = None
) -> tuple[str, str]:
    """``(loss_mode, why)`` for verl's resolved config (a DictConfig or nested dict of the whole config).

    The user's loss is ``policy_loss.loss_mode`` as resolved. With one optimizer step per batch (see
    :func:`optimizer_steps_per_batch`), ``onpolicy_fix`` and no ``bypass_mode``, it is composed with the
    on-policy fix (``agentrl_onpolicy[_<loss>]``); otherwise it stays as it is. ``registered``: verl's
    policy-loss registry once every plugin has loaded (the composed name must be in it). A loss that
    cannot be composed, or an explicit ``agentrl_onpolicy*`` on a multi-step config, raises VerlConfigError.
    """
    current = str(select(resolved, LOSS_MODE_KEY) or "vanilla")
    steps = optimizer_steps_per_batch(resolved)
    bypass = bool(select(resolved, "algorithm.rollout_correction.bypass_mode"))
    shape = (
        f"data.train_batch_size={select(resolved, 'data.train_batch_size')}, "
        f"actor_rollout_ref.actor.ppo_mini_batch_size={select(resolved, 'actor_rollout_ref.actor.ppo_mini_batch_size')}, "
        f"actor_rollout_ref.actor.ppo_epochs={select(resolved, 'actor_rollout_ref.actor.ppo_epochs')}"
    )
    explicit = fix_base(current)
    if explicit is not None:
        if steps != 1 or bypass:
            why = f"{steps} optimizer steps per batch ({shape})" if steps != 1 else "bypass_mode is on"
            raise VerlConfigError(
                f"policy loss {current!r} (the on-policy fix) needs one optimizer step per batch on verl's own "
                f"old_log_prob, but the resolved config has {why}; it would train on a stale old_log_prob. "
                f"Use loss_mode={explicit} instead, or make ppo_mini_batch_size equal train_batch_size with ppo_epochs=1"
            )
        return current, f"the on-policy fix composed with {explicit!r} (set explicitly; one optimizer step per batch)"
    if not onpolicy_fix:
        return current, f"{current!r} as configured (actor.onpolicy_fix=false)"
    if steps != 1:
        return current, f"{current!r} as configured: {steps} optimizer steps per batch ({shape}), so the " \
                        "old log-probs of later steps are genuinely off-policy and the fix does not apply"
    if bypass:
        return current, f"{current!r} as configured: bypass_mode uses the rollout log-probs as old_log_prob " \
                        "(verl then trains with its bypass_mode loss)"
    if current in NOT_COMPOSABLE:
        raise VerlConfigError(
            f"policy loss {current!r} cannot take the on-policy fix ({NOT_COMPOSABLE[current]}), and agentrl "
            "does not replace a chosen loss; set actor.onpolicy_fix=false to train with it as it is"
        )
    composed = onpolicy_loss_name(current)
    if registered is not None and composed not in registered:
        raise VerlConfigError(
            f"policy loss {current!r} has no on-policy variant {composed!r}: agentrl composes the fix with the "
            "losses in verl's registry when its plugin loads (verl's own, and plugins loaded before it), and "
            f"{current!r} is not among them{'' if current in registered else ' (nor is it a verl loss at all: check the spelling)'}. "
            "agentrl does not replace a chosen loss; set actor.onpolicy_fix=false to train with it as it is"
        )
    return composed, f"the on-policy fix composed with {current!r} (one optimizer step per batch)"
