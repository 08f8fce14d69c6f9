"""agentrl.envs: ``AgentEnv`` (a real ``gymnasium.Env``), the tool API, tool adapters, rewards, the built-in
envs (gsm8k, retool, verifyif, jobs) and the registry.

Importing this package registers the built-in envs with Gymnasium (``gymnasium.make("agentrl/ReTool-v0")``)
and with :func:`make`; env modules themselves load only when an env is made. No torch import.
"""

from agentrl.envs.env import AgentEnv, EnvLimits, default_format
from agentrl.envs.registry import env_class, make, register, registered
from agentrl.envs.rewards import RewardContext, Rubric
from agentrl.envs.spaces import MessageTuple, UnicodeText, observation_space, token_ids_space
from agentrl.envs.tools import StatefulTool, Tool, ToolError, ToolOutput, tool

__all__ = [
    "AgentEnv",
    "EnvLimits",
    "MessageTuple",
    "RewardContext",
    "Rubric",
    "StatefulTool",
    "Tool",
    "ToolError",
    "ToolOutput",
    "UnicodeText",
    "default_format",
    "env_class",
    "make",
    "observation_space",
    "register",
    "registered",
    "token_ids_space",
    "tool",
]
