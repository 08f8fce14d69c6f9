"""Unmerged LoRA for the slot decoder: base output plus the adapter's low-rank delta, from the live parameters.

The trainer's LoRA model (:func:`agentrl.models.lora.apply_lora`) holds PEFT layers: ``peft...lora.Linear``
around the attention (and Llama MLP) projections, and ``peft...lora.ParamWrapper`` around GPT-OSS's fused
expert tensors (one wrapper per tensor, nested). The decoder does not call those layers' forwards (PEFT's
expert wrapper folds ``W + s B A`` into a new expert stack on every call, a full copy of the experts). It
computes the same function unmerged:

* a linear layer: ``x W^T + b + s * (x A^T) B^T`` (:class:`LinearLora`), the order of operations of PEFT's
  ``Linear.forward``;
* expert ``e`` of a fused tensor: ``x W_e + s * (x A_e^T) B_e^T`` (:class:`ExpertLora`), where ``A_e`` and
  ``B_e`` are PEFT's per-expert slices of the stacked factors (``lora_A.weight`` ``[E*r, in]`` row-major by
  expert, ``lora_B.weight`` ``[out, r*E]`` with the expert as the fastest index). PEFT computes
  ``x (W_e + s A_e^T B_e^T)``: equal in exact arithmetic, equal to rounding in floating point.

**Live parameters, in-place buffers.** The linear layers' factors are the adapter's own ``nn.Parameter``
tensors, read at each forward. The experts' factors are also kept re-laid out for batched GEMMs in buffers
that :meth:`ExpertLora.sync` refreshes in place. An optimizer step (or
:func:`agentrl.models.lora.load_adapter_state`, or ``DecodeEngine.update_lora``) writes the parameters in place;
the decoder sees their versions change and syncs the buffers before its next forward, so that forward, and a
captured CUDA graph replayed after it, computes with the new adapter: no merge, no recapture. Only replacing a
parameter's storage (a new tensor object) invalidates captured graphs; the decoder detects that (``data_ptr``
changes), rebuilds the buffers and recaptures.

**Which adapter runs.** A layer contributes its delta when it is enabled (not inside
:func:`agentrl.models.lora.adapters_disabled`), not merged into its base, and its active adapter has factors
there; each wrapper's ``state()`` (the adapter in effect and its scale) lets the decoder drop graphs captured
under another state.
Dropout is not applied (decoding is inference). DoRA, LoRA biases, several active adapters and other PEFT
layer types are refused by :func:`unsupported_reason`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def _is_peft_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def _single_adapter(layer: nn.Module) -> str | None:
    """Why ``layer``'s adapter setup is not one plain LoRA adapter, or None."""
    active = list(getattr(layer, "active_adapters", []))
    if len(active) > 1:
        return f"{len(active)} active LoRA adapters ({', '.join(active)}); the engine runs one"
    for name in active:
        if getattr(layer, "use_dora", {}).get(name, False):
            return "DoRA adapters are not supported by the decode engine"
        if getattr(layer, "lora_bias", {}).get(name, False):
            return "LoRA biases (lora_bias=True) are not supported by the decode engine"
        if name in getattr(layer, "lora_embedding_A", {}):
            return "LoRA on embeddings is not supported by the decode engine"
    return None


def _delta_on(layer: nn.Module) -> str | None:
    """The adapter name whose delta ``layer`` adds now, or None (disabled, merged or absent)."""
    if layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    return active[0] if active else None


