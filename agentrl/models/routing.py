"""MoE routing replay for GPT-OSS: record the experts chosen at rollout, force them in the training forward.

Why: in a MoE model the rollout (KV-cached, token-by-token generation, maybe another batch layout or
kernel) and the training forward (one full-sequence pass) compute slightly different router logits, and
near-ties flip which experts a token uses. A flipped expert changes the token's log-prob far more than
ordinary rounding does, which inflates the rollout-vs-train log-prob gap and the importance ratios.
Replaying the rollout's expert choice in the training forward removes that source of mismatch.

How: transformers' ``GptOssMLP`` calls ``self.router(hidden [N, H])`` (``GptOssTopKRouter``), which returns
``(router_logits [N, E], router_scores [N, k], router_indices [N, k])`` in transformers 5.x, or
``(dense_scores [N, E], router_indices [N, k])`` in older releases. Inside the context managers below,
each router's ``forward`` is replaced on that module instance only (restored on exit, also on error), and
a pre-hook on its MLP reads the ``[B, S]`` layout of the call. Nothing global is patched.

* :class:`record_routing` stores every call's ``router_indices`` as ``[B, S_call, k]`` and concatenates the
  calls along the sequence: for ``generate`` with a KV cache that is the prefill, then one position per
  decoding step. ``routing()`` returns ``[L, B, S_rec, k]`` int64 aligned with the generated sequences'
  positions ``0 .. S_rec-1`` (the final sampled token is never fed back, so ``S_rec = S_total - 1``).
* :class:`replay_routing` takes ``[L, B, S, k]`` (``-1`` = route this token normally) and in every router
  call of a full-sequence forward uses the given experts; the gate weights are recomputed as the softmax
  of the *current* router logits gathered at the forced experts, so gradients still reach the router.
  Records shorter than the forward's sequence are padded with ``-1`` on the right. A call whose ``[B, S]``
  layout does not match raises, so a misaligned replay fails loudly.
* :func:`split_by_mask` / :func:`align_to_mask` move records between padded layouts (e.g. left-padded
  generation vs right-padded training) through per-sample ``[L, n_i, k]`` tensors, which is what a
  completion carries.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

_PATCHED = "_agentrl_routing_patched"


def find_routers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``[(mlp, router), ...]`` in layer order for GPT-OSS-style MoE blocks (an ``mlp`` with a ``router``)."""
    found = [
        (m, m.router)
        for m in model.modules()
        if isinstance(getattr(m, "router", None), nn.Module) and hasattr(m.router, "top_k")
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no MoE router modules (expected GPT-OSS's mlp.router "
            "with a top_k attribute); routing replay applies to MoE models only"
        )
    return found


class _RouterPatch(abc.ABC):
    """Shared plumbing: patch each router's forward and hook its MLP for the ``[B, S]`` layout."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.pairs = find_routers(model)
        self._layout: list[tuple[int, int] | None] = [None] * len(self.pairs)
        self._handles: list = []

    @abc.abstractmethod
    def _wrap(self, layer: int, router: nn.Module, original):
        """The replacement forward for ``router`` (layer ``layer``); ``original`` is its own forward."""

    def __enter__(self):
        self._saved: list = []
        for layer, (mlp, router) in enumerate(self.pairs):
            if getattr(router, _PATCHED, False):
                self.__exit__(None, None, None)
                raise RuntimeError(
                    "a router is already patched: routing record/replay contexts cannot be nested"
                )
            # an instance-level forward set by someone else (e.g. accelerate's offload hooks) is wrapped, and
            # put back on exit
            self._saved.append(router.__dict__.get("forward"))
            setattr(router, _PATCHED, True)

            def pre_hook(module, args, kwargs, layer=layer):
                hidden = args[0] if args else kwargs["hidden_states"]
                self._layout[layer] = (
                    (hidden.shape[0], hidden.shape[1]) if hidden.dim() == 3 else (1, hidden.shape[0])
                )

            self._handles.append(mlp.register_forward_pre_hook(pre_hook, with_kwargs=True))
            router.forward = self._wrap(layer, router, router.forward)
        return self

    def __exit__(self, *exc):
        for (_, router), saved in zip(self.pairs, self._saved, strict=False):
            router.__dict__.pop(_PATCHED, None)
            router.__dict__.pop("forward", None)
            if saved is not None:
                router.forward = saved
        self._saved = []
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


def _split_output(out) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(logits or None, topk_scores or None, indices)`` from either router output convention."""
    if not isinstance(out, tuple) or len(out) not in (2, 3) or out[-1].is_floating_point():
        raise TypeError("unrecognised router output: expected (logits, scores, indices) or (scores, indices)")
    if len(out) == 3:
        return out[0], out[1], out[2]
    return None, None, out[1]


class record_routing(_RouterPatch):
    """Context manager recording the experts each token was routed to (see the module docstring).

    >>> with record_routing(model) as rec:
    ...     out = model.generate(input_ids, attention_mask=mask, do_sample=True, max_new_tokens=32)
    >>> routing = rec.routing()  # [L, B, out.shape[1] - 1, k]
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._calls: list[list[torch.Tensor]] = [[] for _ in self.pairs]

    def _wrap(self, layer, router, original):
        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            idx = _split_output(out)[2]
            b, s = self._layout[layer]
            self._calls[layer].append(idx.detach().reshape(b, s, -1).to("cpu", torch.int64))
            return out

        return forward

    def routing(self) -> torch.Tensor:
        """``[L, B, S_rec, k]`` int64 (CPU): calls concatenated along the sequence, per layer."""
        if not self._calls[0]:
            raise RuntimeError("nothing was recorded: run the model inside the record_routing context")
        per_layer = [torch.cat(calls, dim=1) for calls in self._calls]
        return torch.stack(per_layer)


class replay_routing(_RouterPatch):
    """Context manager forcing recorded experts in full-sequence forwards (see the module docstring).

    Args:
      model: the MoE model; routing: ``[L, B, S_rec, k]`` integer experts, ``-1`` = route normally.
    Every router call inside the context must see the same ``[B, S]`` with ``S >= S_rec`` (a full forward,
    or its gradient-checkpointing recompute); ``replayed_fraction`` reports the share of forced tokens.
    """

    def __init__(self, model: nn.Module, routing: torch.Tensor):
        super().__init__(model)
        if routing.dim() != 4 or routing.shape[0] != len(self.pairs):
            raise ValueError(f"routing must be [L={len(self.pairs)}, B, S, k], got {tuple(routing.shape)}")
        k = self.pairs[0][1].top_k
        if routing.shape[-1] != k:
            raise ValueError(
                f"routing has {routing.shape[-1]} experts per token but the router's top_k is {k}"
            )
        n_exp = getattr(self.pairs[0][1], "num_experts", None)
        if n_exp is not None and int(routing.max()) >= n_exp:
            raise ValueError(f"routing names expert {int(routing.max())} but the model has {n_exp} experts")
        self.routing = routing.long()
        self.replayed_fraction = float((self.routing >= 0).all(-1).float().mean())

    def _forced(self, layer: int, device) -> torch.Tensor:
        b, s = self._layout[layer]
        rec = self.routing[layer]
        if rec.shape[0] != b or rec.shape[1] > s:
            raise ValueError(
                f"replay layout mismatch in layer {layer}: the forward has [B, S] = [{b}, {s}] but "
                f"routing was given for [{rec.shape[0]}, {rec.shape[1]}]; replay needs a full-sequence "
                "forward over the same rows (use align_to_mask to re-pad records)"
            )
        if rec.shape[1] < s:
            rec = F.pad(rec, (0, 0, 0, s - rec.shape[1]), value=-1)
        return rec.reshape(b * s, -1).to(device)

    def _wrap(self, layer, router, original):
        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            logits, _, natural = _split_output(out)
            forced = self._forced(layer, natural.device)
            keep_natural = (forced < 0).any(dim=-1, keepdim=True)
            idx = torch.where(keep_natural, natural, forced)
            if logits is None:
                flat = hidden_states.reshape(-1, router.weight.shape[1])
                logits = F.linear(flat, router.weight, router.bias)
            top = logits.gather(1, idx)
            scores = torch.softmax(top, dim=1, dtype=top.dtype)
            if len(out) == 3:
                return logits, scores, idx
            return torch.zeros_like(logits).scatter(1, idx, scores), idx

        return forward


def split_by_mask(routing: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample records ``[L, n_i, k]`` of the positions where ``attention_mask[:, :S_rec]`` is 1."""
    s = routing.shape[2]
    keep = attention_mask[:, :s].bool().cpu()
    return [routing[:, i, keep[i]] for i in range(routing.shape[1])]


def align_to_mask(samples: list[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_by_mask` for any padding: ``[L, B, S, k]`` with sample ``i``'s records at the
    first ``n_i`` positions where ``attention_mask[i]`` is 1, and ``-1`` everywhere else."""
    if len(samples) != attention_mask.shape[0]:
        raise ValueError(f"{len(samples)} routing records for {attention_mask.shape[0]} rows")
    layers, _, k = samples[0].shape
    bsz, seqlen = attention_mask.shape
    out = torch.full((layers, bsz, seqlen, k), -1, dtype=torch.long)
    for i, rec in enumerate(samples):
        pos = attention_mask[i].bool().cpu().nonzero().squeeze(-1)
        if rec.shape[1] > pos.numel():
            raise ValueError(
                f"row {i}: {rec.shape[1]} recorded tokens but only {pos.numel()} unmasked positions"
            )
        out[:, i, pos[: rec.shape[1]]] = rec
    return out
