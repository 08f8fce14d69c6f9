"""The tool API: the :class:`Tool` contract, ``@tool`` for typed functions, stateful tools with per-episode
sessions, and the dispatcher that turns every bad call into an error observation."""

from agentrl.envs.tools.base import (
    ERROR_KINDS,
    StatefulTool,
    Tool,
    ToolError,
    ToolInfrastructureError,
    ToolOutput,
)
from agentrl.envs.tools.dispatch import Sessions, ToolBox, truncate_text
from agentrl.envs.tools.function import FunctionTool, tool

__all__ = [
    "ERROR_KINDS",
    "FunctionTool",
    "Sessions",
    "StatefulTool",
    "Tool",
    "ToolBox",
    "ToolError",
    "ToolInfrastructureError",
    "ToolOutput",
    "tool",
    "truncate_text",
]
