"""Skipping the backward of a micro-batch whose loss has exactly zero gradient (GRPO's flat groups).

A GRPO group whose samples all got one reward has advantage exactly 0 on every token
(:func:`~agentrl.train.algorithms.compute_advantages`). Under the policy losses of :data:`ZERO_ADVANTAGE_LOSSES`
every token's loss is the advantage times a factor of the log-prob (``-A * ratio``, clipped, times the
rollout-correction weight; CISPO's ``-sg(w) * A * log_prob``), so when the advantage is 0 on every token of a
micro-batch's loss mask, and the forward is finite, the backward of its loss writes exactly zero into every
gradient it reaches: every path from the loss to a weight goes through a product with 0. The update then runs
the micro-batch's forward and loss as before (its old log-probs, entropy, policy-loss metrics and the loss
normalisers of the step are unchanged) and does not run its backward; :func:`record_zero_gradients` writes the
zeros that backward would have left where nothing else wrote yet (so AdamW treats each weight as before: a
weight with a zero gradient still gets its momentum and decay step, one without a gradient does not).

The result is the same to the bit as with the backward: adding an exact zero to a gradient changes no value.
It holds only when the loss has no other term, so :func:`skip_allowed` requires ``actor.entropy_coeff == 0``,
no KL loss (no reference model), one process (FSDP's collectives need every rank's backward), a policy loss of
:data:`ZERO_ADVANTAGE_LOSSES`, no backward hooks on the model's modules or trainable weights, and ``actor.skip_zero_advantage_backward``.
A micro-batch is skipped only when, besides, its log-probs, entropies and loss are all finite (a non-finite
forward makes a non-finite gradient, which the step must still see). Plain autograd is assumed inside the
model: a tensor hook that changed a zero gradient into a non-zero one would break the equality.
"""

from __future__ import annotations

from typing import Any

import torch

#: policy losses whose per-token loss is the advantage times a finite factor of the log-prob (see module docstring)
ZERO_ADVANTAGE_LOSSES = frozenset({"vanilla", "gspo", "cispo"})

#: autograd nodes that hide weights from the graph or run code in the backward: never skip past them
_OPAQUE_NODES = ("CheckpointFunctionBackward", "BackwardHookFunctionBackward")


def skip_allowed(actor: Any, *, has_reference: bool, distributed: bool, model: torch.nn.Module) -> bool:
    """Whether this update's loss is the policy loss alone, so a zero-advantage micro-batch has a zero gradient
    (module docstring): ``actor`` is the config's ``actor`` section, ``has_reference`` whether a KL reference
    pass ran, ``distributed`` whether this is one rank of several; ``model`` (the policy) must carry no module
    backward hooks and no hooks on its trainable weights."""
    return (
        bool(actor.skip_zero_advantage_backward)
        and actor.entropy_coeff == 0
        and not has_reference
        and not distributed
        and actor.policy_loss in ZERO_ADVANTAGE_LOSSES
        and not any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())
        and not any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                    for p in model.parameters() if p.requires_grad)
    )


def zero_gradient(advantages: torch.Tensor, loss_mask: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """True when the loss over ``loss_mask`` (after rejection) has advantage exactly 0 on every token and the
    forward's ``tensors`` (log-probs, entropies, the loss) are all finite."""
    if advantages[loss_mask.bool()].any():
        return False
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def record_zero_gradients(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> bool:
    """Write what ``loss.backward()`` of a zero-gradient ``loss`` would write: a zero gradient into every weight
    of ``params`` that the loss's graph reaches and that has no gradient yet (one that has keeps its value, as
    ``+ 0`` keeps it). Returns False, writing nothing, when the graph has a node that hides weights or runs
    hooks (a reentrant checkpoint, a module backward hook): the caller then runs the backward."""
    missing = {id(p) for p in params if p.grad is None}
    if not missing or loss.grad_fn is None:
        return True
    reached: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name().startswith(_OPAQUE_NODES):
            return False
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the weight it writes
        if variable is not None:
            reached.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    for p in reached:
        if id(p) in missing and p.grad is None:
            p.grad = torch.zeros_like(p)
    return True
