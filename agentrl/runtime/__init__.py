"""agentrl.runtime: put an env's tools in a product, against a served model, with no training code.

:class:`Agent` answers one user request with multi-turn tool use, streams text as it arrives, enforces
limits on tool calls, turns and time, and returns the transcript. :class:`ChatPolicy` is the episode
policy underneath (a chat-completions endpoint driving an env through :func:`agentrl.episodes.run_episode`).
Imports no torch.
"""

from agentrl.runtime.agent import STOP_REASONS, Agent, AgentEvent, AgentResult, Done, TextDelta, ToolEvent
from agentrl.runtime.chat_policy import ChatPolicy

__all__ = ["STOP_REASONS", "Agent", "AgentEvent", "AgentResult", "ChatPolicy", "Done", "TextDelta", "ToolEvent"]