class LinearLora:
    """A linear layer that may be PEFT-wrapped: :attr:`base` is the ``nn.Linear`` underneath; :meth:`add_delta`
    adds the adapter's contribution. ``module``: the model's layer (plain or ``lora.Linear``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.peft = module if _is_peft_layer(module) else None
        self.base: nn.Linear = module.get_base_layer() if self.peft is not None else module
        if type(self.base) is not nn.Linear:
            raise ValueError(f"expected an nn.Linear under the LoRA layer, got {type(self.base).__name__}")

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y + s * (x A^T) B^T`` for ``x`` ``[N, in]`` and ``y`` ``[N, out]`` (two GEMMs, the second adding
        into ``y``); ``y`` itself when no adapter applies."""
        name = _delta_on(self.peft) if self.peft is not None else None
        if name is None:
            return y
        a, b = self.peft.lora_A[name].weight, self.peft.lora_B[name].weight
        return torch.addmm(y, F.linear(x.to(a.dtype), a), b.t(), alpha=self.peft.scaling[name])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, base plus delta (PEFT's ``Linear.forward`` without dropout)."""
        return self.add_delta(F.linear(x, self.base.weight, self.base.bias), x)

    def state(self) -> tuple:
        if self.peft is None:
            return ()
        name = _delta_on(self.peft)
        return (name, self.peft.scaling.get(name) if name else None)


class ExpertLora:
    """The adapter of one fused expert tensor (a ``ParamWrapper``, ``experts`` experts of rank ``r``).

    The per-expert factors are kept in two buffers laid out for batched GEMMs, ``a_t`` ``[E, in, r]`` and
    ``b_t`` ``[E, r, out]``; :meth:`sync` copies the live ``lora_A`` / ``lora_B`` into them in place (the
    decoder calls it whenever parameters changed, before any forward), so captured graphs keep reading the same
    buffers. The shared-input path reads ``lora_A`` itself (one GEMM over all experts' rows)."""

    def __init__(self, wrapper: nn.Module, experts: int) -> None:
        self.wrapper, self.experts = wrapper, experts
        self.a_t: torch.Tensor | None = None
        self.b_t: torch.Tensor | None = None

    def _live(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(A [E, r, in], B [E, out, r], scale)`` views of the live factors, or None when no adapter applies."""
        name = _delta_on(self.wrapper)
        if name is None:
            return None
        a, b = self.wrapper.lora_A[name].weight, self.wrapper.lora_B[name].weight
        e = self.experts
        return a.view(e, -1, a.shape[-1]), b.view(b.shape[0], -1, e).permute(2, 0, 1), self.wrapper.scaling[name]

    @torch.no_grad()
    def sync(self, rebuild: bool = False) -> None:
        """Copy the live factors into the buffers (allocating them on ``rebuild`` or when missing)."""
        live = self._live()
        if live is None:
            return
        a, b, _ = live
        a_t, b_t = a.transpose(1, 2), b.transpose(1, 2)
        if rebuild or self.a_t is None or self.a_t.shape != a_t.shape:
            self.a_t, self.b_t = a_t.contiguous(), b_t.contiguous()
        else:
            self.a_t.copy_(a_t)
            self.b_t.copy_(b_t)

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        live = self._live()
        if live is not None and self.a_t is None:
            self.sync()
        return None if live is None else (self.a_t, self.b_t, live[2])

    def add_all(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y + delta``, every expert on its own rows: ``x`` ``[E, N, in]``, ``y`` ``[E, N, out]`` (two batched
        GEMMs over the experts: the grouped computation of the CUDA-graph path)."""
        f = self._factors()
        if f is None:
            return y
        a_t, b_t, scale = f
        return torch.baddbmm(y, torch.bmm(x.to(a_t.dtype), a_t), b_t, alpha=scale)

    def add_shared(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:meth:`add_all` for one input ``x`` ``[N, in]`` shared by every expert: the low-rank projection of all
        experts is one GEMM against the stacked ``lora_A`` ``[E*r, in]``."""
        f = self._factors()
        if f is None:
            return y
        _, b_t, scale = f
        a = self._live()[0]
        low = F.linear(x.to(a.dtype), a.reshape(-1, a.shape[-1]))  # [N, E*r], expert-major
        low = low.view(x.shape[0], self.experts, -1).transpose(0, 1)  # [E, N, r]
        return torch.baddbmm(y, low, b_t, alpha=scale)

    def add_one(self, y: torch.Tensor, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``y + delta`` of expert ``expert`` on ``x`` ``[n, in]`` (the looped path's per-expert tokens)."""
        f = self._factors()
        if f is None:
            return y
        a_t, b_t, scale = f
        return torch.addmm(y, torch.mm(x.to(a_t.dtype), a_t[expert]), b_t[expert], alpha=scale)

    def state(self) -> tuple:
        name = _delta_on(self.wrapper)
        return (name, self.wrapper.scaling.get(name) if name else None)


def unwrap_experts(experts: nn.Module) -> tuple[nn.Module, dict[str, ExpertLora]]:
    """``(the experts module under any PEFT wrappers, {tensor name: its adapter})``; ValueError for a wrapper
    the engine cannot compute (see the module docstring)."""
    adapters: dict[str, ExpertLora] = {}
    module = experts
    while _is_peft_layer(module):
        name = getattr(module, "parameter_name", None)
        if name not in EXPERT_TENSORS:
            raise ValueError(f"a LoRA layer of type {type(module).__name__} wraps the experts (parameter {name!r}); "
                             f"the engine adapts only {', '.join(EXPERT_TENSORS)}")
        reason = _single_adapter(module)
        if reason is not None:
            raise ValueError(reason)
        adapters[name] = ExpertLora(module, int(module.num_experts))
        module = module.base_layer
    return module, adapters


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the decode engine cannot compute ``model``'s LoRA layers, or None (also for a model without any)."""
    for name, module in model.named_modules():
        if not _is_peft_layer(module):
            continue
        reason = _single_adapter(module)
        if reason is not None:
            return f"{name}: {reason}"
        if getattr(module, "parameter_name", None) is not None:
            if module.parameter_name not in EXPERT_TENSORS or "experts" not in name.split("."):
                return f"{name}: LoRA on parameter {module.parameter_name!r} is not supported by the decode engine"
        elif type(module.get_base_layer()) is not nn.Linear:
            return f"{name}: LoRA on a {type(module.get_base_layer()).__name__} is not supported by the decode engine"
    return None
