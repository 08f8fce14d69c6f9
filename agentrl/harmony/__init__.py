"""agentrl.harmony."""
