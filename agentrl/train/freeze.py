"""Freeze named parameter groups of a transformers causal LM (GPT-OSS, Llama and alike).

Groups (matched on parameter names of the HF module tree):
  ``attention``: attention projections ``self_attn.{q,k,v,o}_proj`` (weights and biases), not the sinks.
  ``sinks``: GPT-OSS attention-sink logits ``self_attn.sinks``.
  ``router``: MoE router ``mlp.router``.
  ``experts``: MoE expert weights ``mlp.experts``.
  ``embeddings``: token embeddings ``embed_tokens``.
  ``lm_head``: the output projection ``lm_head`` (when tied to the embeddings, the shared tensor is frozen
    for both).
"""

from __future__ import annotations

import re

from torch import nn

GROUPS: dict[str, re.Pattern[str]] = {
    "attention": re.compile(r"(^|\.)self_attn\.(q_proj|k_proj|v_proj|o_proj)\."),
    "sinks": re.compile(r"(^|\.)self_attn\.sinks$"),
    "router": re.compile(r"(^|\.)mlp\.router\."),
    "experts": re.compile(r"(^|\.)mlp\.experts\."),
    "embeddings": re.compile(r"(^|\.)embed_tokens\."),
    "lm_head": re.compile(r"(^|\.)lm_head\."),
}


def freeze(model: nn.Module, groups: list[str]) -> dict[str, int]:
    """Set ``requires_grad=False`` on every parameter in ``groups``.

    Returns ``{group: number of parameter elements frozen}`` for each requested group, plus
    ``"trainable"``: elements still trainable afterwards. Raises ValueError for an unknown group (listing
    the valid ones) or a group that matches no parameter of this model (e.g. ``router`` on a dense model).
    """
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown freeze group(s) {unknown}; valid groups: {sorted(GROUPS)}")
    counts: dict[str, int] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    for group in dict.fromkeys(groups):
        hits = [p for name, p in named if GROUPS[group].search(name)]
        if not hits:
            raise ValueError(
                f"freeze group {group!r} matches no parameter of {type(model).__name__}; "
                f"pattern {GROUPS[group].pattern!r}"
            )
        for p in hits:
            p.requires_grad_(False)
        counts[group] = sum(p.numel() for p in {id(p): p for p in hits}.values())
    counts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return counts
