"""``HarmonyFormat``: the GPT-OSS chat format, rendered by openai-harmony and parsed by our tolerant parser.

Rendering delegates to openai-harmony, so prompts are token-identical to the official renderer. Parsing
uses :mod:`agentrl.harmony.harmony_parser`, which never raises and reports malformed output as
``ParsedTurn.errors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from agentrl.harmony.encoding import load_harmony_encoding_offline
from agentrl.harmony.format import ChatFormat, leading_instructions
from agentrl.harmony.harmony_parser import BUILTIN_NAMESPACES, HarmonyTokens, StreamingParser, parse_harmony
from agentrl.harmony.types import Message, ParsedTurn, ToolSpec

if TYPE_CHECKING:
    import openai_harmony as oh

AnalysisPolicy = Literal["keep", "drop"]
ReasoningEffortName = Literal["low", "medium", "high"]
DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


class HarmonyFormat(ChatFormat):
    """GPT-OSS Harmony format (o200k_harmony, 201,088 ids).

    Parameters:
    - ``encoding``: an ``openai_harmony.HarmonyEncoding``; default loads it offline
      (:func:`load_harmony_encoding_offline`).
    - ``reasoning_effort``: ``"low" | "medium" | "high"`` written into the system message (``None`` omits it).
    - ``model_identity``, ``knowledge_cutoff``, ``conversation_start_date``: the other system-message fields.
    - ``analysis``: what earlier analysis (chain-of-thought) messages become in rendered prompts.
      ``"drop"`` is the official rule (``auto_drop_analysis=True``): once the conversation contains an
      assistant ``final`` message and the last assistant message is final, analysis messages before the
      first final are left out. ``"keep"`` renders every message (``auto_drop_analysis=False``).

    Our :class:`Message` maps to Harmony as follows: leading ``system``/``developer`` messages become the
    developer instructions (before ``instructions``); ``tool`` messages need ``name`` = the tool's recipient
    (``"functions.lookup"``) and default to the ``commentary`` channel; ``content_type="json"`` means
    ``<|constrain|>json``, any other content type is written verbatim (``code``).
    """

    name = "harmony"

    def __init__(
        self,
        encoding: oh.HarmonyEncoding | None = None,
        *,
        reasoning_effort: ReasoningEffortName | None = "medium",
        model_identity: str | None = DEFAULT_MODEL_IDENTITY,
        knowledge_cutoff: str | None = "2024-06",
        conversation_start_date: str | None = None,
        analysis: AnalysisPolicy = "drop",
    ):
        if analysis not in ("keep", "drop"):
            raise ValueError(f"analysis must be 'keep' or 'drop', got {analysis!r}")
        if reasoning_effort not in (None, "low", "medium", "high"):
            raise ValueError(
                f"reasoning_effort must be 'low', 'medium', 'high' or None, got {reasoning_effort!r}"
            )
        self.encoding = encoding if encoding is not None else load_harmony_encoding_offline()
        self.reasoning_effort = reasoning_effort
        self.model_identity = model_identity
        self.knowledge_cutoff = knowledge_cutoff
        self.conversation_start_date = conversation_start_date
        self.analysis: AnalysisPolicy = analysis
        self.tokens = self._formatting_tokens()

    def _formatting_tokens(self) -> HarmonyTokens:
        ids = {
            name: self.encoding.encode(text, allowed_special={text}, disallowed_special=())
            for name, text in (
                ("start", "<|start|>"),
                ("end", "<|end|>"),
                ("message", "<|message|>"),
                ("channel", "<|channel|>"),
                ("constrain", "<|constrain|>"),
                ("return_", "<|return|>"),
                ("call", "<|call|>"),
                ("first_special", "<|startoftext|>"),
            )
        }
        for name, value in ids.items():
            if len(value) != 1:
                raise RuntimeError(f"encoding {self.encoding.name} has no single token for {name}: {value}")
        tokens = HarmonyTokens(**{k: v[0] for k, v in ids.items()}, max_id=max(self._special_ids))
        # o200k_harmony defines specials 199998..201088; GPT-OSS's embedding has 201,088 rows, so the last
        # reserved id (201088) exists in the encoding but never in model output.
        if max(self._special_ids) != self.vocab_size or min(self._special_ids) != tokens.first_special:
            raise RuntimeError("unexpected special-token layout in the Harmony encoding")
        return tokens

    # -- conversion to openai-harmony -------------------------------------------------------------------
    def system_message(
        self, tools: Sequence[ToolSpec] = (), *, reasoning_effort: str | None = None
    ) -> oh.Message:
        """The Harmony system message (identity, cutoff, date, reasoning effort, built-in tools)."""
        import openai_harmony as oh

        content = oh.SystemContent.new()
        content.model_identity = self.model_identity
        content.knowledge_cutoff = self.knowledge_cutoff
        content.conversation_start_date = self.conversation_start_date
        effort = reasoning_effort if reasoning_effort is not None else self.reasoning_effort
        content.reasoning_effort = None if effort is None else oh.ReasoningEffort(effort.capitalize())
        for ns in _builtin_namespaces(tools):
            content = content.with_tools(_builtin_config(ns, tools))
        return oh.Message.from_role_and_content(oh.Role.SYSTEM, content)

    def developer_message(
        self, tools: Sequence[ToolSpec] = (), instructions: str | None = None
    ) -> oh.Message | None:
        """The developer message (instructions + non-built-in tool namespaces), or None if both are empty."""
        import openai_harmony as oh

        custom = [t for t in tools if t.namespace not in BUILTIN_NAMESPACES]
        if not custom and not instructions:
            return None
        content = oh.DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        namespaces: dict[str, list[oh.ToolDescription]] = {}
        for t in custom:
            namespaces.setdefault(t.namespace, []).append(
                oh.ToolDescription.new(t.name, t.description, t.parameters)
            )
        for ns, descs in namespaces.items():
            content = content.with_tools(oh.ToolNamespaceConfig(name=ns, description=None, tools=descs))
        return oh.Message.from_role_and_content(oh.Role.DEVELOPER, content)

    def to_harmony_messages(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, instructions: str | None = None,
        reasoning_effort: str | None = None,
    ) -> list[oh.Message]:
        """The full Harmony message list: system, developer (if any), then the conversation."""
        leading, start = leading_instructions(messages, instructions)
        out = [self.system_message(tools, reasoning_effort=reasoning_effort)]
        dev = self.developer_message(tools, "\n\n".join(leading) if leading else None)
        if dev is not None:
            out.append(dev)
        out.extend(to_harmony_message(m) for m in messages[start:])
        return out

    # -- ChatFormat ----------------------------------------------------------------------------------
    def _config(self, analysis: AnalysisPolicy | None):
        import openai_harmony as oh

        return oh.RenderConversationConfig(auto_drop_analysis=(analysis or self.analysis) == "drop")

    def _conversation(self, messages, tools, instructions, reasoning_effort):
        import openai_harmony as oh

        return oh.Conversation.from_messages(
            self.to_harmony_messages(
                messages, tools, instructions=instructions, reasoning_effort=reasoning_effort
            )
        )

    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
        *,
        instructions: str | None = None,
        reasoning_effort: ReasoningEffortName | None = None,
        analysis: AnalysisPolicy | None = None,
    ) -> list[int]:
        """Prompt ids ending with ``<|start|>assistant``; equal to openai-harmony's
        ``render_conversation_for_completion`` of :meth:`to_harmony_messages` (``analysis`` overrides the
        format's policy for this call)."""
        import openai_harmony as oh

        conv = self._conversation(messages, tools, instructions, reasoning_effort)
        return self.encoding.render_conversation_for_completion(
            conv, oh.Role.ASSISTANT, self._config(analysis)
        )

    def render_training(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), **options: Any) -> list[int]:
        """Whole-conversation ids as openai-harmony's ``render_conversation_for_training`` (a trailing final
        message ends with ``<|return|>``); ``options`` are :meth:`render_prompt`'s (``instructions``,
        ``reasoning_effort``, ``analysis``)."""
        analysis = options.pop("analysis", None)
        conv = self._conversation(messages, tools, options.pop("instructions", None), options.pop("reasoning_effort", None))
        if options:
            raise TypeError(f"render_training got unknown options {sorted(options)}")
        return self.encoding.render_conversation_for_training(conv, self._config(analysis))

    def render_message(self, message: Message) -> list[int]:
        """One message, ``<|start|>`` through its terminator, as openai-harmony renders it in a conversation."""
        return self.encoding.render(to_harmony_message(message))

    def render_completion(
        self, messages: Sequence[Message], *, stop: Literal["auto", "end"] = "auto"
    ) -> list[int]:
        """The ids a model emits for ``messages`` (assistant messages) after a prompt's ``<|start|>assistant``.

        The first message's ``<|start|>assistant`` is omitted (the prompt holds it). With ``stop="auto"`` the
        last message ends as sampled: ``<|call|>`` for a tool call, ``<|return|>`` for a final answer.
        """
        out: list[int] = []
        for i, m in enumerate(messages):
            if m.role != "assistant":
                raise ValueError(f"render_completion takes assistant messages only, got role {m.role!r}")
            ids = self.render_message(m)
            if i == 0:
                ids = ids[len(self._assistant_header) :]
            out.extend(ids)
        if stop == "auto" and messages and messages[-1].channel == "final" and messages[-1].recipient is None:
            out[-1] = self.tokens.return_
        return out

    def parse(self, completion_ids: Sequence[int], *, tools: Sequence[ToolSpec] | None = None) -> ParsedTurn:
        """Parse the ids sampled after ``<|start|>assistant``. Never raises on model output.

        - ``messages``: every message recovered, including a truncated last one and failing calls.
        - ``tool_calls``: only calls that can be dispatched: a recipient (declared in ``tools`` when given,
          ``None`` skips that check), not a function call in the analysis channel, arguments a JSON object
          (the built-in ``python`` tool takes free text as ``{"code": text}``). Rejected calls appear in
          ``errors`` with the token index of their content.
        - ``final``: content of the last complete ``final``-channel message without recipient.
        - ``stop_token``: ``<|call|>``, ``<|return|>`` or a trailing ``<|end|>``; ``None`` means truncated.
        """
        return parse_harmony(completion_ids, self.decode, tools, self.tokens)

    def streaming_parser(self, tools: Sequence[ToolSpec] | None = None) -> StreamingParser:
        """A :class:`StreamingParser` for one completion."""
        return StreamingParser(self, tools)

    def render_observation(self, messages: Sequence[Message], *, completion_ids: Sequence[int]) -> list[int]:
        """Ids the env appends after ``completion_ids``: each message rendered as in a conversation, then
        ``<|start|>assistant``.

        If ``completion_ids`` is non-empty and does not end with ``<|end|>``, ``<|call|>`` or ``<|return|>``
        (a truncated completion), an ``<|end|>`` is prepended so the stream stays well formed.
        ``messages`` must have role ``tool`` (with ``name``), ``user``, ``system`` or ``developer``.
        """
        out: list[int] = []
        if completion_ids and int(completion_ids[-1]) not in self.tokens.terminators:
            out.append(self.tokens.end)
        for m in messages:
            if m.role == "assistant":
                raise ValueError(
                    "render_observation renders env messages (tool/user/system/developer); assistant tokens "
                    "come from the model's completion"
                )
            out.extend(self.render_message(m))
        out.extend(self._assistant_header)
        return out

    @cached_property
    def _assistant_header(self) -> list[int]:
        return [self.tokens.start, *self.encode("assistant")]

    @property
    def assistant_header_ids(self) -> list[int]:
        """``<|start|>assistant``: the ids that make the model speak next."""
        return list(self._assistant_header)

    @property
    def stop_token_ids(self) -> list[int]:
        """``<|return|>`` and ``<|call|>``: the ends of an assistant action (``<|end|>`` is not one: after an
        analysis message the model goes on with ``<|start|>assistant``)."""
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text to ids. By default special-token text (``<|call|>``) is encoded as ordinary text; with
        ``allow_special=True`` it becomes the special id (for text actions written by hand)."""
        if allow_special:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, special tokens written literally, invalid UTF-8 replaced."""
        return self.encoding.decode([int(i) for i in ids])

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (specials as their literal text)."""
        return bytes(self.encoding._inner.decode_bytes([int(token)]))

    @cached_property
    def _special_ids(self) -> list[int]:
        return [
            self.encoding.encode(s, allowed_special={s}, disallowed_special=())[0]
            for s in self.encoding.special_tokens_set
        ]

    @property
    def vocab_size(self) -> int:
        """201,088: GPT-OSS's vocabulary (ids ``0..201087``; the encoding's extra ``<|reserved_201088|>`` is
        outside it)."""
        return 201088


def to_harmony_message(m: Message) -> oh.Message:
    """One of our messages as an ``openai_harmony.Message`` (see :class:`HarmonyFormat` for the mapping)."""
    import openai_harmony as oh

    if m.role == "tool":
        if not m.name:
            raise ValueError(
                "a tool message needs name = the recipient the model called (e.g. 'functions.lookup' or 'python')"
            )
        hm = oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, m.name), m.content)
        hm = hm.with_channel(m.channel or "commentary").with_recipient(m.recipient or "assistant")
    else:
        try:
            role = oh.Role(m.role)
        except ValueError:
            raise ValueError(
                f"unknown role {m.role!r}; use system, developer, user, assistant or tool"
            ) from None
        hm = oh.Message.from_role_and_content(role, m.content)
        if m.name:
            hm.author.name = m.name
        if m.channel:
            hm = hm.with_channel(m.channel)
        if m.recipient:
            hm = hm.with_recipient(m.recipient)
    if m.content_type:
        hm = hm.with_content_type("<|constrain|>json" if m.content_type == "json" else m.content_type)
    return hm


def _builtin_namespaces(tools: Sequence[ToolSpec]) -> list[str]:
    seen: list[str] = []
    for t in tools:
        if t.namespace in BUILTIN_NAMESPACES and t.namespace not in seen:
            seen.append(t.namespace)
    return seen


def _builtin_config(namespace: str, tools: Sequence[ToolSpec]) -> oh.ToolNamespaceConfig:
    """openai-harmony's own description of a built-in tool namespace (python, browser), or one built from
    the given specs for other built-in namespaces."""
    import openai_harmony as oh

    if namespace == "python":
        return oh.ToolNamespaceConfig.python()
    if namespace == "browser":
        return oh.ToolNamespaceConfig.browser()
    descs = [
        oh.ToolDescription.new(t.name, t.description, t.parameters) for t in tools if t.namespace == namespace
    ]
    return oh.ToolNamespaceConfig(name=namespace, description=None, tools=descs)
