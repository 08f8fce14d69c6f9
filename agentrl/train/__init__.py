"""agentrl.train."""
