"""A chat-completions endpoint with tools as an episode :class:`~agentrl.episodes.Policy`.

Each model reply (OpenAI shape: ``content``, ``reasoning_content``, ``tool_calls``) is rendered into the
env's format (:func:`~agentrl.runtime.bridge.reply_to_steps`, ``format.render_completion``) and handed to
the episode runner as one env action per tool call, so parsing, dispatch, limits, the error taxonomy and
the trajectory all come from the env itself. The env's observations are folded back into the OpenAI
transcript (:attr:`ChatPolicy.messages`) before the next request, each tool result answering its call id.

The env's format must render completions (:class:`~agentrl.harmony.HarmonyFormat` does). Log-probs are
not available through chat completions: the actions carry none (the trajectory holds 0.0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agentrl.engines.client import ChatClient, ChatResult
from agentrl.episodes import Action, EpisodeState, Step
from agentrl.harmony.trajectory import SamplingRecord
from agentrl.runtime.bridge import observation_to_openai, prompt_to_openai, reply_to_steps, tools_to_openai


class ChatPolicy:
    """Asks ``client`` for each reply; one instance per episode (it keeps the OpenAI transcript).

    Args:
        client: a :class:`~agentrl.engines.client.ChatClient`.
        sampling: chat-completions parameters (``temperature``, ``max_completion_tokens``, ``seed``...).
        on_text: when given, replies are streamed and ``on_text`` gets each piece of assistant text.

    After the episode, :attr:`messages` is the transcript (call :meth:`sync` with the episode's steps to
    add the last observations), :attr:`requests` the chat requests made and :attr:`usage` the summed
    ``prompt_tokens`` / ``completion_tokens`` the endpoint reported; the trajectory records them too
    (``api="chat"``, ``requests``, ``usage``, and the ``sampling``).
    """

    def __init__(
        self,
        client: ChatClient,
        sampling: dict[str, Any] | None = None,
        *,
        on_text: Callable[[str], Any] | None = None,
    ):
        self.client = client
        self.sampling = dict(sampling or {})
        self.on_text = on_text
        self.messages: list[dict[str, Any]] = []
        self.requests = 0
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self._tools: list[dict[str, Any]] | None = None
        self._call_ids: list[str | None] = []  # the call id answered by each action of the last reply
        self._synced = 0  # episode steps already folded into messages

    async def act(self, episode: EpisodeState) -> list[Action]:
        """Fold the env's last observations into the transcript, ask for a reply, return it as actions.

        Raises:
            TypeError: the env's format cannot render completions.
            agentrl.engines.client.EndpointError: the endpoint failed after retries.
        """
        env = episode.env
        render = getattr(env.format, "render_completion", None)
        if render is None:
            raise TypeError(
                f"a chat policy needs an env format that renders completions; {type(env.format).__name__} "
                "does not (use the default HarmonyFormat)"
            )
        if self._tools is None:
            self.messages = prompt_to_openai(episode.prompt_messages, env.instructions)
            self._tools = tools_to_openai(env.toolbox.specs)
        self.sync(episode.steps)
        reply = await self._ask()
        self.requests += 1
        for key in self.usage:
            self.usage[key] += int(reply.usage.get(key) or 0)
        traj = episode.trajectory
        traj.api, traj.requests, traj.usage = "chat", self.requests, dict(self.usage)
        traj.sampling = SamplingRecord.of(self.sampling)
        calls = [
            dict(c, id=c.get("id") or f"call_{self.requests}_{i}") for i, c in enumerate(reply.tool_calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.message.get("content")}
        if calls:
            message["tool_calls"] = calls
        self.messages.append(message)
        steps = reply_to_steps({**reply.message, "tool_calls": calls}, env.toolbox.specs)
        actions = []
        for i, step in enumerate(steps):
            ids = list(render(step))
            cut = reply.finish_reason == "length" and i == len(steps) - 1
            if cut:
                ids = ids[:-1]  # the reply was cut: no terminator, so the env sees the truncation
            actions.append(Action(ids, None, finish_reason="length" if cut else "stop"))
        self._call_ids = [calls[i]["id"] if i < len(calls) else None for i in range(len(steps))]
        return actions

    def sync(self, steps: Sequence[Step]) -> None:
        """Add the observations of ``steps`` not yet in :attr:`messages` (each tool result answers its call)."""
        for k, step in enumerate(steps[self._synced :]):
            call_id = self._call_ids[k] if k < len(self._call_ids) else None
            self.messages += observation_to_openai(step.observation["messages"], call_id)
        self._synced = len(steps)

    async def _ask(self) -> ChatResult:
        tools = self._tools or []
        if self.on_text is None:
            return await self.client.chat(self.messages, tools, **self.sampling)
        result = None
        async for piece in self.client.stream_chat(self.messages, tools, **self.sampling):
            if isinstance(piece, str):
                self.on_text(piece)
            else:
                result = piece
        assert result is not None, "stream_chat yields the assembled reply last"
        return result
