"""Rollout engines: turn prompt token ids into sampled completion ids with per-token log-probs.

By product:

- :mod:`agentrl.engines.base`: the :class:`~agentrl.engines.base.RolloutEngine` contract every engine keeps;
- :mod:`agentrl.engines.decode`: the decode engine (continuous batching over a slot KV cache);
- :mod:`agentrl.engines.transformers_engine`: the transformers engine (any causal LM; its cache in
  :mod:`agentrl.engines.kv_cache`);
- :mod:`agentrl.engines.factory`: :func:`~agentrl.engines.factory.make_engine`, the one place a local engine
  is chosen;
- :mod:`agentrl.engines.server`: ``agentrl serve model``, the OpenAI-compatible server over any engine;
- :mod:`agentrl.engines.client`: the HTTP clients of OpenAI-compatible servers (an engine and a chat client).

Importing this package needs no torch; the local engines import it.
"""
