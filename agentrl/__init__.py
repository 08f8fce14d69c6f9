"""agentrl: agent environments and an integrated trainer for agentic RL of GPT-OSS and chat models.

The core SDK (``agentrl.harmony``, ``agentrl.envs``) imports without torch. ``import agentrl`` registers the
built-in envs with Gymnasium, so ``gymnasium.make("agentrl/ReTool-v0")`` (or, without importing agentrl
first, ``gymnasium.make("agentrl:agentrl/ReTool-v0")``) works; it imports gymnasium and no env module.
"""

import agentrl.envs.registry as _registry  # noqa: F401  (registers the built-in envs; makes agentrl.envs reachable)

__version__ = "0.1.0"


def make(name: str, **kwargs):
    """Build a registered env by short name (``"gsm8k"``, ``"retool"``, ``"verifyif"``, ``"jobs"``, or one
    declared by an installed package in the ``agentrl.envs`` entry-point group). See
    :func:`agentrl.envs.registry.make`."""
    return _registry.make(name, **kwargs)
