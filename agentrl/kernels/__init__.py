"""Sink attention for GPT-OSS: Triton kernels (forward, backward, d(sink)), FlashAttention-4 as a
second backend chosen per call (``backend="auto"``), torch references, and registration as a
transformers attention implementation. Under ``auto`` a kernel that fails to compile or launch falls
back to the next backend (FA4, else torch ops) with one warning (:mod:`agentrl.kernels.fallback`).

Importing this package needs only torch; Triton is imported on the first kernel call, FA4
(``flash_attn.cute``) on the first call that may use it, and transformers on
:func:`register_transformers_attention`. Nothing else from ``agentrl`` is imported.
"""

from agentrl.kernels.reference import sink_attention_eager, sink_attention_reference
from agentrl.kernels.sink_attention import sink_attention
from agentrl.kernels.transformers_attention import register_transformers_attention

__all__ = [
    "register_transformers_attention",
    "sink_attention",
    "sink_attention_eager",
    "sink_attention_reference",
]
