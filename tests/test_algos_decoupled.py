"""Decoupled PPO (issue 33, part 2) against a hand-computed reference: per token, in float64 Python arithmetic,
``w * L_clip(pi_theta / pi_prox)`` with ``w = pi_prox / pi_behav`` truncated (TIS), masked (IcePop) or with
tokens rejected, on random inputs of several dtypes and masks; the gradient too."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agentrl.train.algorithms import decoupled_ppo_loss  # noqa: E402

CLIP_LO, CLIP_HI, CLIP_C = 0.2, 0.28, 3.0

MODES = {
    "none": {},
    "tis_token": dict(rollout_is="token", rollout_is_threshold=1.5),
    "tis_sequence": dict(rollout_is="sequence", rollout_is_threshold=3.0),
    "icepop": dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
    "reject_token_k1": dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    "reject_seq_mean_k3": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05),
    "tis_and_reject": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k3",
                           rollout_rs_threshold=0.1),
}


def _inputs(seed: int, dtype: torch.dtype, b: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prox = behav + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3  # older weights sampled
    new = prox + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(torch.float64)
    mask[0] = 0  # a row without a model token
    mask[1, :3] = 1
    behav[mask == 0] = float("nan")  # junk outside the mask never counts
    return [x.to(dtype) for x in (behav, prox, new, adv)] + [mask.to(dtype)]


def _reference(behav, prox, new, adv, mask, mode):
    """Per-token float64 loops: (token-mean loss, d loss / d new, clip fraction, kept mask)."""
    b, t = mask.shape
    f = lambda x: [[float(x[i][j]) for j in range(t)] for i in range(b)]  # noqa: E731
    behav, prox, new, adv, mask = f(behav), f(prox), f(new), f(adv), f(mask)
    weight = [[1.0] * t for _ in range(b)]
    kept = [[mask[i][j] for j in range(t)] for i in range(b)]
    level, spec = mode.get("rollout_is"), mode.get("rollout_is_threshold")
    if level is not None:
        lo, hi = (float(x) for x in spec.split("_")) if isinstance(spec, str) else (None, float(spec))
        for i in range(b):
            row = math.exp(sum(prox[i][j] - behav[i][j] for j in range(t) if mask[i][j]))
            for j in range(t):
                w = math.exp(prox[i][j] - behav[i][j]) if level == "token" else row
                weight[i][j] = min(w, hi) if lo is None else (w if lo <= w <= hi else 0.0)
    for option in (mode.get("rollout_rs") or "").split(","):
        if not option:
            continue
        thr = mode["rollout_rs_threshold"]
        for i in range(b):
            k3 = [math.exp(prox[i][j] - behav[i][j]) - 1 - (prox[i][j] - behav[i][j]) for j in range(t)]
            n = sum(mask[i])
            for j in range(t):
                if option == "token_k1":  # pi_behav / pi_prox within [lo, hi]
                    lo, hi = (float(x) for x in thr.split("_"))
                    keep = lo <= math.exp(behav[i][j] - prox[i][j]) <= hi
                elif option == "token_k3":
                    keep = k3[j] <= thr
                else:  # seq_mean_k3
                    keep = sum(k3[q] for q in range(t) if mask[i][q]) / max(n, 1) <= thr
                if not keep:
                    kept[i][j] = 0.0
    count = sum(map(sum, kept))
    loss, clipped_tokens = 0.0, 0
    grad = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not kept[i][j]:
                continue
            a, r = adv[i][j], math.exp(new[i][j] - prox[i][j])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - CLIP_LO), 1 + CLIP_HI)
            ppo = max(unclipped, clipped)
            dual = a < 0 and ppo > -a * CLIP_C
            token = -a * CLIP_C if dual else ppo
            loss += weight[i][j] * token / count
            clipped_tokens += clipped > unclipped
            if unclipped >= clipped and not dual:
                grad[i][j] = weight[i][j] * -a * r / count
    return loss, grad, (clipped_tokens / count if count else 0.0), kept


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_loss_equals_the_hand_computed_reference(mode, dtype, seed):
    behav, prox, new, adv, mask = _inputs(seed, dtype)
    new = new.clone().requires_grad_(True)
    staleness = torch.randint(0, 3, mask.shape, generator=torch.Generator().manual_seed(seed))
    loss, metrics, kept = decoupled_ppo_loss(
        "vanilla", behaviour_log_prob=behav, proximal_log_prob=prox, log_prob=new, advantages=adv,
        response_mask=mask, clip_ratio_low=CLIP_LO, clip_ratio_high=CLIP_HI, clip_ratio_c=CLIP_C,
        loss_agg_mode="token-mean", staleness=staleness, **MODES[mode])
    loss.backward()
    up = lambda x: x.detach().to(torch.float64)  # noqa: E731 - the reference sees the values the loss saw
    want, want_grad, want_clipfrac, want_kept = _reference(up(behav), up(prox), up(new), up(adv), up(mask), MODES[mode])
    assert kept.dtype == mask.dtype and kept.tolist() == want_kept
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert loss.item() == pytest.approx(want, rel=tol, abs=tol)
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]  # the gradient's own dtype
    torch.testing.assert_close(new.grad.to(torch.float64), torch.tensor(want_grad, dtype=torch.float64),
                               rtol=grad_tol, atol=1e-7)
    if any(map(any, want_kept)):
        assert metrics["actor/pg_clipfrac"] == pytest.approx(want_clipfrac, abs=1e-6)
    m = mask.bool()
    gap = (up(prox) - up(behav)).abs()[m]
    assert metrics["decoupled/behav_prox_abs_gap_mean"] == pytest.approx(float(gap.mean()), rel=1e-5)
    assert metrics["decoupled/behav_prox_abs_gap_max"] == pytest.approx(float(gap.max()), rel=1e-5)
    assert metrics["decoupled/kept_fraction"] == pytest.approx(sum(map(sum, want_kept)) / float(mask.sum()))
    assert metrics["decoupled/staleness_mean"] == pytest.approx(float(staleness[m].double().mean()))
    assert metrics["decoupled/staleness_max"] == float(staleness[m].max())


def test_same_behaviour_and_proximal_is_plain_ppo_and_an_empty_mask_is_zero():
    behav, prox, new, adv, mask = _inputs(5, torch.float32)
    prox = torch.where(mask.bool(), prox, torch.zeros_like(prox))
    from agentrl.train.algorithms import policy_loss

    plain, _ = policy_loss("vanilla", old_log_prob=prox, log_prob=new, advantages=adv, response_mask=mask)
    ours, _, kept = decoupled_ppo_loss("vanilla", behaviour_log_prob=prox, proximal_log_prob=prox, log_prob=new,
                                       advantages=adv, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.equal(plain, ours) and torch.equal(kept, mask)
    zero, metrics, _ = decoupled_ppo_loss("vanilla", behaviour_log_prob=behav, proximal_log_prob=prox, log_prob=new,
                                          advantages=adv, response_mask=torch.zeros_like(mask), rollout_is="token")
    assert zero.item() == 0.0 and not any(k.startswith("decoupled/") for k in metrics)
    with pytest.raises(ValueError, match="unknown rollout_rs option"):
        decoupled_ppo_loss("vanilla", behaviour_log_prob=behav, proximal_log_prob=prox, log_prob=new, advantages=adv,
                           response_mask=mask, rollout_rs="token_k9", rollout_rs_threshold=1.0)
