"""``TrajectoryBuilder``: assemble token-exact trajectories from model completions and env observations.

The builder never re-tokenises: the model's sampled ids are appended verbatim (loss mask 1, their rollout
log-probs) and the env's ids after them (mask 0, log-prob 0.0). ``context_ids`` is always exactly what the
engine must be given for the next completion, so training sees the stream the model conditioned on.

Harmony boundary rules (checked on every call; a violation raises ``ValueError`` naming the fix):

- a completion starts right after ``<|start|>assistant`` (the prompt's or the last observation's end);
- after ``<|call|>`` the env answers with whole messages (``<|start|>functions.x to=assistant...<|end|>``,
  then ``<|start|>assistant``), which extends the stream in place;
- after ``<|end|>`` (the engine stopped at an analysis/commentary message) the env appends
  ``<|start|>assistant`` or more messages; the stream is extended in place;
- after a completion with no terminator (truncation) the observation must start with ``<|end|>``
  (:meth:`HarmonyFormat.render_observation` adds it) so the stream stays well formed;
- after ``<|return|>`` the assistant's turn is over. The official renderer writes a past final message with
  ``<|end|>``, but a sampled token is never rewritten in place: continuing the conversation (a new user
  message) starts a new *segment* whose prompt is the stream so far with that ``<|return|>`` written as
  ``<|end|>`` (and analysis dropped when ``analysis="drop"``). The sampled ``<|return|>`` stays, trained,
  at the end of the previous segment.

Analysis policy (what the model sees of its earlier chain-of-thought):

- ``"keep"``: nothing is removed. Within a segment the stream only grows; each context equals openai-harmony's
  ``render_conversation_for_completion(..., auto_drop_analysis=False)`` of the conversation so far, and the
  whole conversation equals ``render_conversation_for_training(..., auto_drop_analysis=False)``.
- ``"drop"``: the official rule (``auto_drop_analysis=True``): while the last assistant message is a final
  answer, assistant analysis messages before the first final message are left out of the prompt (their
  tokens, exactly; other messages stay as sampled). Each context equals openai-harmony's
  ``render_conversation_for_completion(..., auto_drop_analysis=True)`` of the conversation so far whenever
  the model wrote canonical headers. The official rule is not append-only: the prompt right after a final
  answer lacks the old analysis, but once the next turn makes a tool call (the last assistant message is
  no longer final) the official renderer shows that analysis again. Each such change starts a new segment.
  Tool-call chains inside one user turn are unaffected, so single-user-turn episodes are one segment under
  either policy.

Appending a turn costs O(new tokens): lists are extended in place and only the new ids are parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from agentrl.harmony.format import ChatFormat
from agentrl.harmony.trajectory import NOT_SAMPLED, ToolRecord, Trajectory, TurnRecord
from agentrl.harmony.types import ParsedTurn, ToolSpec

AnalysisPolicy = Literal["keep", "drop"]


class TrajectoryBuilder:
    """Builds one episode's trajectory segments.

    - ``fmt``: the ChatFormat that rendered ``prompt_ids`` and parses completions.
    - ``prompt_ids``: the rendered prompt (ends with the assistant header).
    - ``analysis``: ``"keep"`` or ``"drop"`` (see the module docstring); Harmony only.
    - ``tools``: declared tools, passed to ``fmt.parse`` so unknown recipients are flagged.
    - ``episode``: ``True`` for one env episode (what :class:`~agentrl.envs.AgentEnv` builds): it stays one
      trajectory, every observation extending the stream in place (an env episode is one user turn, so under
      ``"keep"`` this only differs after a ``<|return|>`` that did not end the episode, which stays in the
      model's context as sampled), and an empty completion is recorded as an empty model turn (its parse says
      so) instead of raising, since bad model output never raises in an env.
    - ``metadata``: user extras copied to every segment.

    Use: ``add_model(ids, logprobs)`` for each completion, ``add_tools(records)`` for the tool calls it made,
    ``add_env(obs_ids)`` for each observation, ``context_ids`` for the next engine call, ``finish(...)`` for
    the trajectories.
    """

    def __init__(
        self,
        fmt: ChatFormat,
        prompt_ids: Sequence[int],
        *,
        analysis: AnalysisPolicy = "keep",
        tools: Sequence[ToolSpec] | None = None,
        episode: bool = False,
        metadata: dict[str, Any] | None = None,
    ):
        if analysis not in ("keep", "drop"):
            raise ValueError(f"analysis must be 'keep' or 'drop', got {analysis!r}")
        self.fmt = fmt
        self.analysis: AnalysisPolicy = analysis
        self.tools = list(tools) if tools is not None else None
        self.episode = episode
        self._harmony = getattr(fmt, "tokens", None) if fmt.name == "harmony" else None
        self._header = list(getattr(fmt, "assistant_header_ids", []))
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty; render it with fmt.render_prompt(...)")
        if self._harmony is not None and prompt[-len(self._header) :] != self._header:
            raise ValueError(
                "a Harmony prompt must end with <|start|>assistant; render it with fmt.render_prompt"
            )
        self.metadata = dict(metadata or {})
        self.segments: list[Trajectory] = [Trajectory(prompt_ids=prompt, metadata=dict(self.metadata))]
        self._logprobs_missing = False
        self._versions_missing = False
        self._last_empty = False
        self._last_parsed: ParsedTurn | None = None
        self._expect_model = True
        # The conversation as sampled (past finals written with <|end|>), never with analysis dropped; the
        # official context is a function of it. ``_diverged``: the current segment dropped something from it.
        self._full: list[int] = list(prompt)
        self._diverged = False

    # -- state -----------------------------------------------------------------------------------------
    @property
    def trajectory(self) -> Trajectory:
        """The current (last) segment."""
        return self.segments[-1]

    @property
    def context_ids(self) -> list[int]:
        """``prompt_ids + response_ids`` of the current segment: the exact ids for the next engine call."""
        t = self.trajectory
        return t.prompt_ids + t.response_ids

    def _last_token(self) -> int:
        t = self.trajectory
        return t.response_ids[-1] if t.response_ids else t.prompt_ids[-1]

    # -- appending -------------------------------------------------------------------------------------
    def add_model(
        self,
        completion_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        *,
        parsed: ParsedTurn | None = None,
        versions: Sequence[int] | None = None,
    ) -> ParsedTurn:
        """Append the ids the model sampled (mask 1) with their log-probs (natural log, one per id; ``None``
        stores 0.0 and sets ``logprobs_missing``). ``versions``: the policy version that sampled each id
        (``Completion.policy_versions``); the trajectory's ``token_versions`` are kept only while every completion
        of the conversation carried them (else ``None``). Returns the parse (``parsed`` if given)."""
        ids = [int(t) for t in completion_ids]
        if not ids and not self.episode:
            raise ValueError("completion_ids is empty: the engine returned no tokens")
        if not self._expect_model:
            raise ValueError(
                "two completions in a row: append the env's observation first (fmt.render_observation([...]) "
                "adds the next assistant header)"
            )
        if self._header and self._full[-len(self._header) :] != self._header:
            raise ValueError(
                "the context does not end with the assistant header; append an observation first"
            )
        if logprobs is None:
            lps = [0.0] * len(ids)
            self._logprobs_missing = self.trajectory.logprobs_missing = True
        else:
            lps = [float(x) for x in logprobs]
            if len(lps) != len(ids):
                raise ValueError(
                    f"got {len(lps)} log-probs for {len(ids)} completion ids; they must match 1:1"
                )
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"got {len(versions)} policy versions for {len(ids)} completion ids; they must match 1:1")
        if parsed is None:
            parsed = self.fmt.parse(ids, tools=self.tools) if self.tools is not None else self.fmt.parse(ids)
        t = self.trajectory
        self._record_versions(t, versions)
        start = len(t.response_ids)
        t.response_ids.extend(ids)
        t.response_mask.extend([1] * len(ids))
        t.rollout_logprobs.extend(lps)
        self._full.extend(ids)
        end = len(t.response_ids)
        t.turns.append(TurnRecord(model_span=(start, end), env_span=(end, end), parsed=parsed))
        self._last_parsed = parsed
        self._last_empty = not ids
        self._expect_model = False
        return parsed

    def _record_versions(self, t: Trajectory, versions: Sequence[int] | None) -> None:
        """Extend ``t.token_versions`` by ``versions`` (env tokens so far: :data:`NOT_SAMPLED`); a completion
        without versions drops them for the whole conversation."""
        if versions is None or self._versions_missing:
            self._versions_missing = True
            for segment in self.segments:
                segment.token_versions = None
            return
        if t.token_versions is None:
            t.token_versions = [NOT_SAMPLED] * len(t.response_ids)
        t.token_versions.extend(int(v) for v in versions)

    def add_tools(self, records: Sequence[ToolRecord]) -> None:
        """Attach the tool calls of the last completion (their records) to its turn."""
        if self.trajectory.turns:
            self.trajectory.turns[-1].tools.extend(records)

    def add_env(self, observation_ids: Sequence[int], tools: Sequence[ToolRecord] = ()) -> None:
        """Append the env's ids (mask 0, log-prob 0.0) and attach ``tools`` to the last turn record.

        May start a new segment (after a final answer; see the module docstring)."""
        obs = [int(t) for t in observation_ids]
        if not obs:
            raise ValueError(
                "observation_ids is empty; use fmt.render_observation([...], completion_ids=...)"
            )
        if self._expect_model:
            raise ValueError("add_env before any completion of this turn: call add_model first")
        if self._harmony is not None:
            self._check_harmony_boundary(obs)
        t = self.trajectory
        self.add_tools(tools)
        new_prompt = self._official_context() if self._harmony is not None and not self.episode else None
        self._full.extend(obs)
        if new_prompt is None:
            start = len(t.response_ids)
            t.response_ids.extend(obs)
            t.response_mask.extend([0] * len(obs))
            t.rollout_logprobs.extend([0.0] * len(obs))
            if t.token_versions is not None:
                t.token_versions.extend([NOT_SAMPLED] * len(obs))
            if t.turns:
                t.turns[-1].env_span = (start, len(t.response_ids))
        else:
            segment = Trajectory(prompt_ids=new_prompt + obs, segment=len(self.segments), metadata=dict(self.metadata))
            segment.logprobs_missing = self._logprobs_missing
            self.segments.append(segment)
            self._diverged = len(new_prompt) + len(obs) != len(self._full)
        self._expect_model = True

    def _check_harmony_boundary(self, obs: list[int]) -> None:
        tk = self._harmony
        last = self._last_token()
        if self._last_empty:  # nothing was sampled (an env episode's empty action): nothing to close
            pass
        elif last not in (tk.end, tk.call, tk.return_):
            if obs[0] != tk.end:
                raise ValueError(
                    "the completion was truncated (no <|end|>/<|call|>/<|return|>), so the observation must start "
                    "with <|end|>; build it with fmt.render_observation(..., completion_ids=completion)"
                )
        elif obs[0] != tk.start:
            raise ValueError("after a complete message the observation must start with <|start|>")
        if obs[-len(self._header) :] != self._header:
            raise ValueError("the observation must end with <|start|>assistant so the model can continue")

    def _official_context(self) -> list[int] | None:
        """The context the official renderer would give before the observation, or None when that is the
        current stream (extend in place). Costs O(total) only at final answers and after a dropped turn."""
        tk = self._harmony
        full = self._full
        swapped = full[-1] == tk.return_
        if swapped:
            full[-1] = tk.end  # a past final message is written with <|end|>
        parsed = self._last_parsed
        ended_final = bool(parsed and parsed.messages and parsed.messages[-1].channel == "final")
        if self.analysis == "drop" and ended_final:
            ctx = drop_analysis_before_first_final(full, self.fmt)
        elif swapped or self._diverged:
            ctx = list(full)
        else:
            return None
        return None if ctx == self.context_ids else ctx

    # -- result ----------------------------------------------------------------------------------------
    def finish(
        self,
        *,
        reward: float = 0.0,
        reward_components: dict[str, float] | None = None,
        terminated: bool = False,
        truncated: bool = False,
    ) -> list[Trajectory]:
        """The episode's segments (usually one), each validated and carrying the episode's reward, flags and
        ``num_segments``."""
        for seg in self.segments:
            seg.reward = float(reward)
            seg.reward_components = dict(reward_components or {})
            seg.terminated = terminated
            seg.truncated = truncated
            seg.num_segments = len(self.segments)
            seg.validate()
        return list(self.segments)


def drop_analysis_before_first_final(ids: Sequence[int], fmt) -> list[int]:
    """Remove, token-exactly, every message in the ``analysis`` channel (any role: the python tool's calls and
    results live there too) that comes before the first ``final`` message, as openai-harmony's
    ``auto_drop_analysis`` does. ``fmt``: a HarmonyFormat."""
    tk = fmt.tokens
    units: list[tuple[int, int, str | None]] = []  # (start, end_exclusive, channel)
    i, n = 0, len(ids)
    while i < n:
        if ids[i] != tk.start:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] != tk.message and ids[j] != tk.start:
            j += 1
        if j >= n or ids[j] != tk.message:
            i = j
            continue
        channel = _header_channel(ids[i + 1 : j], fmt)
        k = j + 1
        while k < n and ids[k] not in (tk.end, tk.call, tk.return_):
            k += 1
        units.append((i, min(k + 1, n), channel))
        i = k + 1
    first_final = next((u[0] for u in units if u[2] == "final"), None)
    if first_final is None:
        return list(ids)
    out: list[int] = []
    pos = 0
    for start, end, channel in units:
        if start < first_final and channel == "analysis":
            out.extend(ids[pos:start])
            pos = end
    out.extend(ids[pos:])
    return out


def _header_channel(header_ids: Sequence[int], fmt) -> str | None:
    """The channel named after the header's ``<|channel|>`` token (up to whitespace or a special), or None."""
    tk = fmt.tokens
    for pos, tok in enumerate(header_ids):
        if tok == tk.channel:
            rest: list[int] = []
            for t in header_ids[pos + 1 :]:
                if t >= tk.first_special:
                    break
                rest.append(t)
            words = fmt.decode(rest).split()
            return words[0] if words else None
    return None
