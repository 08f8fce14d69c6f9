"""freeze(): named parameter groups of GPT-OSS and Llama models."""

from __future__ import annotations

import pytest
import torch

from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train.freeze import GROUPS, freeze


def _frozen_names(model):
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def test_each_group_on_gpt_oss():
    expected = {
        "attention": 16,  # 2 layers x 4 projections x (weight, bias)
        "sinks": 2,
        "router": 4,
        "experts": 8,
        "embeddings": 1,
        "lm_head": 1,
    }
    for group, n_tensors in expected.items():
        model = tiny_gpt_oss(vocab=256, seed=0)
        total = sum(p.numel() for p in model.parameters())
        counts = freeze(model, [group])
        frozen = _frozen_names(model)
        assert len(frozen) == n_tensors, (group, frozen)
        assert all(GROUPS[group].search(n) for n in frozen)
        assert counts[group] == sum(p.numel() for n, p in model.named_parameters() if n in frozen)
        assert counts["trainable"] == total - counts[group]


def test_frozen_params_get_no_grad_and_others_do():
    model = tiny_gpt_oss(vocab=256, seed=0)
    freeze(model, ["router", "embeddings", "sinks"])
    model.train()
    model(input_ids=torch.randint(0, 256, (2, 8)), labels=torch.randint(0, 256, (2, 8))).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), name
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_unknown_and_unmatched_groups():
    model = tiny_gpt_oss(vocab=256, seed=0)
    with pytest.raises(ValueError, match=r"valid groups: \['attention', 'embeddings', 'experts', 'lm_head'"):
        freeze(model, ["attn"])
    dense = torch.nn.Module()
    dense.lm_head = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="'router' matches no parameter"):
        freeze(dense, ["router"])
    assert all(p.requires_grad for p in model.parameters())
