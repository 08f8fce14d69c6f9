"""The one place a local rollout engine is chosen: :func:`make_engine`.

The trainer, ``agentrl eval`` and ``agentrl serve model`` (through
:func:`agentrl.engines.server.load_local_engine`) and verl's ``agentrl`` rollout all build their engine
here, so they sample the same way.

``kind``:

- ``"decode"``: :class:`~agentrl.engines.decode.decode_engine.DecodeEngine` (continuous batching over a slot KV
  cache, device-side sampling keyed per request, CUDA-graph decode steps on a GPU). Raises for a model it
  does not support, saying why.
- ``"transformers"``: :class:`~agentrl.engines.transformers_engine.TransformersEngine` (micro-batched
  ``model.forward`` with transformers' cache; any causal LM).
- ``"auto"`` (default): ``decode`` for a model on a CUDA device that it supports (Llama/Qwen/GPT-OSS, not
  sharded, with or without the trainer's LoRA adapter, experts included), else ``transformers``. On the CPU ``auto`` is always ``transformers``, so the CPU default path
  (``agentrl train env=retool``) is the one whose result and wall time are recorded; ``kind="decode"``
  runs the decode engine on the CPU too.
"""

from __future__ import annotations

from typing import Any

KINDS = ("auto", "decode", "transformers")


def choose_kind(model: Any, kind: str = "auto") -> str:
    """``"decode"`` or ``"transformers"`` for ``model`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind == "transformers" or (kind == "auto" and not _on_cuda(model)):
        return "transformers"
    from agentrl.engines.decode.decoder import unsupported_reason

    reason = unsupported_reason(model)
    if reason is None:
        return "decode"
    if kind == "decode":
        raise ValueError(f"engine=decode cannot run this model ({reason}); use engine=transformers")
    return "transformers"


def _on_cuda(model: Any) -> bool:
    """Whether ``model``'s (first) parameters live on a CUDA device."""
    first = next(iter(model.parameters()), None)
    return first is not None and first.device.type == "cuda"


def make_engine(model: Any, *, kind: str = "auto", pad_token_id: int = 0, max_batch_size: int = 64, seed: int = 0,
                record_routing: bool = False, share_prefix: bool = True, deterministic: bool = False) -> Any:
    """A rollout engine for ``model`` (a transformers causal LM on its device). ``pad_token_id``: the
    transformers engine's left padding (the decode engine pads nothing). ``deterministic``
    (decode engine only): reproducible batch formation (see :mod:`agentrl.engines.decode.decode_engine`);
    ValueError when ``kind`` resolves to the transformers engine, which has no such mode."""
    chosen = choose_kind(model, kind)
    if deterministic and chosen != "decode":
        raise ValueError(f"rollout.deterministic=true needs the decode engine, but rollout.engine={kind} runs the "
                         "transformers engine here (auto picks decode only on CUDA); set rollout.engine=decode "
                         "or rollout.deterministic=false")
    if chosen == "decode":
        from agentrl.engines.decode.decode_engine import DecodeEngine

        return DecodeEngine(model, max_batch_size=max_batch_size, seed=seed,
                            record_routing=record_routing, share_prefix=share_prefix, deterministic=deterministic)
    from agentrl.engines.transformers_engine import TransformersEngine

    return TransformersEngine(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size, seed=seed,
                              record_routing=record_routing, share_prefix=share_prefix)
