"""``AgentEnv``: a ``gymnasium.Env`` whose actions are model completions and whose observations are the
tokens the env appends (tool results, error notes, the next assistant header) plus their parsed messages.

Contract (generic like gymnasium's ``Env[ObsType, ActType]``: ``AgentEnv`` is an
``Env[Observation, ActionLike]``):

- ``reset(seed=None, options=None) -> (obs, info)``: ``obs["tokens"]`` is the full prompt (ending with the
  assistant header), ``obs["messages"]`` the prompt messages. ``options={"task": {...}}`` picks the task;
  otherwise one is drawn with ``self.np_random`` from the env's task list or its offline generator.
  ``info["task"]`` is the task.
- ``step(action) -> (obs, reward, terminated, truncated, info)``. An action is one assistant completion:
  a sequence of token ids, a ``str`` (encoded by the format, special tokens allowed), or any object with
  ``.token_ids`` and ``.logprobs`` (an engine ``Completion``; the log-probs go into the trajectory).
  ``obs["tokens"]`` are the ids to append before sampling the next completion (empty once the episode is
  over). ``reward`` is 0 until the last step, which carries the episode reward.
- The episode ends with ``terminated`` when the model gives a final answer (or, for single-turn envs,
  after its one action) and with ``truncated`` when a limit is hit (turns, tool calls, total tokens) or
  when its last completion stopped without a stop token (cut at the token limit; counted once, as
  ``truncation``).
- Bad model actions never raise: unparseable output, unknown tools, bad arguments, tool timeouts and tool
  exceptions become observations the model can read and are recorded in the trajectory with an error
  kind (``parse_error``, ``unknown_tool``, ``bad_arguments``, ``tool_timeout``, ``tool_exception``,
  ``truncation``). A failure of a tool's backend (error kind ``tool_infrastructure``: a sandbox pool that admits
  no session, a lost worker, an unreachable server; see :class:`~agentrl.envs.tools.base.ToolInfrastructureError`)
  is not the model's: it ends the episode at once with ``truncated=True``, ``stop_reason="infrastructure"``,
  reward 0 and no reward computed, ``trajectory.error`` (and ``info["infrastructure_error"]``) saying what
  failed and :attr:`AgentEnv.infrastructure_tracebacks` its tracebacks; callers retry such an episode or
  leave it out, never score it. A reward function that raises does not reach the caller either: the episode is
  scored 0, and the error is recorded (``trajectory.reward_error``, error kind ``reward_error``,
  ``info["reward_error"]`` on the last step) and shown once per message as a :class:`RewardErrorWarning`.
  Only API misuse raises (stepping a finished episode, mismatched log-probs).
- ``env.trajectory`` is the token-exact :class:`~agentrl.harmony.trajectory.Trajectory`, built with
  :class:`~agentrl.harmony.TrajectoryBuilder` (the builder the token-exactness tests check); it records the
  env's registered name (``env``), the task, and, when the episode ends, the error counts and the stop
  reason. The final step also puts it in ``info["trajectory"]`` together with ``info["reward_components"]``
  and ``info["stop_reason"]`` (also ``trajectory.stop_reason``): ``answer`` (a final answer), ``no_answer``
  (a single-turn env's action without one), ``tool_limit``, ``turn_limit`` or ``token_limit`` (the
  total-token budget, or a last completion cut before its stop token), or ``infrastructure`` (above).
- ``areset``/``astep`` are the async twins (tool calls of one action run concurrently); the sync methods
  drive them on a private event loop. Use one style per env instance. ``close()``/``aclose()`` are
  idempotent.

Subclasses declare ``tools``, ``instructions``, a task generator (:meth:`generate_task`), optionally a
prompt builder (:meth:`prompt_messages`), and the reward (``rubric`` or :meth:`reward`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, TypedDict, runtime_checkable

import gymnasium
import numpy as np

from agentrl.envs import registry
from agentrl.envs.rewards.base import RewardContext, Rubric
from agentrl.envs.spaces import CompletionSpace, as_token_array, observation_space
from agentrl.envs.tasks import load_task_file
from agentrl.envs.tools.base import StatefulTool, Tool
from agentrl.envs.tools.dispatch import Sessions, ToolBox
from agentrl.harmony.builder import TrajectoryBuilder
from agentrl.harmony.factory import default_format
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.trajectory import INFRASTRUCTURE, ToolRecord, Trajectory, parse_error_kind
from agentrl.harmony.types import Message, ParsedTurn, ParseError, ParseErrorKind


class RewardErrorWarning(RuntimeWarning):
    """Emitted (once per message) when an env's reward function raises: the episode is scored 0 and its
    trajectory records the error as ``reward_error`` (error kind ``reward_error``)."""


class Observation(TypedDict):
    """What ``reset``/``step`` observe. ``tokens``: ``np.int64`` ids, shape ``[n]``, to append to the
    token stream (the whole prompt after ``reset``; tool results, notes and the next assistant header after
    ``step``; empty once the episode is over). ``messages``: the same content as parsed messages."""

    tokens: np.ndarray
    messages: tuple[Message, ...]


@runtime_checkable
class SampledCompletion(Protocol):
    """An action that carries its sampling log-probs (an engine ``Completion``, an episode ``Action``).
    ``logprobs``: one natural-log probability per id, or ``None`` when unknown (recorded as 0.0)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None


