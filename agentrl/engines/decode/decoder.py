"""The forward pass of a transformers causal LM over slot-cached sequences, built from the model's own modules.

:class:`SlotDecoder` runs a Llama-family model (``llama``, ``qwen2``, ``qwen3``: SmolLM2, Qwen, ...) or
GPT-OSS token by token against a :class:`~agentrl.engines.decode.slot_cache.SlotCache`, for prefill (many tokens
per row) and decoding (one per row), with no padding and no transformers cache object. It holds references
to the model's parameters and modules, not copies: an optimizer step on the model is what it computes with
next (except the fused projection weights below, which :meth:`sync_weights` refreshes).

Per layer: pre-norm, q/k/v projections, rotary embedding (from a table computed by the model's own rotary
module), keys/values stored at each token's ``(slot, position)``, attention through a callable that the
caller supplies (see :mod:`agentrl.engines.decode.slot_attention`), output projection, residual, post-norm, the
MLP (GPT-OSS: :class:`~agentrl.engines.decode.moe.SlotMoE`), residual; then the final norm and the LM head.

Two implementations of the small steps, one result:

* ``fused=False``: transformers' own modules and functions (its RMSNorm modules, ``apply_rotary_pos_emb``,
  the MLP module), so float32 results equal transformers' eager ones to rounding. The CPU path.
* ``fused=True`` (a GPU, or the Triton interpreter in tests): :mod:`agentrl.engines.decode.fused_ops` kernels,
  one fused q/k/v projection and, for SwiGLU MLPs, one fused gate/up projection, from weight copies that
  :meth:`sync_weights` refreshes in place when the model's parameters change.

**LoRA** (the trainer's PEFT model, :func:`agentrl.models.lora.apply_lora`): every projection runs as base
plus the adapter's unmerged delta (:mod:`agentrl.engines.decode.lora_delta`), GPT-OSS's experts per expert
(:class:`~agentrl.engines.decode.moe.SlotMoE`). The fused copies hold the base weights only; the deltas read the
live adapter parameters, so in-place adapter updates need no copy and no graph recapture.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.engines.decode import lora_delta
from agentrl.engines.decode.lora_delta import LinearLora
from agentrl.engines.decode.moe import SlotMoE

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gpt_oss")

#: ``attend(layer, q [N, Hq, D], sinks, window, scale) -> [N, Hq, D]``: attention of the new tokens.
AttendFn = Callable[[int, torch.Tensor, Any, Any, float], torch.Tensor]


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside ``model`` (a peft wrapper is looked through)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) and not hasattr(model, "lm_head") else model


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`SlotDecoder` cannot run ``model``, or ``None`` when it can."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    inner = getattr(lm, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(lm, "lm_head"):
        return "the model has no .model.layers / .lm_head (not a transformers causal LM layout)"
    rotary = getattr(inner, "rotary_emb", None)
    rope = getattr(rotary, "rope_type", "default")
    if rotary is None or any(word in str(rope) for word in ("dynamic", "longrope")):
        return f"rotary embedding {rope!r} depends on the sequence length"
    if any(getattr(p, "_local_tensor", None) is not None for p in lm.parameters()):
        return "the parameters are sharded (DTensor); gather them first"
    reason = lora_delta.unsupported_reason(lm)
    if reason is not None:
        return reason
    if model_type == "gpt_oss":
        mlp = inner.layers[0].mlp
        experts, _ = lora_delta.unwrap_experts(mlp.experts)
        if type(experts).__name__ != "GptOssExperts" or type(mlp.router).__name__ != "GptOssTopKRouter":
            return (f"the MoE block holds {type(experts).__name__}/{type(mlp.router).__name__}, not transformers' "
                    "GptOssExperts/GptOssTopKRouter")
    return None


@dataclass
class _Layer:
    """One decoder layer's modules and attention geometry."""

    attn: nn.Module
    mlp: nn.Module
    norm_in: nn.Module
    norm_post: nn.Module
    window: int | None
    scale: float
    moe: SlotMoE | None
    proj: dict[str, LinearLora]
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class SlotDecoder:
    """See the module docstring. ``model``: a supported transformers causal LM (see
    :func:`unsupported_reason`) on its device, in its dtype."""

    def __init__(self, model: nn.Module, *, fused: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the slot decoder cannot run this model: {reason}")
        self.lm = _causal_lm(model)
        self.base = self.lm.model
        config = self.lm.config
        self.model_type = config.model_type
        self.hidden = config.hidden_size
        self.hq = config.num_attention_heads
        self.hkv = getattr(config, "num_key_value_heads", None) or self.hq
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.hq
        self.n_layers = len(self.base.layers)
        self.vocab = config.vocab_size
        self.dtype = self.base.embed_tokens.weight.dtype
        self.device = self.base.embed_tokens.weight.device
        if fused and (self.head_dim & (self.head_dim - 1) or self.head_dim < 4):
            raise ValueError(f"fused kernels need a power-of-two head_dim, got {self.head_dim}")
        self.fused = fused
        self.cast_first = self.model_type != "gpt_oss"
        first_attn = self.base.layers[0].self_attn
        self._rope_fn = sys.modules[type(first_attn).__module__].apply_rotary_pos_emb
        self.layers = [self._layer(layer) for layer in self.base.layers]
        self.moe_layers = sum(1 for lay in self.layers if lay.moe is not None)
        self.top_k = self.layers[0].moe.top_k if self.moe_layers else 0
        self.cos = self.sin = self.cos_half = self.sin_half = None
        self._fingerprint: list[tuple[int, int]] | None = None
        self._ptrs: list[int] | None = None
        self.weights_ready = False

    def _layer(self, layer: nn.Module) -> _Layer:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        moe = SlotMoE(layer.mlp) if self.model_type == "gpt_oss" else None
        proj = {name: LinearLora(getattr(attn, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if moe is None and all(isinstance(getattr(layer.mlp, n, None), nn.Module) for n in _SWIGLU):
            proj.update({name: LinearLora(getattr(layer.mlp, name)) for name in _SWIGLU})
        return _Layer(attn=attn, mlp=layer.mlp, norm_in=layer.input_layernorm, norm_post=layer.post_attention_layernorm,
                      window=int(window) if window else None, scale=float(getattr(attn, "scaling", self.head_dim**-0.5)),
                      moe=moe, proj=proj, q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None))

    @property
    def sinks_used(self) -> bool:
        return self.model_type == "gpt_oss"

    # ------------------------------------------------------------------ tables and weights
    @torch.no_grad()
    def build_rope(self, length: int) -> None:
        """Rotary tables for positions ``0 .. length-1`` from the model's own rotary module: ``cos``/``sin``
        in its format and dtype (for transformers' ``apply_rotary_pos_emb``) and float32 half tables
        ``[length, D/2]`` (for the fused kernel)."""
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        cos, sin = self.base.rotary_emb(probe, positions)
        cos, sin = cos[0].float(), sin[0].float()
        half = self.head_dim // 2
        if cos.shape[-1] == self.head_dim:
            if not torch.equal(cos[:, :half], cos[:, half:]):
                raise ValueError("the rotary table's halves differ; this rotary layout is not supported")
            cos_half, sin_half = cos[:, :half], sin[:, :half]
        else:
            cos_half, sin_half = cos, sin
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)
        self.cos_half, self.sin_half = cos_half.contiguous(), sin_half.contiguous()

    def _parameters(self) -> list[torch.Tensor]:
        return list(self.lm.parameters())

    def lora_state(self) -> tuple:
        """The state of every LoRA layer (adapter in effect, scale): captured graphs depend on it."""
        return tuple((tuple(p.state() for p in lay.proj.values()), lay.moe.state() if lay.moe else ())
                     for lay in self.layers)

    def weights_changed(self) -> tuple[bool, bool]:
        """``(moved, updated)`` since the last call: some parameter got new storage or a LoRA layer was
        enabled, disabled or merged (captured graphs are stale), or some parameter was modified in place (fused
        copies are stale; deltas read the live adapters)."""
        params = self._parameters()
        ptrs = [p.data_ptr() for p in params] + [self.lora_state()]
        fingerprint = [(p.data_ptr(), p._version) for p in params]
        moved = self._ptrs is not None and ptrs != self._ptrs
        updated = fingerprint != self._fingerprint
        self._ptrs, self._fingerprint = ptrs, fingerprint
        return moved, updated

    @torch.no_grad()
    def sync_weights(self, rebuild: bool = False) -> None:
        """Copy the model's q/k/v (and gate/up) weights into the fused buffers (``fused=True`` only) and the
        expert adapters into their GEMM buffers, in place; ``rebuild`` (or a first call) allocates them."""
        self.weights_ready = True
        for lay in self.layers:
            if lay.moe is not None:
                lay.moe.sync(rebuild)
        if not self.fused:
            return
        for lay in self.layers:
            lay.qkv = _fuse([lay.proj[n].base for n in ("q_proj", "k_proj", "v_proj")], None if rebuild else lay.qkv)
            act = getattr(getattr(lay.mlp, "config", None), "hidden_act", None)
            if "gate_proj" in lay.proj and act == "silu":
                lay.gate_up = _fuse([lay.proj[n].base for n in ("gate_proj", "up_proj")], None if rebuild else lay.gate_up)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_positions: torch.Tensor, slots: torch.Tensor,
                cache: Any, attend: AttendFn, *, dense_moe: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32 ``[R, V]``) after feeding ``ids`` (``[N]``) at ``positions``; each token's key and
        value are stored at ``(slots, write_positions)``. ``rows``: indices of the tokens whose logits to
        return (default: every token)."""
        x = self.base.embed_tokens(ids)
        delta = None
        for index, lay in enumerate(self.layers):
            h, x = self._norm(lay.norm_in, x, delta)
            q = self._qkv_rope_store(index, lay, h, positions, write_positions, slots, cache)
            a = attend(index, q, lay.attn.sinks if self.sinks_used else None, lay.window, lay.scale)
            delta = lay.proj["o_proj"](a.reshape(a.shape[0], -1))
            h, x = self._norm(lay.norm_post, x, delta)
            delta = self._mlp(lay, h, dense_moe, (cache, index, slots, write_positions))
        h, _ = self._norm(self.base.norm, x, delta)
        if rows is not None:
            h = h[rows]
        return self.lm.lm_head(h).float()

    def _norm(self, norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from agentrl.engines.decode.fused_ops import rms_norm

            return rms_norm(x, norm.weight, _eps(norm), residual=delta, cast_first=self.cast_first)
        if delta is not None:
            x = x + delta
        return norm(x), x

    def _qkv_rope_store(self, index: int, lay: _Layer, h: torch.Tensor, positions: torch.Tensor,
                        write_positions: torch.Tensor, slots: torch.Tensor, cache: Any) -> torch.Tensor:
        """The rotated queries ``[N, Hq, D]``; keys and values stored in the cache."""
        n, d = h.shape[0], self.head_dim
        if lay.qkv is not None:
            qkv = F.linear(h, *lay.qkv)
            q, k, v = (lay.proj[name].add_delta(y, h) for y, name in
                       zip(qkv.split([self.hq * d, self.hkv * d, self.hkv * d], dim=1), ("q_proj", "k_proj", "v_proj"),
                           strict=True))
        else:
            q, k, v = lay.proj["q_proj"](h), lay.proj["k_proj"](h), lay.proj["v_proj"](h)
        if lay.q_norm is not None:
            q = lay.q_norm(q.view(n, self.hq, d)).view(n, -1)
            k = lay.k_norm(k.view(n, self.hkv, d)).view(n, -1)
        if self.fused:
            from agentrl.engines.decode.fused_ops import rope_store

            return rope_store(q, k, v, self.cos_half, self.sin_half, positions, write_positions, slots,
                              cache.keys(index), cache.values(index), layout=cache.layout)
        q, k = self._rope_fn(q.view(n, self.hq, d), k.view(n, self.hkv, d), self.cos[positions], self.sin[positions])
        cache.write(index, slots, write_positions, k, v.view(n, self.hkv, d))
        return q

    def _mlp(self, lay: _Layer, h: torch.Tensor, dense_moe: bool, record: tuple) -> torch.Tensor:
        if lay.moe is not None:
            cache, index, slots, positions = record
            moe_index = sum(1 for other in self.layers[:index] if other.moe is not None)
            rec = (cache, moe_index, slots, positions) if cache.routing is not None else None
            return lay.moe(h, dense=dense_moe, record=rec)
        proj = lay.proj
        if lay.gate_up is not None:
            from agentrl.engines.decode.fused_ops import silu_mul

            gate_up = F.linear(h, *lay.gate_up)
            if proj["gate_proj"].peft is not None or proj["up_proj"].peft is not None:
                gate, up = gate_up.chunk(2, dim=1)
                gate_up = torch.cat([proj["gate_proj"].add_delta(gate, h), proj["up_proj"].add_delta(up, h)], dim=1)
            return proj["down_proj"](silu_mul(gate_up))
        if "gate_proj" in proj and hasattr(lay.mlp, "act_fn"):  # LlamaMLP.forward, through the LoRA wrappers
            return proj["down_proj"](lay.mlp.act_fn(proj["gate_proj"](h)) * proj["up_proj"](h))
        return lay.mlp(h)


_SWIGLU = ("gate_proj", "up_proj", "down_proj")



def _fuse(modules: list[nn.Linear], into: tuple[torch.Tensor, torch.Tensor | None] | None
          ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The concatenated ``(weight, bias)`` of the (base) linear layers ``modules`` (rows stacked), written into
    ``into`` when given; ``None`` (run them one by one) when some have biases and some not."""
    weights = [m.weight for m in modules]
    biases = [m.bias for m in modules]
    has_bias = all(b is not None for b in biases)
    if not has_bias and any(b is not None for b in biases):
        return None
    if into is None:
        weight = torch.cat([w.detach() for w in weights]).contiguous()
        bias = torch.cat([b.detach() for b in biases]).contiguous() if has_bias else None
        return weight, bias
    weight, bias = into
    start = 0
    for i, w in enumerate(weights):
        weight[start : start + w.shape[0]].copy_(w)
        if bias is not None:
            bias[start : start + w.shape[0]].copy_(biases[i])
        start += w.shape[0]
    return weight, bias
