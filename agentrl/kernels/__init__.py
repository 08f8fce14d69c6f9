"""agentrl.kernels."""
