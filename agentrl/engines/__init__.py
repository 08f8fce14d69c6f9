"""Rollout engines: turn prompt token ids into sampled completion ids with per-token log-probs.

Importing this package needs no torch; the local engines (:mod:`agentrl.engines.decode_engine`,
:mod:`agentrl.engines.transformers_engine`, chosen by :func:`agentrl.engines.factory.make_engine`) import it.
"""
