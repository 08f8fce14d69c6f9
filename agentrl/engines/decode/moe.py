"""GPT-OSS's mixture-of-experts block for the slot decoder, with the routing of every token recorded.

It computes what transformers' ``GptOssMLP`` computes, from that module's own parameters (no copies, so a
training step's in-place update is seen at once): router logits ``h @ W_r^T + b_r``, the top-k experts,
softmax over their logits as gate weights, each chosen expert's ``down(gate(h @ W_gu + b_gu)) + b_down``
(``experts._apply_gate``: GPT-OSS's clamped SwiGLU) summed with those weights.

Two ways to run the experts, one result:

* ``dense=True`` runs every expert on every token and weights the outputs (zero for experts not chosen):
  no data-dependent shapes and no host synchronisation, so it runs inside a CUDA graph. At decode batch
  sizes a step reads every expert's weights anyway, so the extra arithmetic is cheap there.
* ``dense=False`` runs each chosen expert on its own tokens (a loop over the experts hit, like
  transformers' eager path): less arithmetic for prefill and on the CPU, but it synchronises with the host.

**LoRA on the experts** (PEFT's ``ParamWrapper`` around ``gate_up_proj`` / ``down_proj``, as
:func:`agentrl.models.lora.apply_lora` builds it): each expert adds its unmerged delta
(:class:`~agentrl.engines.decode.lora_delta.ExpertLora`) to its matmul, before the bias: in the dense path as batched
GEMMs over the experts (the gate/up ``A`` of all experts in one GEMM, since every expert sees the same input),
in the looped path on each expert's own tokens. :meth:`SlotMoE.sync` refreshes the adapters' GEMM buffers in
place after the parameters changed.

``record`` (a :class:`~agentrl.engines.decode.slot_cache.SlotCache` with routing, the MoE layer index, and the
tokens' ``(slot, position)``) stores each token's expert ids where its keys are stored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.engines.decode.lora_delta import unwrap_experts


class SlotMoE:
    """The MoE block of one GPT-OSS layer (``mlp`` is its ``GptOssMLP``); see the module docstring."""

    def __init__(self, mlp: nn.Module) -> None:
        self.router = mlp.router
        self.experts, self.lora = unwrap_experts(mlp.experts)
        self.top_k = int(self.router.top_k)
        gate_up = self.experts.gate_up_proj
        hidden = self.router.weight.shape[1]
        # transformers stores GPT-OSS experts "transposed" ([E, H, 2I]); accept the other layout too
        self.transposed = bool(getattr(self.experts, "is_transposed", gate_up.shape[1] == hidden))
        if getattr(self.experts, "is_concatenated", False):
            raise ValueError("GPT-OSS experts with concatenated gate/up weights are not supported by the slot decoder")

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gu, down = self.experts.gate_up_proj, self.experts.down_proj
        if not self.transposed:
            gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        return gu, down  # [E, H, 2I], [E, I, H]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices [N, k] int64, gate weights [N, k])`` for ``h`` ``[N, H]``."""
        logits = F.linear(h, self.router.weight, self.router.bias)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return indices, torch.softmax(top, dim=1, dtype=top.dtype)

    def __call__(self, h: torch.Tensor, *, dense: bool, record: tuple[Any, int, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        indices, weights = self.route(h)
        if record is not None:
            cache, layer, slots, positions = record
            cache.write_routing(layer, slots, positions, indices)
        return self._dense(h, indices, weights) if dense else self._looped(h, indices, weights)

    def state(self) -> tuple:
        """The state of the experts' adapters (what a captured graph depends on beyond tensor contents)."""
        return tuple(self.lora[name].state() for name in sorted(self.lora))

    def sync(self, rebuild: bool = False) -> None:
        """Refresh the expert adapters' GEMM buffers from the live parameters (see :class:`ExpertLora`)."""
        for adapter in self.lora.values():
            adapter.sync(rebuild)

    def _dense(self, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gu, down = self._weights()
        n_exp = gu.shape[0]
        dense_w = torch.zeros((h.shape[0], n_exp), dtype=weights.dtype, device=h.device).scatter(1, indices, weights)
        lora_gu, lora_down = self.lora.get("gate_up_proj"), self.lora.get("down_proj")
        up = torch.matmul(h.unsqueeze(0).expand(n_exp, -1, -1), gu)  # [E, N, 2I]
        if lora_gu is not None:
            up = lora_gu.add_shared(up, h)
        act = self.experts._apply_gate(up + self.experts.gate_up_proj_bias[:, None])
        out = torch.matmul(act, down)
        if lora_down is not None:
            out = lora_down.add_all(out, act)
        out = out + self.experts.down_proj_bias[:, None]  # [E, N, H]
        return (out * dense_w.t()[..., None]).sum(0).to(h.dtype)

    def _looped(self, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gu, down = self._weights()
        lora_gu, lora_down = self.lora.get("gate_up_proj"), self.lora.get("down_proj")
        out = torch.zeros_like(h)
        for expert in torch.unique(indices).tolist():
            token, slot_k = torch.where(indices == expert)
            x = h[token]
            up = torch.matmul(x, gu[expert])
            if lora_gu is not None:
                up = lora_gu.add_one(up, x, expert)
            act = self.experts._apply_gate(up + self.experts.gate_up_proj_bias[expert])
            y = torch.matmul(act, down[expert])
            if lora_down is not None:
                y = lora_down.add_one(y, act, expert)
            y = y + self.experts.down_proj_bias[expert]
            out.index_add_(0, token, (y * weights[token, slot_k, None]).to(h.dtype))
        return out
