"""Built-in envs: gsm8k, retool, verifyif and jobs (load them through :func:`agentrl.make`)."""
