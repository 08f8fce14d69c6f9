"""The trainer's unmerged expert LoRA forward (agentrl/models/expert_lora.py) against PEFT's ``target_parameters``
wrapper on a tiny GPT-OSS (CPU): logits and every adapter gradient agree, with and without routing replay, on both
grouped-GEMM paths (torch's grouped_mm kernel and the loop over experts); the adapter's parameters stay the very
tensors PEFT created; calls that are not plain LoRA go back to PEFT's forward."""

from __future__ import annotations

import copy

import pytest
import torch
from peft.tuners.lora.layer import ParamWrapper

from agentrl.models import expert_lora, lora
from agentrl.models.routing import record_routing, replay_routing
from agentrl.models.tiny import tiny_gpt_oss

V = 128


def _pair(rank: int, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(ours, PEFT's)``: the same tiny GPT-OSS with the same non-zero adapters; PEFT's runs its own forward (and,
    in float64, which transformers' grouped_mm kernel refuses, transformers' eager experts)."""
    model = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=V, seed=0).train()
    lora.apply_lora(model, lora.LoraSpec(rank=rank), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.to(dtype)
    peft = copy.deepcopy(model)
    assert expert_lora.remove(peft) == 2
    if dtype == torch.float64:
        peft.set_experts_implementation("eager")
    return model, peft


def _logits_and_grads(model, ids, routing=None):
    model.zero_grad()
    if routing is None:
        logits = model(input_ids=ids).logits
    else:
        with replay_routing(model, routing):
            logits = model(input_ids=ids).logits
    logits.log_softmax(-1)[..., :7].mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in lora.adapter_parameters(model)}


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, True), (torch.float32, False), (torch.float64, True)],
                         ids=["fp32-kernel", "fp32-loop", "fp64-loop"])
@pytest.mark.parametrize("replay", [False, True], ids=["natural", "replay"])
def test_logits_and_adapter_gradients_equal_peft(dtype, kernel, replay, monkeypatch):
    """In float32 all 12 grouped GEMMs (2 layers x 2 projections x base, A, B) run through torch's grouped_mm, or,
    with it switched off, through the loop over experts; float64, which the kernel refuses, runs the loop."""
    ours, peft = _pair(4, dtype)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    routing = None
    if replay:
        with torch.no_grad(), record_routing(ours) as rec:
            ours(input_ids=ids)
        routing = rec.routing()
        routing[:, 0, 15:] = -1  # the tail of a row routes normally
        routing[:, 1, :5] = torch.flip(routing[:, 1, :5], dims=[-1])  # same experts, other top-k order
    folds, kernel_calls = [], []
    monkeypatch.setattr(ParamWrapper, "_activate_lora", _counting(ParamWrapper._activate_lora, folds))
    grouped_mm = expert_lora._GROUPED_MM
    monkeypatch.setattr(expert_lora, "_GROUPED_MM", _counting(grouped_mm, kernel_calls) if kernel else None)
    got_logits, got = _logits_and_grads(ours, ids, routing)
    assert folds == []  # PEFT's fold of W + s B A never ran
    assert len(kernel_calls) == (12 if kernel and dtype == torch.float32 else 0)
    want_logits, want = _logits_and_grads(peft, ids, routing)
    assert len(folds) == 4  # PEFT's forward folds each of the 2 layers' 2 expert tensors
    tol = 1e-5 if dtype == torch.float32 else 1e-12  # of the tensor's largest magnitude (rounding only)
    assert _rel(got_logits, want_logits) < tol
    experts = [n for n in want if ".experts." in n]
    assert len(experts) == 8 and all(float(want[n].abs().max()) > 1e-3 for n in experts)
    for name, g in want.items():
        assert _rel(got[name], g) < tol, name


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_in_float32_it_is_as_close_to_the_float64_function_as_peft():
    """Against the float64 forward (where both agree to 1e-12), the unmerged float32 forward's logits and gradients
    err no more than PEFT's folded one (within a factor 2 of rounding noise)."""
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(6))
    truth_logits, truth = _logits_and_grads(_pair(4, torch.float64)[0], ids)
    (ours_logits, ours), (peft_logits, peft) = (_logits_and_grads(m, ids) for m in _pair(4, torch.float32))
    assert _rel(ours_logits.double(), truth_logits) <= 2 * _rel(peft_logits.double(), truth_logits)
    ours_err = max(_rel(ours[n].double(), g) for n, g in truth.items())
    assert ours_err <= 2 * max(_rel(peft[n].double(), g) for n, g in truth.items())


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_the_adapter_parameters_are_the_same_tensors_and_copies_keep_their_own_forward():
    ours, _ = _pair(4, torch.float32)
    before = [(n, id(p)) for n, p in ours.named_parameters()]
    keys = list(ours.state_dict())
    assert expert_lora.remove(ours) == 2 and expert_lora.install(ours) == 2 and expert_lora.install(ours) == 2
    assert [(n, id(p)) for n, p in ours.named_parameters()] == before and list(ours.state_dict()) == keys
    outer = ours.model.layers[0].mlp.experts
    assert isinstance(outer, ParamWrapper) and isinstance(outer.base_layer, ParamWrapper)
    assert "forward" not in outer.base_layer.__dict__  # only the outermost wrapper's forward is replaced

    # an optimizer built on the adapter trains the tensors the forward reads
    params = [p for _, p in lora.adapter_parameters(ours)]
    opt = torch.optim.SGD(params, lr=0.5)
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(4))
    before_logits, _ = _logits_and_grads(ours, ids)
    opt.step()
    stepped = copy.deepcopy(ours)
    assert stepped.model.layers[0].mlp.experts.forward.args[0] is stepped.model.layers[0].mlp.experts
    expert_lora.remove(stepped)
    with torch.no_grad():
        after, want = ours(input_ids=ids).logits, stepped(input_ids=ids).logits
    assert float((after - before_logits).abs().max()) > 1e-3
    torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)


def test_adapters_off_and_attached_adapters():
    """Adapters disabled: PEFT's forward runs (the base model bit for bit). attach_adapter (a weight sync into
    a plain model) installs the same forward."""
    ours, peft = _pair(4, torch.float32)
    base = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=V, seed=0).train()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with lora.adapters_disabled(ours):
            assert torch.equal(ours(input_ids=ids).logits, base(input_ids=ids).logits)
        lora.attach_adapter(base, ours.peft_config[lora.ADAPTER_NAME], lora.adapter_state_dict(ours))
        assert expert_lora.remove(copy.deepcopy(base)) == 2
        torch.testing.assert_close(base(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
