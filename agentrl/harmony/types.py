"""Core data types shared by every layer: messages, tool calls, parse results, tool specs.

These are plain dataclasses with no dependency beyond the standard library, so product code, envs,
the trainer and the verl adapter all speak the same language. Token ids are ``int``; log-probs are
natural-log floats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

Role = str  # "system" | "developer" | "user" | "assistant" | "tool"


class PlainRecord:
    """``to_dict`` / ``from_dict`` of a dataclass whose fields are JSON values."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return cls(**data)


@dataclass
class Message(PlainRecord):
    """One conversation message, Harmony-shaped but format-neutral.

    - ``role``: who wrote it. Tool outputs use role ``"tool"`` and ``name`` = the tool's recipient
      name (``"functions.lookup"`` or ``"python"``).
    - ``channel``: Harmony channel (``"analysis"``, ``"commentary"``, ``"final"``) or ``None`` for
      formats without channels.
    - ``recipient``: for assistant tool calls, the addressed tool (``"functions.lookup"``,
      ``"python"``); for tool outputs, ``"assistant"``.
    - ``content_type``: e.g. ``"json"`` (Harmony ``<|constrain|>json``) or ``"code"``; ``None`` if unset.
    """

    role: Role
    content: str
    channel: str | None = None
    recipient: str | None = None
    name: str | None = None
    content_type: str | None = None


@dataclass
class ToolCall(PlainRecord):
    """A tool call the model made.

    ``recipient`` is the full address (``"functions.lookup"``, ``"python"``); ``name`` is the tool
    name the env dispatches on (``"lookup"``, ``"python"``). ``arguments`` is the decoded JSON object
    (or ``{"code": ...}`` for the free-text python tool); ``raw_arguments`` is the exact text emitted.
    """

    recipient: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str
    channel: str | None = None
    call_id: str | None = None


class ParseErrorKind(str, Enum):
    """Why a completion could not be parsed cleanly. Values are stable strings used in metrics."""

    NO_HEADER = "no_header"
    BAD_JSON = "bad_json"
    UNKNOWN_RECIPIENT = "unknown_recipient"
    TRUNCATED = "truncated"
    STRAY_SPECIAL = "stray_special"
    CALL_IN_ANALYSIS = "call_in_analysis"
    EMPTY = "empty"
    MALFORMED = "malformed"


@dataclass
class ParseError:
    """A structured parse problem, returned as data (never raised).

    ``token_index`` is the offset in the completion where the problem was detected, if known.
    """

    kind: ParseErrorKind
    message: str
    token_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "message": self.message, "token_index": self.token_index}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParseError:
        return cls(ParseErrorKind(data["kind"]), data["message"], data.get("token_index"))


@dataclass
class ParsedTurn:
    """The result of parsing one assistant completion.

    - ``messages``: every assistant message recovered, in order, with channel and recipient.
    - ``tool_calls``: the calls to dispatch (usually 0 or 1 for Harmony, possibly several for Hermes).
    - ``final``: text of the final answer if the turn produced one, else ``None``.
    - ``stop_token``: id of the token that ended the completion (``<|call|>``, ``<|return|>``,
      ``<|end|>``, eos), or ``None`` when generation stopped without one (truncation).
    - ``errors``: structured problems; an empty list means a clean parse.
    """

    messages: list[Message] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    final: str | None = None
    stop_token: int | None = None
    errors: list[ParseError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": [m.to_dict() for m in self.messages],
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "final": self.final,
            "stop_token": self.stop_token,
            "errors": [e.to_dict() for e in self.errors],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParsedTurn:
        return cls(
            messages=[Message.from_dict(m) for m in data["messages"]],
            tool_calls=[ToolCall.from_dict(c) for c in data["tool_calls"]],
            final=data.get("final"),
            stop_token=data.get("stop_token"),
            errors=[ParseError.from_dict(e) for e in data["errors"]],
        )


@dataclass
class ToolSpec(PlainRecord):
    """What the model is told about a tool: its name, description and JSON-schema parameters.

    ``namespace`` is ``"functions"`` for ordinary function tools; the built-in Harmony python tool
    uses ``namespace="python"`` and free-text (code) arguments.
    """

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    namespace: str = "functions"

    @property
    def recipient(self) -> str:
        return self.name if self.namespace == self.name else f"{self.namespace}.{self.name}"
