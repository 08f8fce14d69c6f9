"""agentrl.envs: ``AgentEnv`` (a real ``gymnasium.Env``), the tool API, tool adapters, rewards, the built-in
envs (gsm8k, retool, verifyif, jobs) and the registry.

Importing this package registers the built-in envs with Gymnasium (``gymnasium.make("agentrl/ReTool-v0")``)
and with :func:`make` (``agentrl.make("retool", **kwargs)``); env modules load only when an env is made, and
nothing here imports torch.

Driving an env (what a trainer does)::

    env = agentrl.make("retool", format=fmt, sandbox=shared_backend)
    task = env.tasks(split="train", n=1, seed=0)[0]
    obs, info = await env.areset(seed=0, options={"task": task})      # obs["tokens"]: the prompt ids
    while True:
        completion = sample(env.trajectory.prompt_ids + env.trajectory.response_ids,
                            stop=env.format.stop_token_ids)             # ids + logprobs
        obs, reward, terminated, truncated, info = await env.astep(completion)
        if terminated or truncated:
            break
    env.trajectory            # token-exact Trajectory: masks, rollout log-probs, reward(_components), turns

Writing an env: subclass :class:`AgentEnv`, set ``instructions`` and a ``rubric``, return tools from
``make_tools`` (``@tool`` functions, :class:`StatefulTool` subclasses, search/OpenAPI adapters) and draw tasks
in ``generate_task``; see ``examples/custom_env.py``.
"""

from agentrl.envs.env import AgentEnv, EnvLimits
from agentrl.envs.registry import env_class, make, register, registered
from agentrl.envs.rewards import RewardContext, Rubric
from agentrl.envs.spaces import MessageTuple, UnicodeText, observation_space, token_ids_space
from agentrl.envs.tools import ERROR_KINDS, StatefulTool, Tool, ToolError, ToolOutput, tool

__all__ = [
    "ERROR_KINDS",
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
    "env_class",
    "make",
    "observation_space",
    "register",
    "registered",
    "token_ids_space",
    "tool",
]
