"""The ``agentrl`` verl agent loop: any ``AgentEnv``, token-in-token-out, through verl's rollout servers.

verl's ``AgentLoopWorker`` instantiates :class:`AgentrlAgentLoop` for every dataset row whose
``agent_name`` is ``"agentrl"`` and awaits ``run(sampling_params, **row)``. The row's ``agentrl`` column
(written by :mod:`agentrl.train.verl_backend.dataset`) is the JSON episode spec ``{"env", "entry_point",
"env_kwargs", "format", "task", "max_new_tokens", "format_reward", "trajectory_dir"}``. The episode runs through the shared episode
runner (:func:`agentrl.episodes.run_episode`, the same loop as the trainer, eval and the product Agent)
with a :class:`VerlServerPolicy`:

1. the env is built (``agentrl.make(env, format=..., **env_kwargs)``, with the boxed-answer bonus of
   ``data.format_reward`` when set; an env name unknown in this worker is registered from the spec's
   ``entry_point`` first) and reset on the task: the prompt token ids come from the env's ChatFormat,
   not from verl's chat template;
2. each action is one ``server_manager.generate(request_id, prompt_ids=<context>, sampling_params=...)``
   (bounded by ``max_new_tokens`` and by what is left of ``rollout.response_length``, stopping at the
   format's stop tokens); its ids and log-probs go to ``env.astep``;
3. the env appends its observation tokens, and the runner repeats until the env terminates or truncates.

The returned ``AgentLoopOutput`` is ``env.trajectory`` field for field: ``prompt_ids``, ``response_ids``,
``response_mask`` (1 = sampled, 0 = env tokens), ``response_logprobs`` (the server's, 0.0 on env tokens;
``None`` when the server returned none, i.e. ``rollout.calculate_log_probs=false``),
``routed_experts`` (the server's MoE routing, when it records it), ``reward_score`` (the env's reward, so
verl needs no reward function), ``num_turns`` (verl's count of
messages: the prompt, each model action, each env answer) and ``metrics``. ``extra_fields`` carries the
weight versions the episode was sampled with, as verl's own agent loops do (``global_steps`` and
``min_global_steps`` of the first generation, ``max_global_steps`` of the last: verl's v1 trainer reads them
for its staleness metrics and fails without them), next to our ``reward_components``, ``terminated`` and
``truncated``. Nothing is re-tokenised.
The env's episode budget is set to ``len(prompt) + rollout.response_length`` tokens so the response
always fits verl's padded width; a prompt longer than ``rollout.prompt_length`` raises.

An episode that a tool's backend ended (``stop_reason="infrastructure"``: a sandbox pool that admits no session,
a lost worker; not the model's failure) is run again, like :func:`agentrl.episodes.collect` does, up to
:data:`agentrl.episodes.runner.INFRA_RETRIES` times, each with a fresh request id. One that still fails reaches
verl marked, never as the model's answer: ``response_mask`` all 0 (no token of it is trained on), ``reward_score``
0 and ``extra_fields["infrastructure_error"]`` saying what failed (``None`` for every other episode), and the agent
loop logs it. verl's group baselines still see its 0 (verl has no way to drop one sample of a group).

With ``trajectory_dir`` in the spec, each finished episode is appended as one JSON line
(``Trajectory.to_json``: ``task_id``, ``group`` = verl's prompt ``uid``, ``policy_version`` = the weights
version it was sampled with, verl's ``global_steps``) to ``<trajectory_dir>/step_<NNNNNN>-<pid>.jsonl`` (validation rows:
``eval_step_...``), where ``NNNNNN`` is the training step the sample was drawn for (verl's
``global_steps`` of the row, else the weights version + 1); one file per worker process, so concurrent
workers never interleave lines. A failed write is logged, never raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from agentrl import rundir
from agentrl.episodes import Action, EpisodeLimits, EpisodeState, run_episode
from agentrl.episodes import runner as episode_runner
from agentrl.harmony import FORMAT_NAMES, make_format
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.trajectory import SamplingRecord, Trajectory
from agentrl.train.verl_backend.config_map import AGENT_NAME

SPEC_COLUMN = "agentrl"
"""The dataset column holding the JSON episode spec."""

logger = logging.getLogger("agentrl.verl")

_FORMATS: dict[tuple[str, int], ChatFormat] = {}


def resolve_format(kind: str, tokenizer: Any, hf_model_type: str | None) -> ChatFormat:
    """The ChatFormat for ``kind`` (``harmony``, ``chat_template`` or ``auto``: Harmony for GPT-OSS
    models, the tokenizer's chat template otherwise; :func:`agentrl.harmony.make_format`), built once per
    process and tokenizer."""
    if kind not in FORMAT_NAMES:
        raise ValueError(f"unknown format {kind!r} in the agentrl episode spec; use {', '.join(FORMAT_NAMES)}")
    key = (kind, id(tokenizer))
    if key not in _FORMATS:
        _FORMATS[key] = make_format(kind, tokenizer=tokenizer, model_type=hf_model_type)
    return _FORMATS[key]


def parse_spec(raw: Any) -> dict[str, Any]:
    """The episode spec of one dataset row (a JSON string or an already-decoded dict)."""
    spec = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    missing = {"env", "task"} - set(spec)
    if missing:
        raise ValueError(f"agentrl episode spec lacks {sorted(missing)}; rewrite the dataset with agentrl")
    return spec


def verl_num_turns(traj: Trajectory) -> int:
    """verl's ``num_turns``: the prompt, plus each model action, plus each env answer."""
    return 1 + sum(1 + (t.env_span[1] > t.env_span[0]) for t in traj.turns)


def trajectory_to_output(
    traj: Trajectory,
    metrics: dict[str, float],
    *,
    logprobs: bool = True,
    routed_experts: Any = None,
    server_fields: dict[str, Any] | None = None,
    infrastructure_error: str | None = None,
) -> AgentLoopOutput:
    """The verl ``AgentLoopOutput`` carrying ``traj`` unchanged (see module docstring); ``logprobs=False``
    (the server returned none) gives ``response_logprobs=None`` rather than the env's 0.0 placeholders.
    ``routed_experts``: the last generation's MoE routing from the server (routing replay), cut to the
    sequence length as verl's own loops do. ``server_fields``: what the servers reported in their outputs'
    ``extra_fields`` (weight versions; see :meth:`VerlServerPolicy.record`). ``infrastructure_error``: a tool's
    backend ended the episode (module docstring): its ``response_mask`` is all 0 and its reward 0."""
    traj.validate()
    broken = infrastructure_error is not None
    if routed_experts is not None:
        routed_experts = routed_experts[: len(traj.prompt_ids) + len(traj.response_ids)]
    return AgentLoopOutput(
        prompt_ids=list(traj.prompt_ids),
        response_ids=list(traj.response_ids),
        response_mask=[0] * len(traj.response_mask) if broken else list(traj.response_mask),
        response_logprobs=list(traj.rollout_logprobs) if logprobs else None,
        routed_experts=routed_experts,
        reward_score=0.0 if broken else float(traj.reward),
        num_turns=verl_num_turns(traj),
        metrics=AgentLoopMetrics(**metrics),
        extra_fields={
            **(server_fields or {}),
            "reward_components": dict(traj.reward_components),
            "terminated": traj.terminated,
            "truncated": traj.truncated,
            "infrastructure_error": infrastructure_error,
            "turn_scores": [],
            "tool_rewards": [],
        },
    )


def make_env(spec: dict[str, Any], fmt: ChatFormat) -> Any:
    """The env of an episode spec, with the spec's format, env kwargs and boxed-answer bonus; an env name
    this process does not know is registered from the spec's ``entry_point``."""
    import agentrl
    from agentrl.envs import env_class, register

    name = spec["env"]
    try:
        cls = env_class(name)
    except KeyError:
        if not spec.get("entry_point"):
            raise
        register(name, spec["entry_point"])
        cls = env_class(name)
    env_kwargs = dict(spec.get("env_kwargs") or {})
    if spec.get("format_reward"):
        from agentrl.envs.rewards import with_boxed_bonus

        env_kwargs["rubric"] = with_boxed_bonus(cls.rubric, float(spec["format_reward"]))
    return agentrl.make(name, format=fmt, **env_kwargs)


def trajectory_file(directory: str, row: dict[str, Any], server_fields: dict[str, Any]) -> str:
    """Where an episode of dataset row ``row`` is saved (see module docstring)."""
    step = row.get("global_steps")
    if step is None and server_fields.get("global_steps") is not None:
        step = int(server_fields["global_steps"]) + 1
    split = (row.get("extra_info") or {}).get("split") if isinstance(row.get("extra_info"), dict) else None
    prefix = "eval_step" if split == "test" else "step"
    name = f"{prefix}_{int(step):06d}" if step is not None else f"{prefix}_unknown"
    return os.path.join(directory, f"{name}-{os.getpid()}.jsonl")


def save_trajectory(directory: str, traj: Trajectory, row: dict[str, Any], server_fields: dict[str, Any]) -> None:
    """Append ``traj`` as one JSON line (see module docstring; :func:`agentrl.rundir.append_lines`); errors are
    logged, not raised."""
    if traj.task_id is None:
        traj.task_id = str((row.get("task") or {}).get("id", row.get("index", "")))
    traj.group = str(row.get("uid", row.get("index", "")))
    version = server_fields.get("global_steps")
    traj.policy_version = None if version is None else int(version)
    path = trajectory_file(directory, row, server_fields)
    try:
        rundir.append_lines(path, [traj.to_json()])
    except OSError as exc:
        logger.warning("agentrl agent loop: could not save a trajectory to %s: %s", path, exc)


class VerlServerPolicy:
    """verl's rollout servers as an episode policy: one ``server_manager.generate`` per action, on the
    exact token stream so far, bounded by ``max_new_tokens`` and by the tokens left in the episode's
    response budget, stopping at the format's stop tokens. One instance per episode (one request id:
    sticky server, prefix cache)."""

    def __init__(self, server_manager: Any, sampling_params: dict[str, Any], stop_token_ids: list[int],
                 max_new_tokens: int, prompt_length: int, env_name: str):
        self.server_manager = server_manager
        self.params = dict(sampling_params, stop_token_ids=list(stop_token_ids))
        self.max_new_tokens = max_new_tokens
        self.prompt_length = prompt_length
        self.env_name = env_name
        self.request_id = uuid4().hex
        self.routed_experts: Any = None  # the latest generation's MoE routing, when the server records it
        self.server_fields: dict[str, Any] = {}  # the servers' extra_fields (weight versions), see record()

    async def act(self, episode: EpisodeState) -> list[Action]:
        prompt = len(episode.trajectory.prompt_ids)
        if prompt > self.prompt_length:
            raise ValueError(
                f"env {self.env_name!r} rendered a prompt of {prompt} tokens, over "
                f"rollout.prompt_length={self.prompt_length}; raise verl.max_prompt_length"
            )
        budget = episode.tokens_left
        if budget < 1:
            raise RuntimeError(
                "the env left no response budget without ending the episode; "
                "this breaks the max_total_tokens contract of AgentEnv"
            )
        out = await self.server_manager.generate(
            request_id=self.request_id,
            prompt_ids=episode.context,
            sampling_params=dict(self.params, max_tokens=min(self.max_new_tokens, budget)),
        )
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts
        self.record(dict(out.extra_fields or {}))
        logprobs = None if out.log_probs is None else [float(x) for x in out.log_probs]
        episode.trajectory.sampling = SamplingRecord.of(dict(self.params, max_new_tokens=self.max_new_tokens))
        return [Action([int(t) for t in out.token_ids], logprobs)]

    def record(self, fields: dict[str, Any]) -> None:
        """Keep the first generation's ``extra_fields`` (``global_steps``, ``min_global_steps``, ...) and
        advance ``max_global_steps`` with each later one, as verl's tool agent loop does."""
        if not self.server_fields:
            self.server_fields = fields
        elif fields.get("max_global_steps") is not None:
            self.server_fields["max_global_steps"] = fields["max_global_steps"]


@register(AGENT_NAME)
class AgentrlAgentLoop(AgentLoopBase):
    """verl agent loop over an agentrl ``AgentEnv`` (see module docstring)."""

    def __init__(self, *args: Any, hf_model_type: str | None = None, **kwargs: Any):
        super().__init__(*args, hf_model_type=hf_model_type, **kwargs)
        self.hf_model_type = hf_model_type
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if SPEC_COLUMN not in kwargs:
            raise ValueError(
                f"dataset row has no {SPEC_COLUMN!r} column; write the dataset with "
                "agentrl.train.verl_backend.dataset (agentrl train backend=verl does)"
            )
        spec = parse_spec(kwargs[SPEC_COLUMN])
        fmt = resolve_format(spec.get("format", "auto"), self.tokenizer, self.hf_model_type)
        env = make_env(spec, fmt)
        try:
            retries = episode_runner.INFRA_RETRIES
            for attempt in range(retries + 1):  # a tool's backend that failed: run it again (module docstring)
                policy = VerlServerPolicy(
                    self.server_manager,
                    sampling_params,
                    list(fmt.stop_token_ids),
                    max_new_tokens=int(spec.get("max_new_tokens") or self.response_length),
                    prompt_length=self.prompt_length,
                    env_name=spec["env"],
                )
                result = await run_episode(
                    env, policy, task=spec["task"], limits=EpisodeLimits(max_response_tokens=self.response_length)
                )
                if not result.infrastructure:
                    break
                logger.warning("agentrl agent loop: %s (run %d of %d)\n%s", result.error, attempt + 1,
                               retries + 1, result.traceback or "")
                if attempt < retries:
                    await asyncio.sleep(episode_runner.INFRA_RETRY_DELAY_S * (attempt + 1))
        finally:
            await env.aclose()
        metrics = {"generate_sequences": result.policy_s, "tool_calls": result.env_s}
        if spec.get("trajectory_dir"):
            save_trajectory(spec["trajectory_dir"], result.trajectory, {**kwargs, "task": spec["task"]},
                            policy.server_fields)
        return trajectory_to_output(
            result.trajectory, metrics, logprobs=result.has_logprobs, routed_experts=policy.routed_experts,
            server_fields=policy.server_fields, infrastructure_error=result.error if result.infrastructure else None,
        )
