"""The ChatFormat contract: how a model's conversation becomes tokens and its output becomes messages.

Two implementations live beside this: Harmony (GPT-OSS, via openai-harmony) and HF chat templates
with Hermes/Qwen-style ``<tool_call>`` parsing (dense models). Envs, the trainer and product agents
only ever talk to this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from agentrl.harmony.types import Message, ParsedTurn, ToolSpec


class ChatFormat(ABC):
    """Renders prompts and observations to token ids and parses completions, token-in-token-out.

    Contract:
    - ``render_prompt`` returns the full prompt, ending with the header that makes the model speak
      as the assistant (Harmony: ``<|start|>assistant``).
    - ``parse`` never raises on model output: problems are returned in ``ParsedTurn.errors``.
    - ``render_observation`` returns only the tokens an env appends after the model's completion
      (tool results and/or a user message, then the next assistant header). It never re-renders
      earlier turns, so ``prompt + completion + observation`` is the exact token stream.
    - ``stop_token_ids`` are the ids at which generation of one assistant action must stop.
    """

    name: str

    @abstractmethod
    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
        *,
        instructions: str | None = None,
    ) -> list[int]:
        """Token ids for a conversation prefix, ending with the assistant header."""

    @abstractmethod
    def parse(self, completion_ids: Sequence[int], *, tools: Sequence[ToolSpec] | None = None) -> ParsedTurn:
        """Parse one assistant completion (the ids sampled after the assistant header).

        ``tools``: the declared tools; when given, calls to other recipients are reported as
        ``UNKNOWN_RECIPIENT`` errors instead of being returned in ``tool_calls``."""

    @abstractmethod
    def render_observation(self, messages: Sequence[Message], *, completion_ids: Sequence[int]) -> list[int]:
        """Token ids the env appends after ``completion_ids``: ``messages`` (role ``tool`` or
        ``user``) followed by the next assistant header."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> list[int]:
        """Ids that end one assistant action."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain text to ids (no special tokens); used for text actions in tests and tools."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, special tokens rendered literally."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including specials); ids are in ``[0, vocab_size)``."""


def leading_instructions(messages: Sequence[Message], instructions: str | None = None) -> tuple[list[str], int]:
    """The texts a format puts in its system/developer preamble: the leading ``system``/``developer``
    messages' contents, then ``instructions``; and the index of the first message after them."""
    lead: list[str] = []
    start = 0
    while start < len(messages) and messages[start].role in ("system", "developer"):
        lead.append(messages[start].content)
        start += 1
    return (lead + [instructions] if instructions else lead), start
