"""The device sampler: per-request keyed uniforms, draws that follow the distribution, truncation, log-probs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.engines.decode.sampling import request_key, sample_tokens, truncate, uniforms  # noqa: E402
from agentrl.engines.transformers_engine import _filter_logits  # noqa: E402


def test_uniforms_are_a_pure_function_of_key_and_counter():
    keys = torch.tensor([request_key("a", i) for i in range(64)])
    counters = torch.arange(64)
    u = uniforms(keys, counters)
    perm = torch.randperm(64)
    assert torch.equal(uniforms(keys[perm], counters[perm]), u[perm])  # row order does not matter
    assert torch.equal(uniforms(keys[:5], counters[:5]), u[:5])  # nor batch size
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert request_key("a", 1) == request_key("a", 1) != request_key("a", 2)
    assert 0 <= request_key("x") < 2**62


def test_uniforms_are_uniform_and_independent_of_neighbouring_keys():
    n = 200_000
    u = uniforms(torch.full((n,), request_key("one request")), torch.arange(n))
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001
    v = uniforms(torch.arange(n) + 1, torch.zeros(n, dtype=torch.int64))  # consecutive keys, first token
    assert abs(float(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1])) < 0.01


def test_draws_follow_softmax_of_logits_over_temperature():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 40_000
    temperature = 0.5
    logits = (torch.log(probs) * temperature).expand(n, -1)  # softmax(logits / 0.5) == probs
    ids, lp = sample_tokens(logits, torch.full((n,), temperature), torch.full((n,), request_key(3)), torch.arange(n))
    freq = torch.bincount(ids, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.01)
    assert torch.allclose(lp, torch.log(probs)[ids], atol=1e-6)


def test_greedy_rows_take_the_argmax_and_report_log_softmax_of_logits():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, 0.0, 3.0]])
    ids, lp = sample_tokens(logits, torch.zeros(2), torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert ids.tolist() == [1, 0]  # ties: the first maximum, as torch.argmax
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[torch.arange(2), ids])


def test_truncation_matches_the_transformers_engine_filter():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    for k, p in [(5, 1.0), (0, 0.7), (3, 0.5), (50, 0.99)]:
        ours = truncate(logits, torch.full((6,), k) if k else None, torch.full((6,), p) if p < 1 else None, k_cap=max(k, 1))
        assert torch.equal(torch.isinf(ours), torch.isinf(_filter_logits(logits, k, p)))


def test_truncated_draws_stay_in_the_kept_set_and_log_prob_is_untruncated():
    torch.manual_seed(1)
    n = 2000
    logits = torch.randn(1, 30).expand(n, -1)
    keys = torch.full((n,), request_key("k"))
    ids, lp = sample_tokens(logits, torch.ones(n), keys, torch.arange(n), top_k=torch.full((n,), 3), k_cap=3)
    assert set(ids.tolist()) <= set(torch.topk(logits[0], 3).indices.tolist())
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[torch.arange(n), ids])
    per_row = sample_tokens(logits[:4], torch.ones(4), keys[:4], torch.arange(4),
                            top_k=torch.tensor([0, 1, 0, 1]), k_cap=1)[0]
    assert per_row[1] == per_row[3] == logits[0].argmax()  # top-k=1 rows are greedy, the others are not limited
