"""verl's per-request sampling dict -> agentrl's :class:`~agentrl.engines.base.SamplingParams`.

verl's agent loops pass ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off), ``repetition_penalty``
and ``logprobs``; agent loops add ``max_tokens`` (or SGLang's ``max_new_tokens``), ``stop_token_ids`` and,
under ``full_determinism``, ``seed``. ``repetition_penalty != 1`` is refused (ValueError): agentrl's engines
sample from the model's distribution, the one the trainer scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.engines.base import SamplingParams


def to_sampling(params: dict[str, Any], default_max_tokens: int, default_stop: Sequence[int] = ()) -> SamplingParams:
    """Our SamplingParams for verl's ``params``; ``default_max_tokens`` / ``default_stop`` apply when the
    request names no ``max_tokens`` / ``stop_token_ids``."""
    if float(params.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError("repetition_penalty is not supported by agentrl's engines; leave it at 1.0")
    top_k = int(params.get("top_k", -1) or -1)
    max_tokens = params.get("max_tokens", params.get("max_new_tokens", default_max_tokens))
    stop = params.get("stop_token_ids")
    return SamplingParams(
        max_new_tokens=int(max_tokens),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        stop_token_ids=[int(t) for t in (default_stop if stop is None else stop)],
        seed=params.get("seed"),
    )
