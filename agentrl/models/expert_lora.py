"""Unmerged LoRA on GPT-OSS's fused experts for the trainer's forward: base output plus each expert's low-rank delta.

PEFT adapts a fused expert tensor (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``) through a
``ParamWrapper`` (one per tensor, nested around the experts module). Its forward folds ``W + s A^T B^T`` for
every expert into a new expert stack on each call and runs the experts on that: for GPT-OSS-20B a transient
the size of the layer's experts (1.6 GB per layer in bf16), which autograd also keeps for the backward, and a
gradient of the same size in the backward.

:func:`install` replaces the forward of the outermost wrapper of each GPT-OSS experts module by
:func:`experts_forward`, which computes the same function unmerged, as a grouped computation over the experts
the batch routes to: the ``(token, expert)`` pairs are sorted by expert, and each projection is
``x W_e + s (x A_e^T) B_e^T`` on expert ``e``'s rows (three grouped GEMMs: the base and the two low-rank
factors, whose intermediate is ``[pairs, r]``), then ``+ b_e``. The gate is the experts' own ``_apply_gate``
(GPT-OSS's clamped SwiGLU), the outputs are weighted by the routing weights and summed per token in top-k
order, as transformers' ``grouped_mm`` experts forward does. Autograd runs through ``A`` and ``B``; nothing
the size of the expert weights is built or saved. It is the function the decode engine computes for the experts
(unmerged, per expert), and equals PEFT's to rounding (tests/test_expert_lora.py).

**What stays PEFT's.** The wrappers, their ``lora_A`` / ``lora_B`` parameters (the same tensor objects: the
optimizer, checkpoints, ``adapter_state_dict``, FSDP2's sharding and the engine's ``update_lora`` see no
change), their names, their enable/disable and merge state. The replaced forward reads the live parameters at
each call (under FSDP2 the gathered ones) and hands the call back to PEFT's forward whenever it is not plain
single-adapter LoRA: adapters disabled on every wrapper (so :func:`agentrl.models.lora.adapters_disabled` is
the base model bit for bit), a merged wrapper, several active adapters, or a call that is not
``(hidden [N, H], router_indices [N, k], routing_weights [N, k])``.

**Routing.** The experts receive the router's choice from ``GptOssMLP``; routing capture and replay
(:mod:`agentrl.models.routing`) patch the router, so they work unchanged.

**Grouped GEMMs.** ``torch.nn.functional.grouped_mm`` where its kernel takes the operands (CUDA bf16 on SM80+;
the CPU in float32/bf16 with 16-byte-aligned strides), else a loop over the experts hit (one host sync per
forward), with the same result.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_TENSORS = ("gate_up_proj", "down_proj")
_GROUPED_MM = getattr(F, "grouped_mm", None)


def expert_factors(wrapper: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A [E, r, in], B [E, out, r], scale)``: views of adapter ``adapter``'s live ``lora_A`` / ``lora_B`` in a
    PEFT ``ParamWrapper`` of ``E`` experts (``lora_A.weight`` ``[E*r, in]`` is expert-major; ``lora_B.weight``
    ``[out, r*E]`` has the expert as its fastest index). Expert ``e``'s delta on its input rows ``x`` ``[n, in]``
    is ``scale * (x A_e^T) B_e^T``, in either layout of the experts' weights (``[E, in, out]`` or
    ``[E, out, in]``: PEFT swaps its in/out features for the latter)."""
    a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    experts = int(wrapper.num_experts)
    return a.view(experts, -1, a.shape[-1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1), wrapper.scaling[adapter]


def _chain(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """``(the module under every ParamWrapper, [the wrappers, outermost first])``."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = []
    while isinstance(module, ParamWrapper):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def _fits(experts: nn.Module, wrappers: list[nn.Module]) -> bool:
    """Whether :func:`experts_forward` computes ``experts`` under ``wrappers``: GPT-OSS-style experts (gated,
    biased, 3-D ``gate_up_proj`` / ``down_proj``) and one wrapper at most per expert tensor."""
    names = [w.parameter_name for w in wrappers]
    if not wrappers or len(set(names)) != len(names) or not set(names) <= set(EXPERT_TENSORS):
        return False
    parts = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    if not all(isinstance(getattr(experts, p, None), torch.Tensor) for p in parts) or not hasattr(experts, "_apply_gate"):
        return False
    return experts.gate_up_proj.dim() == 3 and not getattr(experts, "is_concatenated", False)


def _factors(wrappers: list[nn.Module]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None:
    """``{tensor name: expert_factors}`` of the wrappers that add a delta now, or None when PEFT's forward must
    run the call (a merged wrapper, several active adapters, or no delta at all)."""
    out = {}
    for wrapper in wrappers:
        if wrapper.merged:
            return None
        if wrapper.disable_adapters:
            continue
        active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if len(active) > 1:
            return None
        if active:
            out[wrapper.parameter_name] = expert_factors(wrapper, active[0])
    return out or None


def _forward(wrapper: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward :func:`install` gives the outermost wrapper; PEFT's own for the calls listed in the module
    docstring."""
    experts, wrappers = _chain(wrapper)
    factors = None
    if len(args) == 2 and not kwargs and args[0].shape == args[1].shape and hidden_states.dim() == 2:
        factors = _factors(wrappers)
    if factors is None:
        return type(wrapper).forward(wrapper, hidden_states, *args, **kwargs)
    return experts_forward(experts, hidden_states, args[0], args[1], factors)


def install(model: nn.Module) -> int:
    """Give every PEFT-wrapped GPT-OSS experts module in ``model`` the unmerged forward (see the module
    docstring); idempotent. Returns how many experts modules now use it (0 for a model without LoRA on experts)."""
    nested = {id(w) for m in model.modules() for w in _chain(m)[1][1:]}
    count = 0
    for module in model.modules():
        experts, wrappers = _chain(module)
        if id(module) in nested or not _fits(experts, wrappers):
            continue
        module.forward = functools.partial(_forward, module)
        count += 1
    return count


def remove(model: nn.Module) -> int:
    """Undo :func:`install`: the wrappers run PEFT's forward again (e.g. as a reference). Returns how many."""
    count = 0
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, functools.partial) and bound.func is _forward:
            del module.forward
            count += 1
    return count


class _Groups:
    """The rows of each expert in expert-sorted pairs: ``ends[e]`` is one past expert ``e``'s last row."""

    def __init__(self, sorted_experts: torch.Tensor, experts: int) -> None:
        ids = torch.arange(experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
        self.ends = torch.searchsorted(sorted_experts, ids, right=True)
        self.offsets = self.ends.to(torch.int32)
        self._spans: list[tuple[int, int, int]] | None = None

    def spans(self) -> list[tuple[int, int, int]]:
        """``[(expert, first row, end row)]`` of the experts hit (one host sync, then cached)."""
        if self._spans is None:
            ends = self.ends.tolist()
            self._spans = [(e, s, t) for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True)) if t > s]
        return self._spans


