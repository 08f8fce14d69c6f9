"""agentrl: agent environments and an integrated trainer for agentic RL of GPT-OSS and chat models.

The core SDK (``agentrl.harmony``, ``agentrl.envs``) imports without torch.
"""

__version__ = "0.1.0"


def make(name: str, **kwargs):
    """Build a registered env by short name (``"gsm8k"``, ``"retool"``, ``"verifyif"``, ``"jobs"``, or one
    declared by an installed package in the ``agentrl.envs`` entry-point group). See
    :func:`agentrl.envs.registry.make`."""
    from agentrl.envs.registry import make as _make

    return _make(name, **kwargs)
