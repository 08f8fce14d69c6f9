"""agentrl.envs: ``AgentEnv`` (a real ``gymnasium.Env``), the tool API, tool adapters, rewards, the built-in
envs (gsm8k, retool, verifyif, jobs) and the registry.

Importing this package (or just ``agentrl``) registers the built-in envs with Gymnasium
(``gymnasium.make("agentrl/ReTool-v0")``) and with :func:`make` (``agentrl.make("retool", **kwargs)``). The
names below load on first use and env modules only when an env is made; nothing here imports torch.

Driving an env by hand (the library's own callers use :func:`agentrl.episodes.run_episode`, which runs
this loop with a policy, limits and hooks)::

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

from agentrl.envs.registry import env_class, make, register, registered

#: public name -> the module that defines it (imported on first use, so that ``import agentrl`` and the
#: registry stay cheap: registering the built-in envs needs only gymnasium)
_LAZY = {
    "ActionLike": "agentrl.envs.env",
    "AgentEnv": "agentrl.envs.env",
    "EnvKwargsError": "agentrl.envs.env_kwargs",
    "EnvLimits": "agentrl.envs.env",
    "Observation": "agentrl.envs.env",
    "SampledCompletion": "agentrl.envs.env",
    "TeacherError": "agentrl.envs.env",
    "RewardContext": "agentrl.envs.rewards",
    "RewardErrorWarning": "agentrl.envs.env",
    "Rubric": "agentrl.envs.rewards",
    "MessageTuple": "agentrl.envs.spaces",
    "UnicodeText": "agentrl.envs.spaces",
    "observation_space": "agentrl.envs.spaces",
    "token_ids_space": "agentrl.envs.spaces",
    "ERROR_KINDS": "agentrl.envs.tools",
    "check_env_kwargs": "agentrl.envs.env_kwargs",
    "StatefulTool": "agentrl.envs.tools",
    "Tool": "agentrl.envs.tools",
    "ToolError": "agentrl.envs.tools",
    "ToolInfrastructureError": "agentrl.envs.tools",
    "ToolOutput": "agentrl.envs.tools",
    "tool": "agentrl.envs.tools",
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agentrl.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ERROR_KINDS",
    "ActionLike",
    "AgentEnv",
    "EnvKwargsError",
    "EnvLimits",
    "MessageTuple",
    "Observation",
    "RewardContext",
    "RewardErrorWarning",
    "Rubric",
    "SampledCompletion",
    "StatefulTool",
    "TeacherError",
    "Tool",
    "ToolError",
    "ToolInfrastructureError",
    "ToolOutput",
    "UnicodeText",
    "check_env_kwargs",
    "env_class",
    "make",
    "observation_space",
    "register",
    "registered",
    "token_ids_space",
    "tool",
]
