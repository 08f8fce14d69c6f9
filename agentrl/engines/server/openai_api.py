"""The OpenAI wire format of ``agentrl serve model``: pydantic request and response models, and the
translation between OpenAI messages/tools and agentrl's :class:`Message`/:class:`ToolSpec`/:class:`ParsedTurn`.

Requests are validated by the models (a bad field is a 400 naming the field); fields that OpenAI or vLLM
define but this server does not use are accepted and ignored (``extra="allow"``), except those whose
meaning it cannot honour (string ``stop`` sequences, ``echo``, streaming completions, forced
``tool_choice``), which are refused with a clear message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from agentrl.engines.base import Completion, SamplingParams
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.types import Message, ParsedTurn, ToolSpec


class RequestError(ValueError):
    """A client request the server cannot honour (HTTP 400)."""


# ------------------------------------------------------------------ requests

TokenIds = list[StrictInt]


class _Request(BaseModel):
    """Sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    stop_token_ids: TokenIds | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _no_string_stops(cls, value: Any) -> Any:
        if value:
            raise ValueError("string stop sequences are not supported; use stop_token_ids")
        return value

    def sampling(self, default_stop: Sequence[int], default_max: int) -> SamplingParams:
        limit = self.max_tokens
        if isinstance(self, ChatCompletionRequest) and self.max_completion_tokens is not None:
            limit = self.max_completion_tokens
        return SamplingParams(
            max_new_tokens=default_max if limit is None else limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(0, self.top_k),
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids else list(default_stop),
            seed=self.seed,
        )


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is token ids, a batch of them, text, or a list of texts."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    stream: bool = False
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.stream:
            raise ValueError("stream is not supported on /v1/completions (use /v1/chat/completions)")
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] for p in self.prompt)):
            raise ValueError("prompt must not be empty")
        if self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none"] | None = "auto"
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in ("auto", "none", None):
            raise ValueError(f"tool_choice {value!r} is not supported (use 'auto' or 'none')")
        return value


def validation_message(errors: Sequence[dict[str, Any]]) -> str:
    """pydantic's errors as one line that names the field: ``"temperature: Input should be ..."``."""
    parts = []
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        # union branches add the type name to the location; keep the field path
        loc = [x for x in loc if not x.startswith(("list[", "str", "function-", "int", "constrained-"))]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
    return "; ".join(parts)


# ------------------------------------------------------------------ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    logprobs: CompletionLogprobs | None = None
    finish_reason: str
    prompt_token_ids: list[int] | None = None


class _Response(BaseModel):
    """What every completion response carries besides its ``object`` kind and ``choices``."""

    id: str
    created: int
    model: str
    usage: Usage


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: None = None
    top_logprobs: list[Any] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = None


class ServedFormat(BaseModel):
    """What a client needs to talk token ids to this server: the chat format's kind (``harmony`` or
    ``chat_template``), its vocabulary size and stop ids; for ``chat_template`` the tokenizer files
    (``GET /v1/agentrl/format?files=true``) so the client renders prompts with the same template."""

    format: str
    vocab_size: int
    stop_token_ids: list[int]
    options: dict[str, Any] = Field(default_factory=dict)
    tokenizer_files: dict[str, str] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "agentrl"
    agentrl: ServedFormat | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------ translation


