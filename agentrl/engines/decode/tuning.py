"""How the decode engine runs on its device, and the defaults by device, in one place: :class:`DecodeTuning`.

None of these settings changes what is sampled beyond floating-point rounding (``attention`` and ``fused`` pick
kernels; the others size the cache and the work per step); they trade memory, latency and throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

#: head sizes the attention kernels take
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def default_attention(model: torch.nn.Module, device: torch.device) -> str:
    """On a GPU: ``kernel`` (the sink-attention kernel) for GPT-OSS and half-precision models, ``exact`` (the
    IEEE float32 decode kernel; the sink kernel's float32 dots are TF32) for float32 dense models. ``torch``
    on the CPU and for head sizes the kernels do not take."""
    config = getattr(model, "config", None)
    dtype = next(model.parameters()).dtype
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if device.type != "cuda" or head_dim not in KERNEL_HEAD_DIMS:
        return "torch"
    if getattr(config, "model_type", None) == "gpt_oss" or dtype != torch.float32:
        return "kernel"
    return "exact"


@dataclass(frozen=True)
class DecodeTuning:
    """The decode engine's tuning; a field left ``None`` takes its device's default (:meth:`resolve`):

    - ``chunk_steps``: decode steps between two host reads (GPU 16, CPU 1);
    - ``cuda_graphs``: capture the decode steps (GPU yes; CUDA only);
    - ``attention``: ``kernel``, ``torch`` or ``exact`` (:func:`default_attention`);
    - ``fused``: the Triton element-wise kernels (GPU yes, CPU no);
    - ``max_slots``: cache slots (GPU ``2 * max_batch_size``, so finished sequences stay cached for their next
      turn; CPU ``max_batch_size``);
    - ``min_length``: positions a slot holds at least (GPU 1024, so the cache and the captured graphs are not
      rebuilt as sequences grow; CPU 0);
    - ``prefill_tokens``: most tokens in one prefill forward (GPU 16384, CPU 4096).
    """

    chunk_steps: int | None = None
    cuda_graphs: bool | None = None
    attention: str | None = None
    fused: bool | None = None
    max_slots: int | None = None
    min_length: int | None = None
    prefill_tokens: int | None = None

    def resolve(self, model: torch.nn.Module, max_batch_size: int) -> DecodeTuning:
        """Every field set: the given ones as they are, the others the default for ``model``'s device."""
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        defaults = DecodeTuning(
            chunk_steps=16 if cuda else 1, cuda_graphs=cuda, attention=default_attention(model, device), fused=cuda,
            max_slots=2 * max_batch_size if cuda else max_batch_size, min_length=1024 if cuda else 0,
            prefill_tokens=16384 if cuda else 4096,
        )
        return replace(defaults, **{f.name: getattr(self, f.name) for f in fields(self)
                                    if getattr(self, f.name) is not None})
