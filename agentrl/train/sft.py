"""Supervised fine-tuning on token-exact trajectories: the loss, the data and the step loop.

The loss is the mean negative log-likelihood of the **model tokens** of each trajectory, the positions
where ``Trajectory.response_mask`` is 1. Prompt tokens (system prompt, tool docs, the question) and
everything the env appended (tool outputs, error notes, chat-template headers) are context only and carry
no loss. Token-mean over the whole step (all micro-batches): every model token of the batch weighs the
same, whatever the micro-batching.

Used by ``agentrl sft`` (:mod:`agentrl.train.sft_cli`) and by the trainer's cold-start stage
(``sft.*`` in :class:`~agentrl.train.config.TrainConfig`), with the same data sources:

- trajectories JSONL written by ``agentrl eval`` (``OUT/trajectories.jsonl``) or by the trainer
  (``RUN_DIR/trajectories/*.jsonl``), filtered with ``sft.min_reward`` / ``sft.correct_only``
  (:func:`load_sft_data`);
- demonstrations of a teacher run through the env (:mod:`agentrl.train.teachers`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.activation_checkpointing import activation_checkpointing
from agentrl.train.batch import Batch, collate
from agentrl.train.prefix_sharing import supports_prefix_sharing
from agentrl.train.sft_data import load_sft_data
from agentrl.train.teachers import generate_demonstrations
from agentrl.train.update import forward_logprobs


def sft_loss(
    model: Any, batch: Batch, *, num_tokens: int | torch.Tensor, chunk_size: int = 1024, share_prefix: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, nll_sum)`` of a (micro-)batch: ``loss = -sum(logp * response_mask) / num_tokens`` where
    ``num_tokens`` is the model-token count of the whole optimizer step (so micro-batch losses add up to the
    step's token-mean NLL); ``nll_sum`` (detached) is this micro-batch's summed NLL. Only positions with
    ``response_mask == 1`` (model tokens) enter the loss: prompt, env and tool tokens are context only."""
    log_prob, _ = forward_logprobs(
        model, batch, chunk_size=chunk_size, temperature=1.0, compute_entropy=False, share_prefix=share_prefix
    )
    mask = batch.response_mask.to(log_prob.dtype)
    nll = -(log_prob * mask).sum()
    return nll / num_tokens, nll.detach()


#: Tokens one SFT forward may run with gradient (see :func:`forward_groups`). SmolLM2-135M keeps about 1.6 MB of
#: activations per token (30 layers, fp32), so this bounds a forward's activations to about 2.5 GB whatever the
#: trajectories' lengths; longer trajectories run alone with activation checkpointing (about 0.12 MB per token).
#: 1536 lets a micro-batch of 8 retool demonstrations (1,250-1,380 tokens with the shared prompt) run as one
#: forward, as before the bound: at 1024 each ran as two, the shared prompt computed twice.
MAX_FORWARD_TOKENS = 1536

_MIN_SHARED_PREFIX = 32  # as agentrl.train.prefix_sharing: shorter common prefixes are not shared


def activation_tokens(trajectories: Sequence[Trajectory], *, share_prefix: bool) -> int:
    """Tokens a training forward over ``trajectories`` runs: the collated ``rows x (longest prompt + longest
    response)``, or, when the prompt prefix is shared (:mod:`agentrl.train.prefix_sharing`, which needs
    ``share_prefix`` and a common prefix of at least 32 tokens), the prefix once plus ``rows x longest suffix``."""
    rows = len(trajectories)
    padded = rows * (max(len(t.prompt_ids) for t in trajectories) + max(len(t.response_ids) for t in trajectories))
    if not share_prefix or rows < 2:
        return padded
    first = trajectories[0].prompt_ids
    limit = min(len(t.prompt_ids) for t in trajectories) - 1
    shared = next((i for i in range(limit) if any(t.prompt_ids[i] != first[i] for t in trajectories)), limit)
    if shared < _MIN_SHARED_PREFIX:
        return padded
    return shared + rows * max(len(t.prompt_ids) + len(t.response_ids) - shared for t in trajectories)


