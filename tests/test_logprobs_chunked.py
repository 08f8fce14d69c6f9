"""chunked_logprobs equals the naive log-softmax (values and gradients) without building [N, V] logits."""

from __future__ import annotations

import pytest
import torch
from _tiny_llama import tiny_llama

from agentrl.train.logprobs import IGNORE_INDEX, chunked_logprobs, model_token_logprobs


def _naive(hidden, weight, labels, temperature=1.0):
    logits = (hidden @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    lp = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_fp64(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 301
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[3, 20]] = IGNORE_INDEX
    w_lp = torch.randn(N, generator=g, dtype=torch.float64)
    w_ent = torch.randn(N, generator=g, dtype=torch.float64)

    h1, W1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = chunked_logprobs(h1, W1, labels, chunk_size=chunk_size, temperature=temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    h2, W2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    # the naive path upcasts to fp32 like ours; compare in fp64 by skipping that cast
    logits = h2 @ W2.t() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    rlp = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid
    rent = -(logp_all.exp() * logp_all).sum(-1)
    ((rlp * w_lp).sum() + (rent * w_ent).sum()).backward()

    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
    assert lp[3] == 0 and lp[20] == 0
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=1e-4, atol=1e-5)


def test_fp32_and_no_entropy_and_frozen_head():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 8, generator=g, requires_grad=True)
    weight = torch.randn(999, 8, generator=g)  # frozen head: no weight grad requested
    labels = torch.randint(0, 999, (50,), generator=g)
    lp, ent = chunked_logprobs(hidden, weight, labels, chunk_size=16, compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    rlp, _ = _naive(ref_h, weight, labels)
    rlp.sum().backward()
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


def test_model_token_logprobs_gpt_oss():
    from agentrl.models.tiny import tiny_gpt_oss

    model = tiny_gpt_oss(vocab=512, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    lp, ent = model_token_logprobs(model, ids, mask, response_start=4, chunk_size=5, compute_entropy=True)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    ref = torch.log_softmax(logits[:, 3:-1], -1).gather(-1, ids[:, 4:, None]).squeeze(-1)
    assert lp.shape == (2, 8) and ent.shape == (2, 8)
    torch.testing.assert_close(lp, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="response_start"):
        model_token_logprobs(model, ids, mask, response_start=0)


def test_model_token_logprobs_llama_with_grad():
    model = tiny_llama(0, vocab=300, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, positions=64).eval()
    ids = torch.randint(0, 300, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding
    lp, _ = model_token_logprobs(model, ids, mask, response_start=3, chunk_size=4)
    lp.sum().backward()
    grad_chunked = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    ref = torch.log_softmax(logits[:, 2:-1], -1).gather(-1, ids[:, 3:, None]).squeeze(-1) * mask[:, 3:]
    ref.sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    assert lp[0, 4:].abs().sum() == 0  # padded positions
    torch.testing.assert_close(grad_chunked, model.lm_head.weight.grad, rtol=1e-4, atol=1e-5)