def prompt_batch(prompt: str | list[Any], fmt: ChatFormat) -> list[list[int]]:
    """The completions ``prompt`` as a batch of token-id lists; ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        return [fmt.encode(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [fmt.encode(p) for p in prompt]
    batch = [list(prompt)] if all(isinstance(t, int) for t in prompt) else [list(p) for p in prompt]
    for ids in batch:
        bad = [t for t in ids if not 0 <= t < fmt.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {fmt.vocab_size}) of the served "
                f"model (chat format {fmt.name!r}); render prompts with the served format "
                "(GET /v1/agentrl/format; `agentrl eval` does this with format=auto)"
            )
    return batch


def openai_to_messages(messages: Sequence[ChatMessageIn]) -> list[Message]:
    """OpenAI chat messages to :class:`Message` (tool calls -> commentary messages addressed to
    ``functions.<name>``; tool results -> role ``tool`` named after the call they answer)."""
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.role in ("system", "developer", "user"):
            out.append(Message(role=m.role, content=m.text()))
        elif m.role == "assistant":
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                out.append(Message(role="assistant", content=reasoning, channel="analysis"))
            for tc in m.tool_calls or []:
                call_names[tc.id or ""] = tc.function.name
                args = tc.function.arguments
                out.append(
                    Message(
                        role="assistant",
                        content=args if isinstance(args, str) else json.dumps(args),
                        channel="commentary",
                        recipient=f"functions.{tc.function.name}",
                        content_type="json",
                    )
                )
            if m.text():
                out.append(Message(role="assistant", content=m.text(), channel="final"))
        else:  # tool
            name = m.name or call_names.get(m.tool_call_id or "")
            if not name:
                raise RequestError(f"messages[{i}] (tool) answers an unknown tool_call_id {m.tool_call_id!r}")
            out.append(
                Message(
                    role="tool",
                    content=m.text(),
                    name=f"functions.{name}",
                    channel="commentary",
                    recipient="assistant",
                )
            )
    return out


def openai_to_tools(tools: Sequence[ToolDef] | None) -> list[ToolSpec]:
    """OpenAI ``tools`` (``type: function``) to :class:`ToolSpec`."""
    return [
        ToolSpec(
            t.function.name,
            t.function.description,
            t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in tools or []
    ]


#: Where a chat template's (Hermes) tool calls start in the text of a completion.
TOOL_TAG = "<tool_call>"


def turn_to_message(turn: ParsedTurn, fmt: ChatFormat, completion_ids: Sequence[int]) -> AssistantMessage:
    """A parsed completion as an OpenAI assistant message. Unparseable output is returned as content
    (the decoded text), so nothing the model said is lost. As in OpenAI's API, parsed tool calls are in
    ``tool_calls`` only: ``content`` is the text before a chat template's first ``<tool_call>`` (None when
    there is none), the same text a stream sends (:mod:`~agentrl.engines.server.chat_stream`)."""
    msg = AssistantMessage()
    reasoning = [m.content for m in turn.messages if m.channel == "analysis" and not m.recipient]
    if reasoning:
        msg.reasoning_content = "\n".join(reasoning)
    if turn.final is not None:
        msg.content = turn.final
    else:
        said = [
            m.content
            for m in turn.messages
            if m.role == "assistant" and not m.recipient and m.channel != "analysis"
        ]
        if said:
            content = "\n".join(said)
            if turn.tool_calls and fmt.name != "harmony":  # the text holds the raw <tool_call> markup
                content = content.split(TOOL_TAG, 1)[0].strip()
            msg.content = content or None
        elif not turn.tool_calls and not reasoning:
            stops = set(fmt.stop_token_ids)
            msg.content = fmt.decode([t for t in completion_ids if t not in stops])
    if turn.tool_calls:
        calls = []
        for tc in turn.tool_calls:
            args = tc.raw_arguments
            try:
                json.loads(args)
            except (TypeError, ValueError):
                args = json.dumps(tc.arguments)
            calls.append(
                ToolCallOut(
                    id=tc.call_id or f"call_{uuid.uuid4().hex[:24]}",
                    function={"name": tc.name, "arguments": args},
                )
            )
        msg.tool_calls = calls
    return msg


def finish_reason(c: Completion, msg: AssistantMessage) -> str:
    if msg.tool_calls:
        return "tool_calls"
    return "length" if c.finish_reason == "length" else "stop"


def completion_logprobs(c: Completion, fmt: ChatFormat, as_ids: bool) -> CompletionLogprobs:
    pieces = [fmt.decode([t]) for t in c.token_ids]
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    return CompletionLogprobs(
        tokens=[f"token_id:{t}" for t in c.token_ids] if as_ids else pieces,
        token_logprobs=list(c.logprobs),
        text_offset=offsets,
    )


def chat_logprobs(c: Completion) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprob(token=f"token_id:{t}", logprob=lp) for t, lp in zip(c.token_ids, c.logprobs, strict=True)
        ]
    )
