"""Chat-completion streaming: the tokens of a completion, as they are sampled, become OpenAI ``delta``s.

:class:`DeltaStreamer` follows one completion token by token:

- Harmony: the streaming parser routes text of the ``final`` channel to ``content`` and of the
  ``analysis`` channel to ``reasoning_content``; text addressed to a tool (the call's arguments) is held
  and sent as ``tool_calls`` once the completion is parsed.
- Other formats (HF chat templates, Hermes tool calls): the decoded text is ``content`` up to a
  ``<tool_call>`` tag; a leading ``<think>...</think>`` block is ``reasoning_content``. Text that could
  still turn into a tag, an incomplete UTF-8 character and trailing whitespace are held back.

:meth:`DeltaStreamer.finish` reconciles with the parsed message (the non-streamed answer): whatever of
its ``content``/``reasoning_content`` was not streamed yet is sent, then the tool calls. So the deltas of a
stream always add up to the message a non-streamed request returns; in both, the tool-call markup of chat
templates is left out of ``content`` (OpenAI's contract: calls are in ``tool_calls`` only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentrl.engines.base import Completion
from agentrl.engines.server.openai_api import TOOL_TAG, AssistantMessage, finish_reason, turn_to_message
from agentrl.harmony.format import ChatFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class DeltaStreamer:
    """Deltas for one completion of ``fmt``; ``feed`` each sampled token, then ``finish``."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.ids: list[int] = []
        self.sent = {"content": "", "reasoning_content": ""}
        self._stops = set(fmt.stop_token_ids)
        self._parser = None
        if fmt.name == "harmony":
            from agentrl.harmony import StreamingParser

            self._parser = StreamingParser(fmt)

    def feed(self, token: int) -> list[dict[str, Any]]:
        """The deltas (``{"content": ...}`` / ``{"reasoning_content": ...}``) that ``token`` releases."""
        self.ids.append(int(token))
        if self._parser is not None:
            channel, recipient = self._parser.channel, self._parser.recipient
            text = self._parser.feed(int(token))
            if not text or recipient:
                return []
            if channel == "final":
                return self._send("content", text)
            if channel == "analysis":
                return self._send("reasoning_content", text)
            return []
        return self._feed_text()

    def _send(self, key: str, text: str) -> list[dict[str, Any]]:
        self.sent[key] += text
        return [{key: text}]

    def _feed_text(self) -> list[dict[str, Any]]:
        text = self.fmt.decode([t for t in self.ids if t not in self._stops])
        out: list[dict[str, Any]] = []
        if text.lstrip().startswith(THINK_OPEN):
            close = text.find(THINK_CLOSE)
            if close < 0:
                return []
            reasoning = text.lstrip()[len(THINK_OPEN) : text.lstrip().find(THINK_CLOSE)].strip()
            if reasoning and not self.sent["reasoning_content"]:
                out += self._send("reasoning_content", reasoning)
            text = text[close + len(THINK_CLOSE) :]
        visible = text.split(TOOL_TAG, 1)[0] if TOOL_TAG in text else _hold_partial_tag(text)
        visible = visible.rstrip("\ufffd").strip()
        if visible.startswith(self.sent["content"]) and len(visible) > len(self.sent["content"]):
            out += self._send("content", visible[len(self.sent["content"]) :])
        return out

    def finish(self, completion: Completion) -> tuple[AssistantMessage, list[dict[str, Any]], str]:
        """``(message, remaining deltas, finish_reason)`` once the completion is done."""
        msg = turn_to_message(self.fmt.parse(completion.token_ids), self.fmt, completion.token_ids)
        out: list[dict[str, Any]] = []
        for key in ("reasoning_content", "content"):
            full = getattr(msg, key) or ""
            if full.startswith(self.sent[key]) and len(full) > len(self.sent[key]):
                out.append({key: full[len(self.sent[key]) :]})
        for k, tc in enumerate(msg.tool_calls or []):
            out.append({"tool_calls": [{"index": k, **tc.model_dump()}]})
        return msg, out, finish_reason(completion, msg)


def _hold_partial_tag(text: str) -> str:
    """``text`` without a trailing piece that could be the start of ``<tool_call>``."""
    for n in range(min(len(TOOL_TAG) - 1, len(text)), 0, -1):
        if TOOL_TAG.startswith(text[-n:]):
            return text[:-n]
    return text


def sse_chunk(rid: str, created: int, model: str, choices: Sequence[dict[str, Any]], **extra: Any) -> str:
    """One ``data:`` event of a ``chat.completion.chunk``."""
    data = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": list(choices),
        **extra,
    }
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def delta_choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish}
