"""The one place a local rollout engine is chosen: :func:`make_engine`.

The trainer, ``agentrl eval`` and ``agentrl serve model`` (through
:func:`agentrl.engines.server.load_local_engine`) and verl's ``agentrl`` rollout all build their engine
here, so they sample the same way.

``kind``:

- ``"decode"``: :class:`~agentrl.engines.decode_engine.DecodeEngine` (continuous batching over a slot KV
  cache, device-side sampling keyed per request, CUDA-graph decode steps on a GPU). Raises for a model it
  does not support, saying why.
- ``"transformers"``: :class:`~agentrl.engines.transformers_engine.TransformersEngine` (micro-batched
  ``model.forward`` with transformers' cache; any causal LM).
- ``"auto"`` (default): ``decode`` where it supports the model (Llama/Qwen/GPT-OSS on CPU or GPU, not
  sharded), else ``transformers``.
"""

from __future__ import annotations

from typing import Any

KINDS = ("auto", "decode", "transformers")


def choose_kind(model: Any, kind: str = "auto") -> str:
    """``"decode"`` or ``"transformers"`` for ``model`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind == "transformers":
        return kind
    from agentrl.engines.decoder import unsupported_reason

    reason = unsupported_reason(model)
    if reason is None:
        return "decode"
    if kind == "decode":
        raise ValueError(f"engine=decode cannot run this model ({reason}); use engine=transformers")
    return "transformers"


def make_engine(model: Any, *, kind: str = "auto", pad_token_id: int = 0, max_batch_size: int = 64, seed: int = 0,
                record_routing: bool = False, share_prefix: bool = True, deterministic: bool = False) -> Any:
    """A rollout engine for ``model`` (a transformers causal LM on its device). ``deterministic``
    (decode engine only): reproducible batch formation (see :mod:`agentrl.engines.decode_engine`)."""
    if choose_kind(model, kind) == "decode":
        from agentrl.engines.decode_engine import DecodeEngine

        return DecodeEngine(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size, seed=seed,
                            record_routing=record_routing, share_prefix=share_prefix, deterministic=deterministic)
    from agentrl.engines.transformers_engine import TransformersEngine

    return TransformersEngine(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size, seed=seed,
                              record_routing=record_routing, share_prefix=share_prefix)
