"""agentrl: agent environments and an integrated trainer for agentic RL of GPT-OSS and chat models.

The core SDK (``agentrl.harmony``, ``agentrl.envs``) imports without torch.
"""

__version__ = "0.1.0"
