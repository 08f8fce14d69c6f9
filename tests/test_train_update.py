"""update_policy: a batch without learning signal leaves the weights (and Adam state) untouched."""

from __future__ import annotations

import torch

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.batch import collate
from agentrl.train.config import build_config
from agentrl.train.update import update_policy


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def _batch(rewards):
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5], response_mask=[1, 1],
                        rollout_logprobs=[-1.0, -1.0], reward=r) for i, r in enumerate(rewards)]
    return collate(trajs, [0] * len(trajs))


def test_zero_signal_skips_the_optimizer_step():
    cfg = build_config(["env=retool"])
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = update_policy(model=model, optimizer=opt, batch=_batch([1.0, 0.0]), cfg=cfg, temperature=1.0)
    assert m["actor/grad_norm"] > 0 and "actor/zero_grad_steps_skipped" not in m
    after_real_step = {k: v.detach().clone() for k, v in model.named_parameters()}
    m = update_policy(model=model, optimizer=opt, batch=_batch([1.0, 1.0]), cfg=cfg, temperature=1.0)
    assert m["actor/grad_norm"] == 0.0 and m["actor/zero_grad_steps_skipped"] == 1.0
    for k, v in model.named_parameters():  # Adam's momentum would have moved them
        assert torch.equal(v, after_real_step[k]), k
