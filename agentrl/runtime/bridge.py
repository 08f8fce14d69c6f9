"""Translate between OpenAI chat-completions messages and an :class:`~agentrl.envs.AgentEnv`'s messages.

A served chat model answers in OpenAI shape (``content``, ``reasoning_content``, ``tool_calls``); the env
steps on completions in its own :class:`~agentrl.harmony.format.ChatFormat`. :func:`reply_to_steps`
renders a reply into env actions (assistant :class:`Message` lists the format turns into token ids), so
parsing, tool dispatch, limits, the error taxonomy and the trajectory all come from the env itself, the
same code that runs in training.

Harmony carries one tool call per completion, so a reply with ``m`` parallel tool calls becomes ``m``
env steps: the first carries the reasoning, any preamble text and the first call; each later one a call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentrl.harmony.types import Message, ToolSpec


def tools_to_openai(specs: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The env's tools as OpenAI ``tools`` (function tools; the Harmony built-in ``python`` tool becomes a
    function ``python(code)``)."""
    return [
        {
            "type": "function",
            "function": {"name": s.name, "description": s.description, "parameters": s.parameters},
        }
        for s in specs
    ]


def prompt_to_openai(messages: Sequence[Message], instructions: str | None) -> list[dict[str, Any]]:
    """The env's prompt (and developer instructions) as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": m.content})
    return out


def _call_message(call: dict[str, Any], specs: dict[str, ToolSpec]) -> Message:
    fn = call.get("function") or {}
    name = str(fn.get("name") or "")
    raw = fn.get("arguments")
    raw = raw if isinstance(raw, str) else json.dumps(raw if raw is not None else {})
    spec = specs.get(name)
    if spec is not None and spec.namespace != "functions":
        # a Harmony built-in (python): free-text code, addressed in the analysis channel
        try:
            args = json.loads(raw)
        except ValueError:
            args = None
        code = args.get("code") if isinstance(args, dict) and isinstance(args.get("code"), str) else raw
        return Message("assistant", code, channel="analysis", recipient=spec.recipient, content_type="code")
    return Message("assistant", raw, channel="commentary", recipient=f"functions.{name}", content_type="json")


def reply_to_steps(message: dict[str, Any], specs: Sequence[ToolSpec]) -> list[list[Message]]:
    """An OpenAI assistant message as env steps (each a list of assistant :class:`Message`).

    Without tool calls the reply is one step ending in a ``final`` message (an empty reply gives an empty
    final answer, so the env records what happened). With calls, text content is a commentary preamble.
    """
    by_name = {s.name: s for s in specs}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    first: list[Message] = []
    if reasoning:
        first.append(Message("assistant", str(reasoning), channel="analysis"))
    calls = message.get("tool_calls") or []
    if not calls:
        first.append(Message("assistant", content or "", channel="final"))
        return [first]
    if content:
        first.append(Message("assistant", content, channel="commentary"))
    steps = [first + [_call_message(calls[0], by_name)]]
    steps += [[_call_message(c, by_name)] for c in calls[1:]]
    return steps


def observation_to_openai(messages: Sequence[Message], call_id: str | None) -> list[dict[str, Any]]:
    """The env's observation for one step as OpenAI messages.

    When the step answered a tool call (``call_id``), exactly one ``tool`` message answers it: the tool's
    result, or, if the env rejected the call (bad JSON, unknown tool), the env's note, so the OpenAI
    conversation stays valid. Other env notes become user messages.
    """
    results = [m.content for m in messages if m.role == "tool"]
    notes = [m for m in messages if m.role != "tool"]
    out: list[dict[str, Any]] = []
    if call_id is not None:
        text = "\n".join(results) if results else "\n".join(m.content for m in notes)
        out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if results:
            out += [{"role": m.role, "content": m.content} for m in notes]
    else:
        out += [{"role": "user", "content": text} for text in results]
        out += [{"role": m.role, "content": m.content} for m in notes]
    return out