def forward_groups(
    trajectories: Sequence[Trajectory], max_tokens: int, *, share_prefix: bool
) -> list[list[Trajectory]]:
    """One micro-batch split into forwards of at most ``max_tokens`` :func:`activation_tokens` each: longest
    trajectory first, each added to the current group while the group stays within the budget. A trajectory
    over the budget by itself is a group of its own (run with activation checkpointing). The loss is a sum
    over tokens divided by the step's token count, so the split changes nothing but memory."""
    groups: list[list[Trajectory]] = []
    for traj in sorted(trajectories, key=lambda t: len(t.prompt_ids) + len(t.response_ids), reverse=True):
        if groups and activation_tokens([*groups[-1], traj], share_prefix=share_prefix) <= max_tokens:
            groups[-1].append(traj)
        else:
            groups.append([traj])
    return groups


class SFTStage:
    """Optimizer steps of supervised fine-tuning over a fixed list of trajectories.

    Step ``k`` (0-based) trains on trajectories ``k*batch_size .. (k+1)*batch_size-1`` of an endless
    sequence of epochs, each a permutation of the data drawn from ``(seed, epoch)``, so the data of a step
    does not depend on earlier steps having run in this process (resume is exact). ``micro_batch_size``
    trajectories per forward/backward at most (gradient accumulation), fewer when they hold more than
    ``max_forward_tokens`` tokens (:func:`forward_groups`: memory stays bounded whatever the trajectories'
    lengths, the gradient is the same); the gradient is clipped at ``grad_clip``.
    """

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        trajectories: Sequence[Trajectory],
        *,
        batch_size: int,
        micro_batch_size: int,
        pad_token_id: int,
        seed: int = 0,
        grad_clip: float = 1.0,
        chunk_size: int = 1024,
        share_prefix: bool = True,
        max_forward_tokens: int = MAX_FORWARD_TOKENS,
    ) -> None:
        if not trajectories:
            raise ValueError("SFT needs at least one trajectory; the data filter kept none")
        if batch_size < 1 or micro_batch_size < 1:
            raise ValueError(f"sft batch sizes must be >= 1, got {batch_size} and {micro_batch_size}")
        self.model, self.optimizer, self.data = model, optimizer, list(trajectories)
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.pad_token_id, self.seed, self.grad_clip = pad_token_id, seed, grad_clip
        self.chunk_size, self.max_forward_tokens = chunk_size, max_forward_tokens
        self.share_prefix = share_prefix and supports_prefix_sharing(model)

    def indices(self, step: int) -> list[int]:
        """Data indices of step ``step`` (see the class docstring)."""
        n = len(self.data)
        out: list[int] = []
        position = step * self.batch_size
        while len(out) < self.batch_size:
            epoch, offset = divmod(position, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
            take = min(self.batch_size - len(out), n - offset)
            out.extend(int(i) for i in order[offset : offset + take])
            position += take
        return out

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the data of step ``step``; returns ``sft/*`` metrics."""
        t0 = time.perf_counter()
        trajs = [self.data[i] for i in self.indices(step)]
        device = next(self.model.parameters()).device
        num_tokens = sum(sum(t.response_mask) for t in trajs)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll_total = 0.0
        trained_tokens = forwards = checkpointed = 0
        for start in range(0, len(trajs), self.micro_batch_size):
            chunk = trajs[start : start + self.micro_batch_size]
            for group in forward_groups(chunk, self.max_forward_tokens, share_prefix=self.share_prefix):
                batch = collate(group, list(range(len(group))), self.pad_token_id).to(device)
                over = activation_tokens(group, share_prefix=self.share_prefix) > self.max_forward_tokens
                with activation_checkpointing(self.model, enabled=over) as on:
                    loss, nll = sft_loss(self.model, batch, num_tokens=max(num_tokens, 1), chunk_size=self.chunk_size,
                                         share_prefix=self.share_prefix and not on)
                    loss.backward()
                nll_total += float(nll)
                trained_tokens += int(batch.attention_mask.sum())
                forwards, checkpointed = forwards + 1, checkpointed + int(on)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        seconds = time.perf_counter() - t0
        return {
            "sft/loss": nll_total / max(num_tokens, 1),
            "sft/grad_norm": float(grad_norm),
            "sft/model_tokens": float(num_tokens),
            "sft/lr": float(self.optimizer.param_groups[0]["lr"]),
            "sft/epoch": step * self.batch_size / len(self.data),
            "sft/forwards": float(forwards),
            "sft/checkpointed_forwards": float(checkpointed),
            "timing_s/sft_step": seconds,
            "perf/sft_tokens_per_s": trained_tokens / max(seconds, 1e-9),
        }


def build_teacher(sft: Any, env_cls: type, stop_token_ids: Sequence[int] = ()) -> Any:
    """The :class:`~agentrl.train.teachers.Teacher` that ``sft.teacher`` names for envs of ``env_cls`` (see
    :class:`~agentrl.train.config.SFTConfig`), or None for ``auto`` on an env without a scripted teacher
    (:meth:`AgentEnv.scripted_teacher <agentrl.envs.AgentEnv.scripted_teacher>`). ``stop_token_ids``: the
    student format's, for a completions teacher. Raises TeacherError for ``scripted`` on an env without one."""
    from agentrl.train.teachers import chat_teacher, engine_teacher, scripted_teacher

    teacher = str(sft.teacher)
    if teacher == "auto":
        return scripted_teacher(env_cls) if env_cls.scripted_teacher() is not None else None
    if teacher == "scripted":
        return scripted_teacher(env_cls)
    from agentrl.engines.client import ChatClient, Endpoint, OpenAIEngine

    endpoint = Endpoint(teacher, model=sft.teacher_model, max_concurrency=max(int(sft.concurrency), 1))
    if sft.teacher_api == "completions":
        from agentrl.engines.base import SamplingParams

        sampling = SamplingParams(max_new_tokens=int(sft.teacher_max_new_tokens),
                                  temperature=float(sft.teacher_temperature), stop_token_ids=list(stop_token_ids))
        return engine_teacher(OpenAIEngine(endpoint), sampling, name=f"completions {teacher}")
    return chat_teacher(
        ChatClient(endpoint),
        {"temperature": float(sft.teacher_temperature), "max_completion_tokens": int(sft.teacher_max_new_tokens)},
        name=f"chat {teacher}",
    )


async def prepare_data(
    sft: Any,
    *,
    env_cls: type | None,
    make_env: Any,
    task: Any,
    vocab_size: int | None,
    seed: int,
    stop_token_ids: Sequence[int] = (),
    progress_interval_s: float = 0.0,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """The SFT data of config section ``sft``: trajectories from ``sft.data`` (filtered), or ``sft.num_demos``
    teacher demonstrations on tasks ``task(0) .. task(num_demos - 1)`` (``task`` maps an index to a training
    task) in envs of ``env_cls`` from ``make_env``. Returns ``(trajectories, info)``; ``info`` says where they
    came from and how many were kept. Empty when ``sft.teacher=auto`` and the env has no scripted teacher.
    ``progress_interval_s``: see :func:`~agentrl.train.teachers.generate_demonstrations`."""
    if sft.data:
        trajs, counts = load_sft_data(
            str(sft.data), min_reward=sft.min_reward, correct_only=bool(sft.correct_only), vocab_size=vocab_size
        )
        return trajs, {"source": str(sft.data), **counts}
    if env_cls is None:
        raise ValueError("SFT needs data: sft.data=PATH (trajectories JSONL / run dir) or env=NAME with a teacher")
    teacher = build_teacher(sft, env_cls, stop_token_ids)
    if teacher is None:
        return [], {"source": f"none ({env_cls.__name__} has no scripted teacher and sft.data is not set)"}
    try:
        tasks = [task(i) for i in range(int(sft.num_demos))]
        demos = await generate_demonstrations(
            make_env, teacher, tasks, seed=seed, concurrency=int(sft.concurrency), min_reward=sft.min_reward,
            correct_only=bool(sft.correct_only), progress_interval_s=progress_interval_s,
        )
    finally:
        await teacher.aclose()
    info = {
        "source": f"teacher {teacher.name}",
        "episodes": demos.episodes, "kept": demos.kept, "failed": demos.failed, "wall_s": round(demos.wall_s, 3),
    }
    if demos.reward_errors:
        info["reward_errors"] = len(demos.reward_errors)
    if demos.errors or demos.reward_errors:
        info["first_error"] = (demos.errors or demos.reward_errors)[0]
    return demos.trajectories, info

