"""``ChatTemplateFormat``: any HF tokenizer's chat template, with Hermes/Qwen-style tool calls.

The model calls tools by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one or more)
and ends its turn with the template's end-of-turn token. Prompts come from ``apply_chat_template``;
observations are the exact ids the template appends after the model's turn, found by rendering the
conversation with and without the new messages and taking the difference. Templates that rewrite earlier
turns when a message is added (e.g. ones that strip past reasoning) are rejected with
:class:`TemplateNotAppendOnlyError`, because their token stream cannot be extended in place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from agentrl.harmony.format import ChatFormat, leading_instructions
from agentrl.harmony.types import Message, ParsedTurn, ParseError, ParseErrorKind, ToolCall, ToolSpec

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_PROBE_USER = "Hello."


class TemplateNotAppendOnlyError(ValueError):
    """The chat template changes already-rendered tokens when a message is appended."""


_TOOLS_HEAD = (
    "# Tools\n\nYou can call functions to help with the user's request. Their signatures, one JSON object "
    "per line, are inside <tools></tools>:\n<tools>\n"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
)


def hermes_tools_prompt(tools: Sequence[ToolSpec]) -> str:
    """System-prompt text describing ``tools`` and the ``<tool_call>`` convention, for templates that do
    not render tools themselves."""
    lines = [json.dumps(_tool_schema(t), ensure_ascii=False) for t in tools]
    return _TOOLS_HEAD + "\n".join(lines) + _TOOLS_TAIL


def _jinja_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON's escapes (\n, \", \\) are Jinja string escapes too


#: Jinja run before a template that does not render tools itself, so that ``apply_chat_template(messages,
#: tools=...)`` renders what :class:`ChatTemplateFormat` trained on: the leading system messages and the tools
#: prompt joined into one system message, and assistant ``tool_calls`` (OpenAI/HF form) as ``<tool_call>`` blocks.
_TOOLS_PREAMBLE = (
    "{%- if tools or messages | selectattr('tool_calls', 'defined') | list %}\n"
    "{%- set ns = namespace(lead=[], start=0, out=[], calls=[]) %}\n"
    "{%- for m in messages %}{%- if ns.start == loop.index0 and m.role in ['system', 'developer'] %}"
    "{%- set ns.lead = ns.lead + [m.content] %}{%- set ns.start = loop.index %}{%- endif %}{%- endfor %}\n"
    "{%- if tools %}{%- set ns.lead = ns.lead + [" + _jinja_str(_TOOLS_HEAD)
    + " + (tools | map('tojson') | join('\\n')) + " + _jinja_str(_TOOLS_TAIL) + "] %}{%- endif %}\n"
    "{%- if ns.lead %}{%- set ns.out = [{'role': 'system', 'content': ns.lead | join('\\n\\n')}] %}{%- endif %}\n"
    "{%- for m in messages[ns.start:] %}\n"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- set ns.calls = [] %}\n"
    "{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- set args = f.arguments if f.arguments is string else f.arguments | tojson %}"
    "{%- set ns.calls = ns.calls + ['<tool_call>\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' + args"
    " + '}\\n</tool_call>'] %}{%- endfor %}\n"
    "{%- set text = ((m.content + '\\n') if m.content else '') + ns.calls | join('\\n') %}"
    "{%- set ns.out = ns.out + [{'role': 'assistant', 'content': text}] %}\n"
    "{%- else %}{%- set ns.out = ns.out + [{'role': m.role, 'content': m.content}] %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- set messages = ns.out %}{%- set tools = none %}\n"
    "{%- endif %}\n"
)


def _tool_schema(t: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


class ChatTemplateFormat(ChatFormat):
    """A dense chat model's format: ``tokenizer.chat_template`` + Hermes ``<tool_call>`` parsing.

    - ``tokenizer``: a transformers tokenizer with a chat template.
    - ``stop_token_ids``: default: the template's end-of-turn token (found by rendering an assistant turn)
      plus the tokenizer's eos.
    - ``system_prompt``: used when the conversation has no system message and instructions are given
      (leading ``system``/``developer`` messages and ``instructions`` are joined into one system message).

    Assistant tool-call messages (``recipient`` set) are written in the Hermes form the model emits.
    """

    name = "chat_template"

    def __init__(self, tokenizer, *, stop_token_ids: Sequence[int] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template; pass one that does or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self._stop = list(stop_token_ids) if stop_token_ids is not None else None

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> ChatTemplateFormat:
        """Load the tokenizer with ``transformers.AutoTokenizer.from_pretrained(name_or_path, **kwargs)``
        (e.g. ``gguf_file=...`` for a GGUF checkpoint) and wrap it."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                "ChatTemplateFormat.from_pretrained needs transformers: pip install 'agentrl-sdk[train]'"
            ) from exc
        return cls(AutoTokenizer.from_pretrained(name_or_path, **kwargs))

    def exported_chat_template(self) -> str:
        """The chat template to ship with a checkpoint trained in this format (``save_pretrained``): one that
        renders ``tools=`` as training did. A template that renders tools itself is returned as it is; else the
        tools prompt and ``<tool_call>`` blocks are added by a preamble (:data:`_TOOLS_PREAMBLE`) before it."""
        template = self.tokenizer.chat_template
        return template if self._template_renders_tools else _TOOLS_PREAMBLE + template

    # -- rendering helpers --------------------------------------------------------------------------------
    @cached_property
    def _template_renders_tools(self) -> bool:
        return "tools" in self.tokenizer.chat_template

    def _hf_messages(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), instructions: str | None = None
    ) -> list[dict[str, Any]]:
        lead, start = leading_instructions(messages, instructions)
        if tools and not self._template_renders_tools:
            lead.append(hermes_tools_prompt(tools))
        out: list[dict[str, Any]] = [{"role": "system", "content": "\n\n".join(lead)}] if lead else []
        for m in messages[start:]:
            if m.role == "assistant" and m.recipient:
                name = m.recipient.split(".", 1)[-1]
                try:
                    args: Any = json.loads(m.content)
                except ValueError:
                    args = m.content
                call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                out.append({"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"})
            elif m.role == "developer":
                out.append({"role": "system", "content": m.content})
            else:
                out.append({"role": m.role, "content": m.content})
        return out

    def _render(
        self, hf_messages: list[dict[str, Any]], tools: Sequence[ToolSpec], *, generation_prompt: bool
    ) -> list[int]:
        kwargs: dict[str, Any] = {}
        if tools and self._template_renders_tools:
            kwargs["tools"] = [_tool_schema(t) for t in tools]
        out = self.tokenizer.apply_chat_template(
            hf_messages, tokenize=True, add_generation_prompt=generation_prompt, **kwargs
        )
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return [int(i) for i in out]

    # -- ChatFormat ------------------------------------------------------------------------------------
    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, instructions: str | None = None
    ) -> list[int]:
        """``apply_chat_template(..., add_generation_prompt=True)`` of the conversation."""
        return self._render(self._hf_messages(messages, tools, instructions), tools, generation_prompt=True)

    def render_observation(
        self,
        messages: Sequence[Message],
        *,
        completion_ids: Sequence[int],
        history: Sequence[Message] | None = None,
    ) -> list[int]:
        """The ids the template appends after the model's turn: the rest of the assistant turn after its
        end-of-turn token (e.g. a newline), ``messages``, then the generation prompt. A truncated completion
        (no stop token) is closed with the end-of-turn token first.

        ``history``: the conversation before the completion; a short probe conversation is used when omitted
        (exact for templates whose rendering of a turn does not depend on earlier turns). Raises
        :class:`TemplateNotAppendOnlyError` when adding the messages would change earlier tokens.
        """
        if any(m.role == "assistant" for m in messages):
            raise ValueError(
                "render_observation renders env messages; assistant tokens come from the completion"
            )
        completion = [int(t) for t in completion_ids]
        stops = set(self.stop_token_ids)
        truncated = not completion or completion[-1] not in stops
        content = self.decode([t for t in completion if t not in stops]) if completion else ""
        before = list(history) if history is not None else [Message("user", _PROBE_USER)]
        hist = self._hf_messages(before)
        turn = {"role": "assistant", "content": content}
        prompt = self._render(hist, (), generation_prompt=True)
        closed = self._render([*hist, turn], (), generation_prompt=False)
        full = self._render([*hist, turn, *self._hf_messages(messages)], (), generation_prompt=True)
        if closed[: len(prompt)] != prompt or full[: len(closed)] != closed:
            raise TemplateNotAppendOnlyError(
                "this chat template re-renders earlier turns when a message is appended (for example it strips "
                "past reasoning), so observations cannot be appended to the sampled tokens. Use a template "
                "whose rendering is append-only, or re-render the prompt each turn outside TrajectoryBuilder."
            )
        end = self.end_of_turn_id
        tail = closed[len(prompt) :]
        if end not in tail:
            raise TemplateNotAppendOnlyError(
                "the template does not end an assistant turn with its end-of-turn token"
            )
        closing = tail[len(tail) - 1 - tail[::-1].index(end) + 1 :]
        return ([end] if truncated else []) + closing + full[len(closed) :]

    def completion_text(self, messages: Sequence[Message]) -> str:
        """The text of one assistant turn holding ``messages`` (assistant messages), as the model writes it:
        an ``analysis`` message as a leading ``<think>`` block, plain text as is, and each tool call
        (``recipient`` set, ``content`` its JSON arguments, or free-text code with ``content_type="code"``
        for a built-in python tool, sent as ``{"code": ...}``) as a Hermes ``<tool_call>`` block, joined by
        newlines. :meth:`parse` of the rendered completion gives the messages back."""
        parts: list[str] = []
        for i, m in enumerate(messages):
            if m.role != "assistant":
                raise ValueError(f"completion_text takes assistant messages only, got role {m.role!r}")
            if m.recipient:
                if m.content_type == "code":
                    m = Message("assistant", json.dumps({"code": m.content}, ensure_ascii=False), recipient=m.recipient)
                parts.append(self._hf_messages([m])[0]["content"])
            elif m.channel == "analysis":
                if i:
                    raise ValueError("an analysis message (<think> block) can only come first in a turn")
                parts.append(f"<think>\n{m.content}\n</think>")
            else:
                parts.append(m.content)
        return "\n".join(parts)

    def render_completion(self, messages: Sequence[Message]) -> list[int]:
        """The ids a model emits for ``messages`` after the generation prompt: :meth:`completion_text`
        encoded as plain text (the tokenizer's own split; special-token text stays text), then the
        end-of-turn token. The env's observation for it is then exactly what the template appends."""
        return self.encode(self.completion_text(messages)) + [self.end_of_turn_id]

    def parse(self, completion_ids: Sequence[int], *, tools: Sequence[ToolSpec] | None = None) -> ParsedTurn:
        """Hermes parse; never raises. ``messages``: an ``analysis`` message for a leading ``<think>`` block,
        then one assistant message with the rest of the text, ``<tool_call>`` blocks included (channel
        ``final`` when it has no tool call, else ``None``).
        ``tool_calls``: each well-formed ``<tool_call>`` (JSON object with ``name`` and object ``arguments``;
        a declared tool when ``tools`` is given). ``stop_token``: the trailing stop id, or None (truncated)."""
        turn = ParsedTurn()
        ids = [int(t) for t in completion_ids]
        if not ids:
            turn.errors.append(ParseError(ParseErrorKind.EMPTY, "the completion is empty", None))
            return turn
        stops = set(self.stop_token_ids)
        if ids[-1] in stops:
            turn.stop_token = ids[-1]
            ids = ids[:-1]
        else:
            turn.errors.append(
                ParseError(
                    ParseErrorKind.TRUNCATED, "generation stopped without an end-of-turn token", len(ids)
                )
            )
        special = self._special_ids
        for k, t in enumerate(ids):
            if t in special:
                turn.errors.append(
                    ParseError(
                        ParseErrorKind.STRAY_SPECIAL, f"special token {self.decode([t])!r} inside the turn", k
                    )
                )
        text = self.decode(ids)
        think = THINK_RE.match(text)
        if think:
            turn.messages.append(Message("assistant", think.group(1).strip(), channel="analysis"))
            text = text[think.end() :]
        by_name = {t.name: t for t in tools} if tools is not None else None
        for match in TOOL_CALL_RE.finditer(text):
            self._call(match.group(1), by_name, turn)
        rest = TOOL_CALL_RE.sub("", text)
        if "<tool_call>" in rest:
            kind = ParseErrorKind.TRUNCATED if turn.stop_token is None else ParseErrorKind.MALFORMED
            turn.errors.append(ParseError(kind, "<tool_call> without a closing </tool_call>", None))
        has_calls = "<tool_call>" in text
        if text.strip() or not turn.messages:
            channel = None if has_calls else "final"
            turn.messages.append(Message("assistant", text.strip(), channel=channel))
        if not has_calls and turn.stop_token is not None and text.strip():
            turn.final = text.strip()
        if not text.strip() and not think and not turn.errors:
            turn.errors.append(ParseError(ParseErrorKind.EMPTY, "the completion contains no text", None))
        return turn

    def _call(self, body: str, by_name: dict[str, ToolSpec] | None, turn: ParsedTurn) -> None:
        def refuse(kind: ParseErrorKind, message: str) -> None:
            turn.errors.append(ParseError(kind, message))

        try:
            obj = json.loads(body)
        except ValueError as exc:
            return refuse(ParseErrorKind.BAD_JSON, f"<tool_call> body is not valid JSON: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return refuse(ParseErrorKind.MALFORMED, 'a <tool_call> must hold {"name": ..., "arguments": {...}}')
        name = obj["name"]
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError as exc:
                return refuse(ParseErrorKind.BAD_JSON, f"arguments of {name!r} are not JSON: {exc}")
        if not isinstance(args, dict):
            return refuse(ParseErrorKind.BAD_JSON, f"arguments of {name!r} must be a JSON object")
        if by_name is not None and name not in by_name:
            known = ", ".join(sorted(by_name)) or "none"
            return refuse(ParseErrorKind.UNKNOWN_RECIPIENT, f"call to unknown tool {name!r} (declared: {known})")
        recipient = by_name[name].recipient if by_name is not None else f"functions.{name}"
        turn.tool_calls.append(
            ToolCall(
                recipient=recipient,
                name=name,
                arguments=args,
                raw_arguments=json.dumps(args, ensure_ascii=False),
            )
        )

    # -- tokens ------------------------------------------------------------------------------------------
    @cached_property
    def end_of_turn_id(self) -> int:
        """The token the template puts right after an assistant message's content."""
        sentinel = "Sentinel reply."
        hist = [{"role": "user", "content": _PROBE_USER}]
        prompt = self._render(hist, (), generation_prompt=True)
        closed = self._render(
            [*hist, {"role": "assistant", "content": sentinel}], (), generation_prompt=False
        )
        tail = closed[len(prompt) :]
        special = self._special_ids
        for t in tail:
            if t in special:
                return t
        raise ValueError("cannot find the template's end-of-turn token; pass stop_token_ids explicitly")

    @property
    def stop_token_ids(self) -> list[int]:
        if self._stop is not None:
            return list(self._stop)
        ids = [self.end_of_turn_id]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(int(eos))
        return ids

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.tokenizer.all_special_ids) | frozenset(
            int(i) for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special
        )

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text to ids without BOS/EOS. Special-token text is split into ordinary tokens unless
        ``allow_special``."""
        return list(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not allow_special)
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)
