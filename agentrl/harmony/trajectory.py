"""Token-in-token-out trajectories: the exact token stream a model emitted plus the env's tokens, as one typed,
versioned record.

The token fields mirror verl's ``AgentLoopOutput`` (prompt_ids, response_ids, response_mask,
response_logprobs, reward, num_turns) so the verl adapter stays thin. Every other field that some layer of
agentrl writes or reads is typed here (which env and task, which sample of which group, the weights and
sampling that produced it, how it ended, its error taxonomy, the trainer's own log-probs); ``metadata`` is
left for the user's extras and is never read by agentrl.

Invariants (checked by :meth:`Trajectory.validate`):
- ``len(response_ids) == len(response_mask) == len(rollout_logprobs)`` (and ``len(train_logprobs)`` and
  ``len(token_versions)`` when set);
- ``response_mask[i] == 1`` exactly for tokens the model sampled; env tokens have mask 0 and
  log-prob 0.0;
- tokens are never re-tokenised: ``prompt_ids + response_ids`` is the stream the model conditioned on.

JSONL schema: :meth:`Trajectory.to_dict` writes ``"schema": SCHEMA_VERSION`` first. :meth:`Trajectory.from_dict`
reads that version and every older one: schema 1 (no ``schema`` key; agentrl up to the typed record) kept
these fields in ``metadata`` under other names, which are moved to the typed fields (see :data:`_V1_KEYS`);
schema 2 had no per-token ``token_versions`` (read as ``None``: :meth:`Trajectory.versions` then gives every model
token the record's ``policy_version``). A newer schema raises ``ValueError`` saying to upgrade agentrl.

The error taxonomy (:data:`ERROR_KINDS`), what counts as a correct episode (:attr:`Trajectory.correct`) and
the tool statistics (:attr:`Trajectory.tool_calls`, :attr:`Trajectory.tool_errors`) are defined here, once,
for the env that records them, the trainer, ``agentrl eval`` and the viewer.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from agentrl.harmony.types import ParsedTurn, ParseErrorKind, PlainRecord

SCHEMA_VERSION = 3
"""The JSONL schema :meth:`Trajectory.to_dict` writes (1: the untyped record, metadata only; 2: the typed record
without ``token_versions``)."""

#: The ``token_versions`` entry of a token the model did not sample (an env token).
NOT_SAMPLED = -1

#: The error taxonomy: every error an episode records is one of these (a tool's ``ToolOutput(error=...)`` of
#: another name keeps that name). ``tool_exception`` and ``tool_timeout`` are the model's (its call failed or ran
#: too long); ``tool_infrastructure`` is not: the tool's backend failed (a sandbox pool that admits no session,
#: a lost worker, a server that does not answer), and the episode ends at once with ``stop_reason``
#: ``"infrastructure"``, unscored (see :attr:`Trajectory.infrastructure_error`).
ERROR_KINDS = (
    "parse_error", "unknown_tool", "bad_arguments", "tool_timeout", "tool_exception", "tool_infrastructure",
    "truncation", "reward_error",
)

#: The stop reason of an episode ended by a ``tool_infrastructure`` error.
INFRASTRUCTURE = "infrastructure"

#: Parse-error kinds with a more specific taxonomy entry (the other kinds are ``parse_error``).
_PARSE_KINDS = {
    ParseErrorKind.TRUNCATED: "truncation",
    ParseErrorKind.BAD_JSON: "bad_arguments",
    ParseErrorKind.UNKNOWN_RECIPIENT: "unknown_tool",
}


def parse_error_kind(kind: ParseErrorKind | str) -> str:
    """The taxonomy entry (:data:`ERROR_KINDS`) of a parse error of ``kind``."""
    try:
        return _PARSE_KINDS.get(ParseErrorKind(kind), "parse_error")
    except ValueError:
        return "parse_error"


@dataclass
class ToolRecord(PlainRecord):
    """One tool invocation as it happened: what was asked, what came back, how long, which error
    (``None`` or a taxonomy kind: ``unknown_tool``, ``bad_arguments``, ``tool_timeout``, ``tool_exception``,
    ``tool_infrastructure``, or a tool's own kind)."""

    name: str
    arguments: Any
    result: str
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class TurnRecord:
    """One model action and the env's answer to it.

    ``model_span`` and ``env_span`` are ``(start, end)`` offsets into ``response_ids``.
    """

    model_span: tuple[int, int]
    env_span: tuple[int, int]
    parsed: ParsedTurn
    tools: list[ToolRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_span": list(self.model_span),
            "env_span": list(self.env_span),
            "parsed": self.parsed.to_dict(),
            "tools": [t.to_dict() for t in self.tools],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        return cls(
            model_span=tuple(data["model_span"]),
            env_span=tuple(data["env_span"]),
            parsed=ParsedTurn.from_dict(data["parsed"]),
            tools=[ToolRecord.from_dict(t) for t in data["tools"]],
        )


@dataclass
class SamplingRecord(PlainRecord):
    """The sampling parameters the model's actions were drawn with (``None``: not known or the engine's
    default). ``temperature`` 0 means greedy; ``top_k`` 0 means no top-k cut."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None

    @classmethod
    def of(cls, params: Any) -> SamplingRecord:
        """The record of an engine's ``SamplingParams`` (or any object or dict with these names;
        ``max_completion_tokens`` or ``max_tokens`` stand for ``max_new_tokens``)."""
        get = params.get if isinstance(params, dict) else lambda k, d=None: getattr(params, k, d)
        limit = get("max_new_tokens", None)
        if limit is None:
            limit = get("max_completion_tokens", None) or get("max_tokens", None)
        return cls(get("temperature", None), get("top_p", None), get("top_k", None), limit, get("seed", None))


@dataclass
class Trajectory:
    """A whole episode, token-exact, with what produced it. Serialises losslessly to one JSON line.

    Tokens and outcome: ``prompt_ids``, ``response_ids``, ``response_mask``, ``rollout_logprobs`` (the
    sampler's natural-log probabilities; 0.0 on env tokens), ``reward`` and ``reward_components``, ``turns``,
    ``terminated`` / ``truncated`` (gymnasium's), ``stop_reason`` (why it ended: ``answer``, ``no_answer``,
    ``tool_limit``, ``turn_limit``, ``token_limit``, ``time_limit``, ``error``, ``infrastructure``), ``errors`` (the
    env's count per :data:`ERROR_KINDS` entry), ``error`` (the exception that ended the episode, ``"Type: message"``,
    or the tool backend's failure that did: see :attr:`infrastructure_error`),
    ``reward_error`` (the exception the env's reward function raised: the episode finished, scored 0).

    Provenance: ``env`` (the registered env name), ``task`` and ``task_id``, ``group`` (the id shared by the
    samples of one task: a GRPO group, verl's prompt uid), ``sample`` (which sample of its task),
    ``policy_version`` (the weights that sampled it: the trainer step whose update they follow, verl's
    ``global_steps``), ``sampling``, ``model`` (what acted: a model name, a run directory, an endpoint, a
    teacher), ``api`` (``completions`` or ``chat`` for endpoint episodes), ``requests``, ``latency_s`` and
    ``usage`` (token counts an API reported), ``logprobs_missing`` (some model tokens have no sampled
    log-prob; their 0.0 is a placeholder), ``segment`` / ``num_segments`` (a conversation the builder split).

    Per-token provenance of the model tokens (asynchronous rollouts, where an episode runs across weight
    updates): ``rollout_logprobs`` (the behaviour log-prob), ``token_versions`` (the policy version whose weights
    computed the logits each token was sampled from; :data:`NOT_SAMPLED` on env tokens; ``None`` when not
    recorded, see :meth:`versions`) and, for MoE models, the routing the episode runner returns with the episode
    (``EpisodeResult.routing``). ``policy_version`` is then the version the episode started with, the oldest of
    its tokens' versions.

    Training: ``train_logprobs``, one per response token, the trainer's log-probs of the sampled tokens under
    the weights that sampled them (the old-policy log-probs of the update; 0.0 on env tokens), ``None`` for an
    episode that was not trained on.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    stop_reason: str | None = None
    errors: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    reward_error: str | None = None
    env: str | None = None
    task: dict[str, Any] | None = None
    task_id: str | None = None
    group: str | None = None
    sample: int | None = None
    policy_version: int | None = None
    sampling: SamplingRecord | None = None
    model: str | None = None
    api: str | None = None
    requests: int | None = None
    latency_s: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    logprobs_missing: bool = False
    segment: int = 0
    num_segments: int = 1
    train_logprobs: list[float] | None = None
    token_versions: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def final_answer(self) -> str | None:
        """The last final answer the model gave (``parsed.final`` of the latest turn that has one), or None."""
        return next((t.parsed.final for t in reversed(self.turns) if t.parsed.final is not None), None)

    @property
    def correct(self) -> bool:
        """Whether the episode solved its task: its ``correct`` reward component is 1 when it has one, else its
        reward is at least 1. The one definition of correctness (pass@k, SFT filters, reports)."""
        score = self.reward_components.get("correct", self.reward)
        return float(score) >= 1.0

    @property
    def infrastructure_error(self) -> str | None:
        """The failure of a tool's backend that ended the episode (``stop_reason == "infrastructure"``), or None.
        Such an episode is not the model's doing: it has no reward, is never trained on and is no evaluation's
        wrong answer (it is retried, else left out and counted)."""
        if self.stop_reason != INFRASTRUCTURE:
            return None
        return self.error or "tool_infrastructure"

    @property
    def tool_calls(self) -> int:
        """Tool calls the env ran (one record each, failed ones included)."""
        return sum(len(t.tools) for t in self.turns)

    @property
    def tool_errors(self) -> int:
        """Tool calls whose record carries an error kind (a python exception inside sandboxed code is the
        code's result, not a tool error)."""
        return sum(1 for t in self.turns for rec in t.tools if rec.error)

    def versions(self) -> list[int | None]:
        """The policy version of each response token: ``token_versions`` when recorded, else ``policy_version``
        for every model token (a record of schema 2 or older, or one sampled without updates in flight); ``None``
        for env tokens and where nothing is known."""
        if self.token_versions is not None:
            return [v if m else None for v, m in zip(self.token_versions, self.response_mask, strict=True)]
        return [self.policy_version if m else None for m in self.response_mask]

    def error_counts(self) -> Counter[str]:
        """The episode's errors per taxonomy kind: the env's own count (``errors``) or, for a trajectory
        without one, recounted from the turns (a parse error per :func:`parse_error_kind`, one per failed
        tool call). An episode cut by a limit (``truncated``, not an infrastructure stop) counts one ``truncation``
        unless one is there."""
        if self.errors:
            counts: Counter[str] = Counter({k: int(n) for k, n in self.errors.items()})
        else:
            counts = Counter()
            for turn in self.turns:
                counts.update(parse_error_kind(e.kind) for e in turn.parsed.errors)
                counts.update(rec.error for rec in turn.tools if rec.error)
        if self.truncated and self.stop_reason != INFRASTRUCTURE and not counts["truncation"]:
            counts["truncation"] += 1
        return +counts

    def validate(self) -> None:
        """Raise ``ValueError`` naming the broken invariant."""
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory lengths disagree: response_ids={n}, response_mask={len(self.response_mask)}, "
                f"rollout_logprobs={len(self.rollout_logprobs)}"
            )
        if self.train_logprobs is not None and len(self.train_logprobs) != n:
            raise ValueError(f"train_logprobs has {len(self.train_logprobs)} entries for {n} response tokens")
        if any(m not in (0, 1) for m in self.response_mask):
            raise ValueError("response_mask must contain only 0 (env/prompt token) and 1 (model token)")
        if self.token_versions is not None:
            if len(self.token_versions) != n:
                raise ValueError(f"token_versions has {len(self.token_versions)} entries for {n} response tokens")
            if any((v < 0) if m else (v != NOT_SAMPLED) for v, m in zip(self.token_versions, self.response_mask,
                                                                          strict=True)):
                raise ValueError(f"token_versions must be >= 0 on model tokens and {NOT_SAMPLED} on env tokens")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "turns":
                value = [t.to_dict() for t in value]
            elif f.name == "sampling" and value is not None:
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Read any schema up to :data:`SCHEMA_VERSION` (see the module docstring); raises ``ValueError``
        (a newer schema) or ``KeyError`` / ``TypeError`` (not a trajectory)."""
        if not isinstance(data, dict):
            raise TypeError(f"a trajectory is a JSON object, got {type(data).__name__}")
        version = data.get("schema", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(
                f"trajectory schema {version!r} is newer than this agentrl reads (up to {SCHEMA_VERSION}); "
                "upgrade agentrl to read it"
            )
        if version == 1:
            data = _from_v1(data)
        sampling = data.get("sampling")
        train = data.get("train_logprobs")
        versions = data.get("token_versions")
        return cls(
            prompt_ids=list(data["prompt_ids"]),
            response_ids=list(data["response_ids"]),
            response_mask=list(data["response_mask"]),
            rollout_logprobs=[float(x) for x in data["rollout_logprobs"]],
            reward=float(data["reward"]),
            reward_components=dict(data.get("reward_components") or {}),
            turns=[TurnRecord.from_dict(t) for t in data.get("turns") or []],
            terminated=bool(data.get("terminated", False)),
            truncated=bool(data.get("truncated", False)),
            stop_reason=data.get("stop_reason"),
            errors={str(k): int(v) for k, v in (data.get("errors") or {}).items()},
            error=data.get("error"),
            reward_error=data.get("reward_error"),
            env=data.get("env"),
            task=data.get("task"),
            task_id=None if data.get("task_id") is None else str(data["task_id"]),
            group=None if data.get("group") is None else str(data["group"]),
            sample=data.get("sample"),
            policy_version=data.get("policy_version"),
            sampling=None if sampling is None else SamplingRecord.from_dict(sampling),
            model=data.get("model"),
            api=data.get("api"),
            requests=data.get("requests"),
            latency_s=data.get("latency_s"),
            usage=dict(data.get("usage") or {}),
            logprobs_missing=bool(data.get("logprobs_missing", False)),
            segment=int(data.get("segment", 0)),
            num_segments=int(data.get("num_segments", 1)),
            train_logprobs=None if train is None else [float(x) for x in train],
            token_versions=None if versions is None else [int(v) for v in versions],
            metadata=dict(data.get("metadata") or {}),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


#: Schema 1 metadata keys -> the typed field that holds them now (``None``: derived now, dropped on read).
_V1_KEYS: dict[str, str | None] = {
    "env_name": "env",
    "task": "task",
    "task_id": "task_id",
    "item_id": "task_id",
    "group": "group",
    "sample": "sample",
    "global_steps": "policy_version",
    "stop_reason": "stop_reason",
    "errors": "errors",
    "rollout_error": "error",
    "train_logprobs": "train_logprobs",
    "old_logprobs": "train_logprobs",
    "model": "model",
    "api": "api",
    "requests": "requests",
    "latency_s": "latency_s",
    "logprobs_missing": "logprobs_missing",
    "segment": "segment",
    "num_segments": "num_segments",
    "tool_calls": None,
    "correct": None,
    "answer": None,
    "env_s": None,
}


def _from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 record (everything beyond the tokens in ``metadata``) as a schema-2 dict."""
    out = {k: v for k, v in data.items() if k != "metadata"}
    extras: dict[str, Any] = {}
    usage: dict[str, int] = {}
    for key, value in dict(data.get("metadata") or {}).items():
        if key in _V1_KEYS:
            target = _V1_KEYS[key]
            if target is not None and out.get(target) is None:
                out[target] = value
        elif key == "env":  # the env class name (env_name, when present, is the registered name)
            out.setdefault("env_class", value)
        elif key in ("gen_tokens", "prompt_tokens"):
            usage["completion_tokens" if key == "gen_tokens" else "prompt_tokens"] = int(value)
        elif key == "teacher":
            out.setdefault("model", f"teacher {value}")
        else:
            extras[key] = value
    if out.get("env") is None and "env_class" in out:
        out["env"] = out["env_class"]
    out.pop("env_class", None)
    if usage:
        out["usage"] = usage
    out["metadata"] = extras
    return out
