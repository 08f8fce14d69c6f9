"""Rollout engines: turn prompt token ids into sampled completion ids with per-token log-probs.

Importing this package needs no torch; the local transformers engine imports it lazily.
"""
