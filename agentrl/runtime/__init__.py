"""agentrl.runtime: put an env's tools in a product, against a served model, with no training code.

:class:`Agent` answers one user request with multi-turn tool use, streams text as it arrives, enforces
limits on tool calls, turns and time, and returns the transcript. Imports no torch.
"""

from agentrl.runtime.agent import STOP_REASONS, Agent, AgentEvent, AgentResult, Done, TextDelta, ToolEvent

__all__ = ["STOP_REASONS", "Agent", "AgentEvent", "AgentResult", "Done", "TextDelta", "ToolEvent"]
