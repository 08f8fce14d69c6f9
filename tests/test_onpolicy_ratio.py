"""The on-policy fix: old log-probs from the training forward itself make the PPO ratio exactly 1.

A separate old-log-prob pass with another micro-batching (batch size, padding length) runs different
kernels, so its log-probs differ from the training forward's by rounding noise, which a bf16 MoE model
amplifies (bf16 logits of trained-like magnitude, router near-ties). PPO then clips on noise at step 0.

Measured on this project's CPU machine (torch 2.13, 2026-11-30): CPU bf16 matmuls are batch-invariant
(bitwise equal log-probs for micro-batches of 1, 3, 5 and 16 rows, padded or not), so in bf16 the CPU shows
nothing to fix; CPU fp32 differs by ~1e-6 (matmuls over few rows take another kernel path). The CPU test
therefore uses fp32 and shows ratio != 1 without the fix and == 1 with it; the CUDA test shows the full
effect in bf16 (ratio != 1 and a nonzero clip fraction at clip 0.2 without the fix; ratio == 1 and clip
fraction 0 with it). Measured on an H200: clip fraction 0.66% and ratios 0.003..27 without the fix.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train.algorithms import is_on_policy, onpolicy_old_log_prob, policy_loss
from agentrl.train.logprobs import model_token_logprobs


def _setup(device, dtype, *, batch, seqlen, vocab, layers, experts, top_k, logit_scale):
    model = tiny_gpt_oss(
        num_layers=layers,
        hidden=64,
        experts=experts,
        top_k=top_k,
        vocab=vocab,
        seed=5,
        dtype=dtype,
        device=device,
    )
    with torch.no_grad():  # trained LMs have logits of magnitude ~10-30; random init gives ~0.2
        model.lm_head.weight.mul_(logit_scale)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seqlen), generator=g)
    lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=g)
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    return model, (ids * mask).to(device), mask.to(device), lengths


def ratio_stats(
    device="cpu",
    dtype=torch.float32,
    *,
    batch=8,
    seqlen=48,
    vocab=4096,
    layers=2,
    experts=8,
    top_k=2,
    logit_scale=1.0,
    prompt=8,
    clip=0.2,
):
    """Train forward on the padded batch; old log-probs from a separate no-grad pass with micro-batch 1
    (each row unpadded). Returns policy-loss metrics without and with the fix, and the max |log ratio|."""
    model, ids, mask, lengths = _setup(device, dtype, batch=batch, seqlen=seqlen, vocab=vocab, layers=layers,
                                       experts=experts, top_k=top_k, logit_scale=logit_scale)
    log_prob, _ = model_token_logprobs(model, ids, mask, response_start=prompt)
    old = torch.zeros_like(log_prob)
    with torch.no_grad():
        for i in range(batch):
            n = int(lengths[i])
            row, _ = model_token_logprobs(
                model, ids[i : i + 1, :n], mask[i : i + 1, :n], response_start=prompt
            )
            old[i, : n - prompt] = row[0]
    response_mask = mask[:, prompt:].float()
    adv = torch.randn(log_prob.shape, generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(log_prob=log_prob, advantages=adv, response_mask=response_mask, clip_ratio=clip)
    _, without = policy_loss("vanilla", old_log_prob=old, **kw)
    fixed_old = onpolicy_old_log_prob(log_prob, optimizer_steps=1)
    loss, with_fix = policy_loss("vanilla", old_log_prob=fixed_old, **kw)
    loss.backward()
    max_abs = ((log_prob.detach() - old).abs() * response_mask).max().item()
    return without, with_fix, max_abs, model


def _assert_fixed(with_fix):
    assert with_fix["actor/ppo_ratio_max"] == 1.0 and with_fix["actor/ppo_ratio_min"] == 1.0
    assert with_fix["actor/pg_clipfrac"] == 0.0 and with_fix["actor/pg_clipfrac_lower"] == 0.0
    assert with_fix["actor/ppo_kl"] == 0.0


def test_separate_pass_breaks_ratio_and_fix_restores_it_cpu_fp32():
    without, with_fix, max_abs, model = ratio_stats()
    assert max_abs > 0  # the separate pass really differs
    assert without["actor/ppo_ratio_max"] != 1.0 or without["actor/ppo_ratio_min"] != 1.0
    _assert_fixed(with_fix)
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bf16 GPU kernels are batch-variant")
def test_separate_pass_clips_on_noise_and_fix_removes_it_cuda_bf16():
    without, with_fix, max_abs, _ = ratio_stats(
        "cuda",
        torch.bfloat16,
        batch=16,
        seqlen=256,
        vocab=201088,
        layers=4,
        experts=32,
        top_k=4,
        logit_scale=60.0,
    )
    print(f"\nbf16 cuda: max|dlogp|={max_abs:.4f} without fix: {without}\nwith fix: {with_fix}")
    assert max_abs > 0
    assert without["actor/pg_clipfrac"] > 0
    _assert_fixed(with_fix)


def test_is_on_policy():
    assert is_on_policy(optimizer_steps=1)
    assert not is_on_policy(optimizer_steps=2) and not is_on_policy(optimizer_steps=0)
    lp = torch.randn(2, 3, requires_grad=True)
    old = onpolicy_old_log_prob(lp, optimizer_steps=1)
    assert torch.equal(old, lp) and not old.requires_grad
    assert onpolicy_old_log_prob(lp, optimizer_steps=2) is None
    with pytest.raises(ValueError, match=">= 0"):
        is_on_policy(optimizer_steps=-1)