#: One assistant completion, as ``step`` accepts it: token ids (a sequence or a 1-D integer array), text
#: (encoded by the format, special-token text allowed), or a :class:`SampledCompletion`.
ActionLike = Sequence[int] | np.ndarray | str | SampledCompletion


class TeacherError(RuntimeError):
    """A teacher cannot act on this env or task; the message says why and what to use instead."""


@dataclass(frozen=True)
class EnvLimits:
    """Episode limits. Hitting ``max_turns`` (model actions), ``max_tool_calls`` or ``max_total_tokens``
    (prompt + response) ends the episode with ``truncated=True``. ``tool_timeout_s`` is the default
    per-call limit; results longer than ``max_tool_result_chars`` are cut with a marker."""

    max_turns: int = 8
    max_tool_calls: int = 16
    max_total_tokens: int = 32768
    tool_timeout_s: float = 30.0
    max_tool_result_chars: int = 8000


class AgentEnv(gymnasium.Env[Observation, ActionLike]):
    """Base class of every agentrl env; see the module docstring for the contract."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}
    #: Developer instructions shown to the model (Harmony developer message / system prompt).
    instructions: ClassVar[str | None] = None
    #: If True, the first action always ends the episode (``terminated``), answered or not.
    single_turn: ClassVar[bool] = False
    #: Default limits; override per env class or per instance (``limits=`` or keyword overrides).
    default_limits: ClassVar[EnvLimits] = EnvLimits()
    #: Default reward; subclasses set a :class:`~agentrl.envs.rewards.Rubric` or override :meth:`reward`.
    rubric: Rubric | None = None
    #: A dataset shipped with agentrl (:mod:`agentrl.data`) that ``agentrl eval`` uses for the ``test`` split
    #: when no ``tasks=`` is given (``None``: the offline generator).
    eval_dataset: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        format: ChatFormat | None = None,
        tools: Iterable[Tool] | None = None,
        tasks: Iterable[dict[str, Any]] | str | None = None,
        limits: EnvLimits | None = None,
        rubric: Rubric | None = None,
        render_mode: str | None = None,
        **limit_overrides: Any,
    ) -> None:
        """
        Args:
            format: the ChatFormat (default: the shared HarmonyFormat); pass a ``ChatTemplateFormat`` for
                dense chat models.
            tools: the env's tools (default: :meth:`make_tools`).
            tasks: a list of task dicts or a path to a JSONL/parquet file in this env's task format; default:
                the offline generator.
            limits: an :class:`EnvLimits`; keyword arguments named like its fields override single limits.
            rubric: replaces the env's default rubric.
            render_mode: ``None`` or ``"ansi"`` (``render()`` returns the decoded token stream).
        """
        bad = set(limit_overrides) - set(EnvLimits.__dataclass_fields__)
        if bad:
            raise TypeError(
                f"{type(self).__name__} got unknown keyword arguments {sorted(bad)}; limit fields are "
                f"{sorted(EnvLimits.__dataclass_fields__)}"
            )
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.format = format if format is not None else default_format()
        self.limits = replace(limits or self.default_limits, **limit_overrides)
        if rubric is not None:
            self.rubric = rubric
        self.render_mode = render_mode
        self.toolbox = ToolBox(
            list(tools) if tools is not None else self.make_tools(),
            timeout_s=self.limits.tool_timeout_s,
            max_result_chars=self.limits.max_tool_result_chars,
        )
        if isinstance(tasks, str):
            tasks = self.load_tasks(tasks)
        self._task_list = list(tasks) if tasks is not None else None
        if self._task_list is not None and not self._task_list:
            raise ValueError("tasks is empty; pass at least one task or None for the offline generator")
        self._obs_takes_history = "history" in inspect.signature(self.format.render_observation).parameters
        self.action_space = CompletionSpace(self.format.vocab_size, self.format.stop_token_ids)
        self.observation_space = observation_space(self.format.vocab_size)
        self._sessions = Sessions()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.trajectory: Trajectory | None = None
        self._builder: TrajectoryBuilder | None = None
        self.task: dict[str, Any] | None = None
        self._done = True
        self._tool_calls = 0

    @property
    def infrastructure_tracebacks(self) -> list[str]:
        """The full tracebacks of the current episode's ``tool_infrastructure`` failures (for the run's
        ``errors.log``); empty when there were none."""
        return list(self._sessions.tracebacks)

    @property
    def env_name(self) -> str:
        """The name this env's class is registered under (``agentrl.make`` / ``agentrl eval env=``), else its
        class name; recorded in every trajectory as ``env``."""
        return registry.name_of(type(self))

    # ----------------------------------------------------------------- hooks for subclasses
    def make_tools(self) -> list[Tool]:
        """The env's tools when none are passed to the constructor (default: none)."""
        return []

    @classmethod
    def generate_task(cls, rng: np.random.Generator, split: str = "train") -> dict[str, Any]:
        """One offline task drawn with ``rng``: a dict with at least ``prompt`` (and ``answer`` etc.)."""
        raise NotImplementedError(
            f"{cls.__name__} has no offline task generator; pass tasks=[...] or a task file"
        )

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        """The task of an episode when none is given and no task list was passed (default:
        :meth:`generate_task`); override when generation depends on instance state."""
        return self.generate_task(rng)

    @classmethod
    def load_tasks(cls, path: str) -> list[dict[str, Any]]:
        """Tasks from a local JSONL/parquet file in this env's native format (default: already task dicts)."""
        return load_task_file(path)

    @classmethod
    def tasks(
        cls, split: str = "train", n: int = 100, seed: int = 0, path: str | None = None, **generator_kwargs: Any
    ) -> list[dict[str, Any]]:
        """A task list for training/evaluation: the first ``n`` rows of ``path`` (a local file in the env's
        native format) if given, else ``n`` offline-generated tasks (deterministic in ``seed`` and
        ``split``; ``generator_kwargs`` go to :meth:`generate_task`, e.g. retool's ``tier``). Feed an item to
        ``reset(options={"task": task})``."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if path is not None:
            return cls.load_tasks(path)[:n]
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        return [cls.generate_task(rng, split, **generator_kwargs) for _ in range(n)]

    @classmethod
    def generator_kwargs(cls, env_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``env_kwargs`` (constructor arguments) that :meth:`generate_task` also takes, such
        as retool's ``tier``: a task source built from an env config draws the tasks that env would."""
        params = inspect.signature(cls.generate_task).parameters
        return {k: v for k, v in env_kwargs.items() if k in params and k not in ("rng", "split")}

    @classmethod
    def scripted_teacher(cls) -> Any | None:
        """A scripted policy that demonstrates this env's tasks for supervised cold starts (``agentrl sft``,
        ``sft.teacher=auto|scripted``): an :class:`agentrl.episodes.Policy` (``async act(episode) ->
        actions``) whose actions go through the env like a model's. ``None`` (the default): the env has none.
        A task it cannot solve raises :class:`TeacherError`."""
        return None

    def prompt_messages(self, task: dict[str, Any]) -> list[Message]:
        """The conversation shown to the model for ``task`` (default: one user message, ``task["prompt"]``)."""
        return [Message(role="user", content=str(task["prompt"]))]

    def reward(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        """Score a finished episode: ``(total, components)``. Default: the env's ``rubric``."""
        if self.rubric is None:
            return 0.0, {}
        return self.rubric(ctx)

    # ----------------------------------------------------------------- async API
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Start an episode: pick the task, render the prompt, start a fresh trajectory.

        Args:
            seed: seeds ``self.np_random`` (gymnasium semantics: only when given, or on the first reset).
            options: ``{"task": {...}}`` runs that task; without it a task is drawn with ``self.np_random``
                from the env's task list, else from :meth:`sample_task`.

        Returns:
            ``(observation, info)``: ``observation["tokens"]`` is the whole prompt, ending with the
            assistant header; ``observation["messages"]`` the prompt messages; ``info["task"]`` a copy of
            the task. Tool sessions of the previous episode are released first.

        Raises:
            RuntimeError: the env is closed.
            NotImplementedError: no task given, no task list, and no offline generator.
            Whatever the format raises while rendering (e.g. a chat template that is not append-only).
        """
        self._check_open()
        super().reset(seed=seed)
        await self._sessions.release_all()
        self._sessions.tracebacks.clear()
        options = options or {}
        if options.get("task") is not None:
            task = dict(options["task"])
        elif self._task_list is not None:
            task = dict(self._task_list[int(self.np_random.integers(len(self._task_list)))])
        else:
            task = self.sample_task(self.np_random)
        self.task = task
        messages = self.prompt_messages(task)
        prompt = self.format.render_prompt(messages, self.toolbox.specs, instructions=self.instructions)
        self._builder = TrajectoryBuilder(self.format, prompt, episode=True)
        self.trajectory = self._builder.trajectory
        self.trajectory.env, self.trajectory.task = self.env_name, task
        self._done = False
        self._tool_calls = 0
        self._errors: Counter[str] = Counter()
        self._history: list[Message] = list(messages)  # the conversation so far, for history-aware formats
        obs: Observation = {"tokens": as_token_array(prompt), "messages": tuple(replace(m) for m in messages)}
        return obs, {"task": dict(task)}

    async def astep(self, action: ActionLike) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Apply one model action: parse it, run its tool calls (concurrently), render the answer.

        Args:
            action: one assistant completion (see :data:`ActionLike`); its log-probs, when it carries them,
                go into the trajectory.

        Returns:
            ``(observation, reward, terminated, truncated, info)``: ``observation["tokens"]`` the ids to
            append before the next completion (empty when the episode is over); ``reward`` the episode
            reward on the last step, else 0.0; ``terminated`` on a final answer (or after a single-turn
            env's action); ``truncated`` when a limit ends the episode. ``info``: ``turn`` (model actions
            so far), ``errors`` (this action's error kinds), ``tool_calls`` (so far); on the last step also
            ``trajectory``, ``reward_components`` and ``stop_reason`` (and ``reward_error`` when the reward
            function raised: the reward is then 0).

        Raises:
            RuntimeError: the episode is over or was never started, or the env is closed.
            TypeError: ``action`` is none of the accepted types.
            ValueError: the action's log-probs and token ids differ in length.
            Bad model output and a reward function that raises never raise here: they become error
            observations and trajectory records.
        """
        self._check_open()
        if self._done or self.trajectory is None:
            raise RuntimeError("the episode is over (or was never started); call reset()/areset() first")
        ids, logprobs = self._action_ids(action)
        traj, builder = self.trajectory, self._builder
        assert builder is not None
        versions = getattr(action, "policy_versions", None)  # per token, from an engine taking weight updates
        parsed = builder.add_model(ids, logprobs, parsed=self._parse(ids), versions=versions)
        errors = [parse_error_kind(e.kind) for e in parsed.errors]

        terminated = truncated = False
        limit_hit: str | None = None
        obs_messages: list[Message] = []
        calls = parsed.tool_calls
        if self.single_turn:
            terminated = True
        elif calls:
            if self._tool_calls + len(calls) > self.limits.max_tool_calls:
                truncated, limit_hit = True, "tool_limit"
            else:
                self._tool_calls += len(calls)
                records = await self.toolbox.call_many(calls, self._sessions)
                builder.add_tools(records)
                errors.extend(r.error for r in records if r.error)
                obs_messages = [
                    self._tool_message(c.recipient, r) for c, r in zip(calls, records, strict=True)
                ]
                broken = [r for r in records if r.error == "tool_infrastructure"]
                if broken:  # the backend failed, not the model: end here, unscored (module docstring)
                    truncated, limit_hit = True, INFRASTRUCTURE
                    traj.error = "; ".join(f"tool_infrastructure: {r.name}: {r.result}" for r in broken)
        elif parsed.final is not None:
            terminated = True
        else:
            obs_messages = [self._no_action_message(parsed)]
            if not errors:
                errors.append("parse_error")
        if terminated and parsed.stop_token is None:
            # the episode ends on a completion cut off before its stop token: truncated, not finished
            # (the cut is already counted once, as the parse error ``truncation``)
            terminated, truncated, limit_hit = False, True, "token_limit"

        obs_ids: list[int] = []
        if not (terminated or truncated):
            if len(traj.turns) >= self.limits.max_turns:
                truncated, limit_hit = True, "turn_limit"
            else:
                obs_messages, obs_ids = self._render_observation(obs_messages, ids, parsed)
                if (
                    len(traj.prompt_ids) + len(traj.response_ids) + len(obs_ids)
                    >= self.limits.max_total_tokens
                ):
                    truncated, obs_ids, limit_hit = True, [], "token_limit"
                else:
                    builder.add_env(obs_ids)
        if terminated or truncated:
            obs_messages = []  # nothing is appended once the episode is over (tool results stay in the turn)
        self._errors.update(errors)
        info: dict[str, Any] = {"turn": len(traj.turns), "errors": errors, "tool_calls": self._tool_calls}
        reward = 0.0
        if terminated or truncated:
            stop_reason = limit_hit or ("answer" if parsed.final is not None else "no_answer")
            reward = await self._finish(terminated, truncated, stop_reason)
            info["trajectory"] = traj
            info["reward_components"] = dict(traj.reward_components)
            info["stop_reason"] = stop_reason
            if traj.reward_error is not None:
                info["reward_error"] = traj.reward_error
                errors.append("reward_error")
            if limit_hit == INFRASTRUCTURE:
                info["infrastructure_error"] = traj.error
        obs: Observation = {"tokens": as_token_array(obs_ids), "messages": tuple(obs_messages)}
        return obs, reward, terminated, truncated, info

    async def episode_capacity(self, wanted: int | None = None) -> int | None:
        """How many episodes of this env (together with every env sharing its tools' backends) can run at once:
        the least :meth:`~agentrl.envs.tools.StatefulTool.session_capacity` of its stateful tools (an episode
        holds one session of each), or None: no limit. Collectors keep their episodes in flight within it.
        ``wanted``: the episodes the caller would run at once; each stateful tool is first asked to admit that
        many (:meth:`~agentrl.envs.tools.StatefulTool.request_sessions`)."""
        tools = [t for t in self.toolbox.tools.values() if isinstance(t, StatefulTool)]
        if wanted is not None:
            for tool in tools:
                await tool.request_sessions(wanted)
        capacities = [c for c in [await t.session_capacity() for t in tools] if c is not None]
        return min(capacities) if capacities else None

    async def release_sessions(self) -> None:
        """End the current episode's tool sessions now (they are created again on the next tool call). Every
        path that ends an episode calls it: its end, a limit, an error, a cancellation."""
        await self._sessions.release_all()

    async def aclose(self) -> None:
        """Release tool sessions, the tools' resources and the env's own (:meth:`aclose_resources`).
        Idempotent; the env cannot be used afterwards. Raises what a tool's cleanup raises."""
        if self._closed:
            return
        self._closed = True
        await self._sessions.release_all()
        await self.toolbox.aclose()
        await self.aclose_resources()

    async def aclose_resources(self) -> None:  # noqa: B027 - optional hook
        """Subclass hook: free env-owned resources (services, indexes). Called once by :meth:`aclose`."""

    # ----------------------------------------------------------------- sync API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:  # type: ignore[override]
        """Blocking :meth:`areset` (same arguments, returns and errors) on the env's private event loop;
        raises ``RuntimeError`` inside a running event loop (use ``await env.areset(...)`` there)."""
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action: ActionLike) -> tuple[Observation, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        """Blocking :meth:`astep` (same argument, returns and errors) on the env's private event loop;
        raises ``RuntimeError`` inside a running event loop (use ``await env.astep(...)`` there)."""
        return self._run(self.astep(action))

    def close(self) -> None:
        """Release everything. Idempotent; safe to call on a closed env."""
        if self._closed:
            return
        if _running_loop() is not None:
            if self._loop is None:  # async user: schedule cleanup on their loop
                asyncio.get_running_loop().create_task(self.aclose())
                return
        loop = self._loop or asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.aclose())
        finally:
            loop.close()
            self._loop = None
        super().close()

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.trajectory is None:
            return None
        return self.format.decode(self.trajectory.prompt_ids + self.trajectory.response_ids)

    # ----------------------------------------------------------------- internals
    def _run(self, coro: Any) -> Any:
        if _running_loop() is not None:
            coro.close()
            raise RuntimeError(
                f"{type(self).__name__}.reset()/step() were called inside a running event loop; "
                "use `await env.areset(...)` / `await env.astep(...)` there"
            )
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new env")

    def _action_ids(self, action: ActionLike) -> tuple[list[int], list[float] | None]:
        logprobs = None
        if isinstance(action, str):
            ids = encode_action_text(self.format, action)
        elif hasattr(action, "token_ids"):
            ids = [int(t) for t in action.token_ids]
            logprobs = getattr(action, "logprobs", None)
        elif isinstance(action, np.ndarray):
            ids = action.astype(np.int64).reshape(-1).tolist()
        elif isinstance(action, Sequence):
            ids = [int(t) for t in action]
        else:
            raise TypeError(
                f"an action must be token ids, a str, or an object with .token_ids/.logprobs; got {type(action).__name__}"
            )
        if logprobs is None:
            return ids, None
        logprobs = [float(x) for x in logprobs]
        if len(logprobs) != len(ids):
            raise ValueError(
                f"action has {len(ids)} token ids but {len(logprobs)} log-probs; they must match"
            )
        return ids, logprobs

    def _parse(self, ids: list[int]) -> ParsedTurn:
        try:
            return self.format.parse(ids)
        except Exception as e:  # noqa: BLE001 - the format promises not to raise; be safe anyway
            return ParsedTurn(errors=[ParseError(ParseErrorKind.MALFORMED, f"{type(e).__name__}: {e}")])

    def _render_observation(
        self, messages: list[Message], completion: list[int], parsed: ParsedTurn
    ) -> tuple[list[Message], list[int]]:
        """Render ``messages`` after ``completion``. If the format rejects them (e.g. a model-chosen recipient
        it cannot write back), the same text is rendered as a plain user note instead."""
        try:
            ids = self._render(messages, completion)
        except (ValueError, RuntimeError):
            messages = [Message(role="user", content="\n\n".join(m.content for m in messages))]
            ids = self._render(messages, completion)
        if self._obs_takes_history:
            self._history.extend([*parsed.messages, *messages])
        return messages, ids

    def _render(self, messages: list[Message], completion: list[int]) -> list[int]:
        if self._obs_takes_history:
            return self.format.render_observation(messages, completion_ids=completion, history=self._history)
        return self.format.render_observation(messages, completion_ids=completion)

    @staticmethod
    def _tool_message(recipient: str, rec: ToolRecord) -> Message:
        return Message(
            role="tool", content=rec.result, name=recipient, recipient="assistant", channel="commentary"
        )

    def _no_action_message(self, parsed: ParsedTurn) -> Message:
        """The error observation for an action with neither a usable tool call nor a final answer. A rejected
        call (bad JSON, wrong channel) is answered by the addressed tool; anything else by a user note."""
        why = (
            "; ".join(e.message for e in parsed.errors)
            or "it contained neither a tool call nor a final answer"
        )
        last = parsed.messages[-1] if parsed.messages else None
        if last is not None and last.recipient and parsed.errors:
            return Message(
                role="tool",
                content=f"Error: {why}",
                name=last.recipient,
                recipient="assistant",
                channel="commentary",
            )
        tools = ", ".join(s.recipient for s in self.toolbox.specs)
        hint = f"call a tool ({tools}) or give your final answer" if tools else "give your final answer"
        return Message(
            role="user", content=f"[env] Your last message could not be used: {why}. Please {hint}."
        )

    async def _finish(self, terminated: bool, truncated: bool, stop_reason: str) -> float:
        traj = self.trajectory
        assert traj is not None and self.task is not None
        self._done = True
        traj.terminated, traj.truncated = terminated, truncated
        traj.stop_reason = stop_reason
        traj.errors = dict(self._errors)
        if stop_reason == INFRASTRUCTURE:  # not the model's episode to score
            traj.reward, traj.reward_components = 0.0, {}
            await self._sessions.release_all()
            return 0.0
        final = traj.final_answer
        ctx = RewardContext(
            task=self.task,
            final=final,
            messages=[m for t in traj.turns for m in t.parsed.messages],
            trajectory=traj,
            truncated=truncated,
        )
        try:
            total, components = self.reward(ctx)
            traj.reward = float(total)
            traj.reward_components = {k: float(v) for k, v in components.items()}
        except Exception as exc:  # noqa: BLE001 - a broken reward is the episode's error, never the caller's crash
            self._record_reward_error(exc)
        finally:
            await self._sessions.release_all()
        return traj.reward

    def _record_reward_error(self, exc: Exception) -> None:
        """The reward function raised: score 0, record the error on the finished trajectory
        (``reward_error``, one ``reward_error`` in ``errors``) and warn once per message."""
        traj = self.trajectory
        assert traj is not None
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        message = f"{type(exc).__name__}: {exc}" + (f" (at {where.filename}:{where.lineno} in {where.name})" if where else "")
        traj.reward, traj.reward_components = 0.0, {}
        traj.reward_error = message
        self._errors["reward_error"] += 1
        traj.errors = dict(self._errors)
        with contextlib.suppress(Warning):  # even under -W error the step returns; the trajectory records it
            warnings.warn(
                f"the reward of {type(self).__name__} raised {message}; the episode is scored 0, kept, and counted as "
                "a reward_error (trajectory.reward_error). Fix the reward function.",
                RewardErrorWarning,
                stacklevel=2,
            )


def encode_action_text(fmt: ChatFormat, text: str) -> list[int]:
    """Encode a text action, turning special-token text (``<|call|>``, ``<|im_end|>``...) into the special ids.

    Uses ``fmt.encode(text, allow_special=True)`` when the format supports it, else the openai-harmony
    encoding of a HarmonyFormat (``allowed_special="all"``), else a HF tokenizer's default (which already
    maps added special tokens), else plain ``fmt.encode``.
    """
    try:
        return list(fmt.encode(text, allow_special=True))  # type: ignore[call-arg]
    except TypeError:
        pass
    encoding = getattr(fmt, "encoding", None)
    if encoding is not None and hasattr(encoding, "special_tokens_set"):
        return list(encoding.encode(text, allowed_special="all"))
    tokenizer = getattr(fmt, "tokenizer", None)
    if tokenizer is not None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(fmt.encode(text))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