def _kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``grouped_mm``'s kernel accepts ``x`` ``[S, in]`` and ``w`` ``[E, in, out]`` as they are."""
    if _GROUPED_MM is None or x.dtype != w.dtype or x.device != w.device:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1) for t in (x, w)
    )


def _grouped(x: torch.Tensor, w: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """``x`` ``[S, in]`` (rows sorted by expert) times each row's expert's ``w`` ``[E, in, out]``: ``[S, out]``."""
    if _kernel_takes(x, w):
        return _GROUPED_MM(x, w, offs=groups.offsets)
    parts = [x[start:end] @ w[e] for e, start, end in groups.spans()]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _project(x: torch.Tensor, weight: torch.Tensor, groups: _Groups,
             factors: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor:
    """``x W_e + s (x A_e^T) B_e^T`` on each expert's rows (``weight`` ``[E, in, out]``)."""
    out = _grouped(x, weight, groups)
    if factors is not None:
        a, b, scale = factors
        low = _grouped(x.to(a.dtype), a.transpose(1, 2), groups)  # [S, r]
        out.add_(_grouped(low, b.transpose(1, 2).contiguous(), groups).to(out.dtype), alpha=scale)
    return out


def experts_forward(experts: nn.Module, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
    """The experts' output ``[N, H]`` for ``hidden`` ``[N, H]`` routed to ``indices`` ``[N, k]`` with gate weights
    ``weights`` ``[N, k]``, with each expert tensor in ``factors`` (:func:`expert_factors`, by tensor name) adding
    its unmerged delta. ``experts`` is the module under PEFT's wrappers (its ``gate_up_proj`` / ``down_proj``
    as ``[E, in, out]``, or ``[E, out, in]`` when its ``is_transposed`` is False)."""
    n, k = indices.shape
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if not getattr(experts, "is_transposed", True):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    groups = _Groups(sorted_experts, gate_up.shape[0])
    rows = hidden.to(gate_up.dtype)[order // k]  # [S, H], S = N*k pairs, sorted by expert
    up = _project(rows, gate_up, groups, factors.get("gate_up_proj"))
    act = experts._apply_gate(up.add_(experts.gate_up_proj_bias[sorted_experts]))
    out = _project(act, down, groups, factors.get("down_proj"))
    out = out.add_(experts.down_proj_bias[sorted_experts]) * weights.reshape(-1)[order, None]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(n, k, -1).sum(dim=1).to(hidden.dtype)
