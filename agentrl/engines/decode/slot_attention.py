"""Attention of new tokens against a :class:`~agentrl.engines.decode.slot_cache.SlotCache`, two implementations.

Rows are sequences living in cache slots. A row has ``n_q`` new query tokens (already written to its
slot) and sees the first ``n_keys`` positions of its slot, its queries being the last ``n_q`` of them
(bottom-right causal alignment), limited to the last ``window`` keys on sliding-window layers. Queries
are packed ``[total_q, Hq, D]`` in row order.

* :class:`KernelAttention` calls :func:`agentrl.kernels.sink_attention` (``backend="auto"``: our Triton
  kernels, the decode path for one query per row) on the cache's packed ``token`` layout, with sinks for
  GPT-OSS and without them for plain attention. The slots of a batch are not adjacent in the packed
  keys, so the rows are described as ``2R`` variable-length sequences: before each row a "gap" sequence
  with no query that covers the keys between the previous row's end and this row's slot, then the row
  itself. Rows must be in increasing slot order. Everything is built with tensor ops from device
  tensors, so it runs inside a CUDA graph.
* :class:`TorchAttention` computes the same function with torch ops on the ``head`` layout (float32 math
  for the softmax): batched for decoding (one query per row), one row at a time for prefill. It is the
  CPU path and the exact path for float32 models on a GPU (the Triton kernels run float32 dots as TF32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrl.engines.decode.slot_cache import SlotCache


class KernelAttention:
    """Sink attention kernel over the packed slot cache (see the module docstring)."""

    layout = "token"

    def __init__(self, cache: SlotCache) -> None:
        self.cache = cache

    @staticmethod
    def bounds(slots: torch.Tensor, n_q: torch.Tensor, n_keys: torch.Tensor, length: int,
               out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)`` int32 ``[2R + 1]`` for rows in increasing slot order (gap, row, gap, row, ...).

        ``out_q``/``out_k``: preallocated buffers to fill (inside a captured graph), else new ones."""
        r = slots.shape[0]
        starts = slots.to(torch.int64) * length
        cu_k = out_k if out_k is not None else torch.zeros(2 * r + 1, dtype=torch.int32, device=slots.device)
        cu_q = out_q if out_q is not None else torch.zeros(2 * r + 1, dtype=torch.int32, device=slots.device)
        cu_k[1::2] = starts.to(torch.int32)
        cu_k[2::2] = (starts + n_keys).to(torch.int32)
        ends = torch.cumsum(n_q.to(torch.int64), 0)
        cu_q[1::2] = (ends - n_q).to(torch.int32)
        cu_q[2::2] = ends.to(torch.int32)
        return cu_q, cu_k

    def __call__(self, layer: int, q: torch.Tensor, cu: tuple[torch.Tensor, torch.Tensor], max_q: int, *,
                 sinks: torch.Tensor | None, window: int | None, scale: float) -> torch.Tensor:
        """``q``: ``[total_q, Hq, D]``; ``cu``: :meth:`bounds`; returns ``[total_q, Hq, D]``."""
        from agentrl.kernels import sink_attention

        keys, values = self.cache.packed(layer)
        cu_q, cu_k = cu
        return sink_attention(q, keys, values, sinks, causal=True, window=window, cu_seqlens=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen=max_q, max_seqlen_k=self.cache.length,
                              softmax_scale=scale)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, groups: tuple[int, int]) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` ``[..., Hkv, G, Nq, Nk]``; with ``sinks`` (``[Hq]``)
    an extra logit per query head joins the normaliser and carries no value."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    hkv, g = groups
    sink = sinks.float().view(hkv, g, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


@dataclass
class PrefillPlan:
    """Rows of one prefill, padded for batched torch attention: row ``r`` has ``n_q[r]`` new queries (packed
    in row order) after ``n_keys[r] - n_q[r]`` cached positions of slot ``slots[r]``."""

    slots: torch.Tensor  # [R] int64
    n_q: torch.Tensor  # [R]
    n_keys: torch.Tensor  # [R]
    pad_index: torch.Tensor  # [total_q]: where each packed query sits in the padded [R * max_q] layout
    max_q: int
    max_keys: int
    masks: dict = field(default_factory=dict)  # window -> [R, max_q, max_keys] visibility, built once per forward

    def visible(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = TorchAttention._visible(self.n_keys, self.n_q, self.max_q, self.max_keys, window)
        return self.masks[window]

    @staticmethod
    def build(slots: list[int], n_q: list[int], n_keys: list[int], device: torch.device) -> PrefillPlan:
        max_q = max(n_q)
        pad = [r * max_q + i for r, n in enumerate(n_q) for i in range(n)]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return PrefillPlan(as_tensor(slots), as_tensor(n_q), as_tensor(n_keys), as_tensor(pad), max_q, max(n_keys))


class TorchAttention:
    """Torch-op attention over the ``head`` layout (see the module docstring). ``exact_kernel``: decode with
    :func:`agentrl.engines.decode.decode_attention.decode_attention` (IEEE float32 Triton) instead of torch ops."""

    layout = "head"

    def __init__(self, cache: SlotCache, *, exact_kernel: bool = False) -> None:
        self.cache = cache
        self.exact_kernel = exact_kernel

    @staticmethod
    def _visible(n_keys: torch.Tensor, n_q: torch.Tensor, max_q: int, key_len: int, window: int | None) -> torch.Tensor:
        """``[R, max_q, key_len]`` bool: query ``i`` of a row (position ``n_keys - n_q + i``) sees key ``j``."""
        j = torch.arange(key_len, device=n_keys.device)
        pos = (n_keys - n_q)[:, None] + torch.arange(max_q, device=n_keys.device)[None, :]
        ok = j[None, None, :] <= pos[:, :, None]
        if window is not None:
            ok = ok & (j[None, None, :] > pos[:, :, None] - window)
        return ok

    def decode(self, layer: int, q: torch.Tensor, slots_hi: int, n_keys: torch.Tensor, key_len: int, *,
               sinks: torch.Tensor | None, window: int | None, scale: float) -> torch.Tensor:
        """One query per row for the rows ``0 .. slots_hi - 1`` (row ``i`` = slot ``i``); ``q``
        ``[slots_hi, Hq, D]``; keys read up to ``key_len`` (>= every row's ``n_keys``)."""
        if self.exact_kernel:
            out = self._exact_decode(layer, q, slots_hi, n_keys, sinks=sinks, window=window, scale=scale)
            if out is not None:
                return out
        hkv, d = self.cache.kv_heads, self.cache.head_dim
        g = q.shape[1] // hkv
        keys = self.cache.keys(layer)[:slots_hi, :, :key_len]
        values = self.cache.values(layer)[:slots_hi, :, :key_len]
        qg = q.view(slots_hi, hkv, g, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [R, Hkv, G, key_len]
        visible = self._visible(n_keys, torch.ones_like(n_keys), 1, key_len, window)  # [R, 1, key_len]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = _softmax_with_sinks(scores[..., None, :], sinks, (hkv, g))[..., 0, :]
        out = torch.matmul(probs.to(values.dtype), values)  # [R, Hkv, G, D]
        return out.reshape(slots_hi, hkv * g, d)

    def _exact_decode(self, layer: int, q: torch.Tensor, slots_hi: int, n_keys: torch.Tensor, *,
                      sinks: torch.Tensor | None, window: int | None, scale: float) -> torch.Tensor | None:
        """The IEEE float32 kernel, or None when it fails to compile or launch for this shape class (one
        :class:`~agentrl.kernels.fallback.KernelFallbackWarning`; the torch ops, the same function with
        IEEE float32 dots unless TF32 matmuls are enabled, compute it from then on)."""
        from agentrl.engines.decode.decode_attention import decode_attention
        from agentrl.kernels import fallback

        kernel = "exact float32 decode attention"
        shape_class = (str(q.dtype), q.device.type, *q.shape[1:], self.cache.kv_heads, sinks is not None,
                       window is not None)
        if fallback.failed(kernel, shape_class):
            return None
        slots = torch.arange(slots_hi, device=q.device)
        try:
            return decode_attention(q, self.cache.keys(layer), self.cache.values(layer), slots, n_keys,
                                    sinks=sinks, window=window, scale=scale)
        except Exception as exc:
            if not fallback.is_compile_failure(exc):
                raise
            fallback.fall_back(kernel, shape_class, exc, "torch ops (TorchAttention.decode)")
            return None

    def prefill(self, layer: int, q: torch.Tensor, plan: PrefillPlan, *, sinks: torch.Tensor | None,
                window: int | None, scale: float) -> torch.Tensor:
        """All rows at once, padded: ``q`` ``[sum(n_q), Hq, D]`` packed in row order; no host synchronisation."""
        hkv, d = self.cache.kv_heads, self.cache.head_dim
        rows, g = plan.slots.shape[0], q.shape[1] // hkv
        padded = q.new_zeros((rows * plan.max_q, q.shape[1], d)).index_copy_(0, plan.pad_index, q)
        qg = padded.view(rows, plan.max_q, hkv, g, d).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, max_q, D]
        keys = self.cache.keys(layer)[plan.slots, :, : plan.max_keys]  # [R, Hkv, max_keys, D]
        values = self.cache.values(layer)[plan.slots, :, : plan.max_keys]
        scores = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)).float() * scale  # [R, Hkv, G, max_q, max_keys]
        visible = plan.visible(window)  # [R, max_q, max_keys]
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        probs = _softmax_with_sinks(scores, sinks, (hkv, g))
        out = torch.matmul(probs.to(values.dtype), values[:, :, None])  # [R, Hkv, G, max_q, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(rows * plan.max_q, hkv * g, d)
        return out.index_select(0, plan.pad_index)
