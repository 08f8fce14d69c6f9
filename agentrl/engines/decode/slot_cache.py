"""A preallocated KV cache of fixed slots: one sequence per slot, written in place, reused across requests.

The cache is one tensor, ``kv`` of shape ``[layers, 2, slots, L, Hkv, D]`` (``layout="token"``: each slot
is a packed ``[L, Hkv, D]`` sequence, what the varlen attention kernel reads) or ``[layers, 2, slots, Hkv,
L, D]`` (``layout="head"``: ``[Hkv, L, D]`` per slot, what batched torch attention reads without copies).
Position ``L - 1`` of every slot is scratch: rows that are not live write their keys there, so a
captured decode step never needs a branch. Usable positions are ``0 .. L - 2``.

With ``record_routing`` it also holds ``routing``, ``[moe_layers, slots, L, top_k]`` int16: the experts
each cached token was routed to (written where the token's keys are written, copied with them).

:meth:`reserve` grows the slot count and length (copying what is cached), :meth:`release` frees it all.
Every buffer starts zeroed, so reading an unwritten position gives finite values.
"""

from __future__ import annotations

import torch


class SlotCache:
    """See the module docstring. ``moe_layers``/``top_k``: routing record geometry (0 = none)."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 layout: str = "token", moe_layers: int = 0, top_k: int = 0) -> None:
        if layout not in ("token", "head"):
            raise ValueError(f"layout must be 'token' or 'head', got {layout!r}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device, self.layout = dtype, torch.device(device), layout
        self.moe_layers, self.top_k = moe_layers, top_k
        self.kv: torch.Tensor | None = None
        self.routing: torch.Tensor | None = None
        self.slots = 0
        self.length = 0

    # ------------------------------------------------------------------ geometry
    @property
    def allocated(self) -> bool:
        return self.kv is not None

    @property
    def scratch(self) -> int:
        """The scratch position of every slot (``L - 1``)."""
        return self.length - 1

    def _shape(self, slots: int, length: int) -> tuple[int, ...]:
        if self.layout == "token":
            return (self.layers, 2, slots, length, self.kv_heads, self.head_dim)
        return (self.layers, 2, slots, self.kv_heads, length, self.head_dim)

    def reserve(self, slots: int, length: int) -> bool:
        """Make room for at least ``slots`` slots of ``length`` positions (scratch included), keeping what
        is cached. Returns True when the buffers were (re)allocated (their addresses changed)."""
        slots, length = max(slots, self.slots), max(length, self.length)
        if self.kv is not None and (slots, length) == (self.slots, self.length):
            return False
        kv = torch.zeros(self._shape(slots, length), dtype=self.dtype, device=self.device)
        routing = None
        if self.moe_layers:
            routing = torch.zeros((self.moe_layers, slots, length, self.top_k), dtype=torch.int16, device=self.device)
        if self.kv is not None:
            keep = self.length - 1  # the old scratch position holds nothing worth keeping
            if self.layout == "token":
                kv[:, :, : self.slots, :keep] = self.kv[:, :, :, :keep]
            else:
                kv[:, :, : self.slots, :, :keep] = self.kv[:, :, :, :, :keep]
            if routing is not None and self.routing is not None:
                routing[:, : self.slots, :keep] = self.routing[:, :, :keep]
        self.kv, self.routing, self.slots, self.length = kv, routing, slots, length
        return True

    def release(self) -> None:
        self.kv = self.routing = None
        self.slots = self.length = 0

    # ------------------------------------------------------------------ access
    def keys(self, layer: int) -> torch.Tensor:
        """``[slots, L, Hkv, D]`` (token layout) or ``[slots, Hkv, L, D]`` (head layout) of ``layer``."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def packed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` as packed ``[slots * L, Hkv, D]`` (token layout only)."""
        k, v = self.kv[layer, 0], self.kv[layer, 1]
        return k.view(-1, self.kv_heads, self.head_dim), v.view(-1, self.kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[N, Hkv, D]``) of ``N`` tokens at ``(slots[i], positions[i])``."""
        if self.layout == "token":
            self.kv[layer, 0].index_put_((slots, positions), k)
            self.kv[layer, 1].index_put_((slots, positions), v)
        else:
            self.kv[layer, 0][slots, :, positions] = k
            self.kv[layer, 1][slots, :, positions] = v

    def write_routing(self, moe_layer: int, slots: torch.Tensor, positions: torch.Tensor,
                      experts: torch.Tensor) -> None:
        """Record ``experts`` (``[N, top_k]``) for ``N`` tokens at ``(slots[i], positions[i])``."""
        if self.routing is not None:
            self.routing[moe_layer].index_put_((slots, positions), experts.to(torch.int16))

    def copy_prefix(self, pairs: list[tuple[int, int, int]]) -> None:
        """For each ``(src, dst, n)``: positions ``0 .. n-1`` of slot ``src`` (every layer, and the
        routing record) copied to slot ``dst``."""
        for src, dst, n in pairs:
            if n <= 0 or src == dst:
                continue
            if self.layout == "token":
                self.kv[:, :, dst, :n] = self.kv[:, :, src, :n]
            else:
                self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
            if self.routing is not None:
                self.routing[:, dst, :n] = self.routing[:, src, :n]

    def routing_of(self, slot: int, n: int) -> torch.Tensor:
        """``[moe_layers, n, top_k]`` int64 on the CPU: the experts of positions ``0 .. n-1`` of ``slot``."""
        if self.routing is None:
            raise RuntimeError("this cache records no routing (record_routing is off)")
        return self.routing[:, slot, :n].to("cpu", torch.int64)
