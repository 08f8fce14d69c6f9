"""LoRA through PEFT at the model level (CPU, fp32, tiny GPT-OSS MoE and a tiny Llama): only the adapter trains,
the adapters-off reference is the base model bit for bit, the on-policy ratio stays exactly 1, checkpoints hold
the adapter only and resume bit for bit, routing replay and chunked log-probs see through the adapter, a run
directory loads merged, and FSDP2 shards a LoRA model on 2 CPU processes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny_llama import tiny_llama
from _tiny_update import ragged_batch
from _torchrun import torchrun

from agentrl.models import expert_lora, lora
from agentrl.models.routing import find_routers, record_routing, replay_routing
from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train.checkpoint import load_checkpoint, save_checkpoint
from agentrl.train.config import build_config
from agentrl.train.logprobs import backbone_token_logprobs
from agentrl.train.update import batched_logprobs, run_update

V = 100  # ragged_batch draws ids below 100


def _gpt_oss(seed: int = 0, **kwargs):
    return tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=kwargs.pop("vocab", V), seed=seed,
                        **kwargs).train()


def _lora_gpt_oss(rank: int = 4, seed: int = 0):
    """``(base copy, LoRA model)``: a tiny GPT-OSS with the default targets, adapters made non-zero."""
    model = _gpt_oss(seed)
    base = copy.deepcopy(model)
    lora.apply_lora(model, lora.LoraSpec(rank=rank), seed=1)
    _perturb(model)
    return base, model


@torch.no_grad()
def _perturb(model, scale: float = 0.3, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    for _, p in lora.adapter_parameters(model):
        p.add_(torch.randn(p.shape, generator=g) * scale)


def _cfg(*extra: str):
    return build_config(["env=retool", "actor.grad_clip=1e9", "actor.lr=1e-2", *extra])


def _batch(model, n: int = 6, seed: int = 0):
    """A ragged batch whose rollout log-probs are the model's own (rewards vary within groups)."""
    batch = ragged_batch(n, seed)
    batch.rollout_log_probs = batched_logprobs(model, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    return batch


# ---------------------------------------------------------------------------- targets and what trains
def test_lora_default_targets_per_architecture_and_clear_errors(monkeypatch):
    gpt_oss, llama = _gpt_oss(), tiny_llama()
    assert lora.resolve_targets(gpt_oss, []) == (lora.ATTENTION, lora.GPT_OSS_EXPERTS)
    assert lora.resolve_targets(llama, []) == (lora.ATTENTION + lora.DENSE_MLP, [])
    assert lora.resolve_targets(gpt_oss, ["v_proj", "down_proj"]) == (["v_proj"], ["down_proj"])
    for names, match in ((["qproj"], "matches no linear layer.*q_proj"), (["mlp.router"], "MoE router"),
                         (["lm_head"], "chunked log-probs")):
        with pytest.raises(ValueError, match=match):
            lora.resolve_targets(gpt_oss, names)
    with pytest.raises(ValueError, match="cannot apply dropout.*actor.lora.dropout=0"):
        lora.apply_lora(_gpt_oss(), lora.LoraSpec(rank=2, dropout=0.1))
    counts = lora.apply_lora(llama, lora.LoraSpec(rank=2, dropout=0.1))  # dropout on linear layers is fine
    assert 0 < counts["trainable"] < counts["total"]
    import peft

    monkeypatch.setattr(peft, "__version__", "0.16.0")
    with pytest.raises(ImportError, match="target_parameters.*peft>=0.17"):
        lora.apply_lora(_gpt_oss(), lora.LoraSpec(rank=2))


def test_lora_only_adapter_parameters_train():
    model = _gpt_oss()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    counts = lora.apply_lora(model, lora.LoraSpec(rank=4), seed=1)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in lora.adapter_parameters(model)] and counts["trainable"] > 0
    assert any("mlp.experts" in n for n in trainable) and any("self_attn.q_proj" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):  # B starts at zero: the first step moves B only, the second A too
        m = run_update(model=model, optimizer=optimizer, batch=_batch(model, seed=step), cfg=_cfg(),
                       temperature=1.0).metrics
        assert m["actor/optimizer_steps"] == 1.0 and m["actor/grad_norm"] > 0
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if "lora_" not in n}
    assert after.keys() == before.keys()  # the base weights sit under ``base_layer`` now, bit for bit unchanged
    assert all(torch.equal(after[name], value) for name, value in before.items())
    adapters = dict(lora.adapter_parameters(model))
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in adapters.items() if "lora_B" in n)


# ---------------------------------------------------------------------------- reference, ratio, log-probs
def test_lora_reference_with_adapters_off_is_the_base_model_exactly():
    base, model = _lora_gpt_oss()
    batch = _batch(base)
    args = dict(micro_batch_size=2, chunk_size=5, temperature=1.0)
    with lora.adapters_disabled(model):
        off = batched_logprobs(model, batch, **args)
    assert torch.equal(off, batched_logprobs(base, batch, **args))
    assert not torch.equal(batched_logprobs(model, batch, **args), off)  # the adapter is back on after
    # the KL loss against the policy itself (LoRA: its base model) equals the KL against a frozen base copy
    cfg = _cfg("actor.use_kl_loss=true", "actor.kl_loss_coef=0.5")
    with_self = copy.deepcopy(model)
    m_self = run_update(model=with_self, optimizer=torch.optim.SGD(list(with_self.parameters()), lr=0.0),
                        batch=batch, cfg=cfg, temperature=1.0, ref_model=with_self).metrics
    m_copy = run_update(model=model, optimizer=torch.optim.SGD(list(model.parameters()), lr=0.0), batch=batch,
                        cfg=cfg, temperature=1.0, ref_model=base).metrics
    assert m_self["actor/kl_loss"] > 0 and m_self["actor/kl_loss"] == m_copy["actor/kl_loss"]
    assert m_self["actor/grad_norm"] == m_copy["actor/grad_norm"] > 0  # the adapter trains again after the pass
    with pytest.raises(ValueError, match="carries no LoRA adapter"):
        run_update(model=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.0), batch=batch, cfg=cfg,
                   temperature=1.0, ref_model=base)


def test_lora_on_policy_ratio_is_exactly_one():
    _, model = _lora_gpt_oss()
    batch = _batch(model)
    batch.rollout_log_probs = batch.rollout_log_probs + 0.01  # an engine gap: the ratio must not see it
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    m = run_update(model=model, optimizer=optimizer, batch=batch, cfg=_cfg("actor.micro_batch_size=2"),
                   temperature=1.0).metrics
    assert m["actor/on_policy"] == 1.0 and m["actor/optimizer_steps"] == 1.0
    assert m["actor/ppo_ratio_max"] == 1.0 and m["actor/ppo_ratio_min"] == 1.0
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/ppo_kl"] == 0.0 and m["actor/grad_norm"] > 0


def test_lora_chunked_logprobs_equal_unchunked():
    _, model = _lora_gpt_oss()
    ids = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def run(chunk: int | None):
        model.zero_grad()
        if chunk is None:  # the plain way: full [B, S, V] logits
            logits = model(input_ids=ids, attention_mask=mask).logits[:, 3:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None]).squeeze(-1) * mask[:, 4:]
        else:
            lp, _ = backbone_token_logprobs(model, ids, mask, response_start=4, chunk_size=chunk)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in lora.adapter_parameters(model)}

    plain, plain_grads = run(None)
    for chunk in (1, 7, 1024):
        lp, grads = run(chunk)
        torch.testing.assert_close(lp, plain, atol=1e-5, rtol=1e-5)
        for name, g in plain_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().max()) > 0 for n, g in plain_grads.items() if "experts" in n)


def test_lora_gradient_checkpointing_gives_the_same_gradients():
    """Frozen embeddings feed checkpointed layers: the adapter's gradients must still arrive (transformers
    makes the embeddings' output require grad), equal to those without checkpointing."""
    _, model = _lora_gpt_oss()
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(8))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.zero_grad()
        lp, _ = backbone_token_logprobs(model, ids)
        lp.sum().backward()
        grads.append({n: p.grad for n, p in lora.adapter_parameters(model)})
    assert all(g is not None and float(g.abs().max()) > 0 for n, g in grads[1].items() if "lora_B" in n)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5)


def test_lora_shared_prefix_forward_equals_the_plain_forward():
    """A dense model's training forward runs the rows' common prompt prefix once (prefix sharing, on by default):
    with LoRA adapters it still gives the plain forward's log-probs and adapter gradients."""
    from agentrl.harmony.trajectory import Trajectory
    from agentrl.train.batch import collate
    from agentrl.train.update import forward_logprobs

    model = tiny_llama()
    lora.apply_lora(model, lora.LoraSpec(rank=4))
    _perturb(model)
    prefix = list(range(10, 50))  # longer than prefix sharing's 32-token minimum
    batch = collate([Trajectory(prompt_ids=prefix + [5 + i], response_ids=[60 + i, 70, 80 - i][: 1 + i],
                                response_mask=[1] * (1 + i), rollout_logprobs=[0.0] * (1 + i)) for i in range(3)],
                    [0, 0, 1])
    from agentrl.train.prefix_sharing import shared_prefix_logprobs

    assert shared_prefix_logprobs(model, batch, chunk_size=5, temperature=1.0, compute_entropy=False) is not None
    results = []
    for share in (True, False):
        model.zero_grad()
        lp, _ = forward_logprobs(model, batch, chunk_size=5, temperature=1.0, compute_entropy=False, share_prefix=share)
        (lp * batch.response_mask).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in lora.adapter_parameters(model)}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for name, g in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], g, atol=1e-5, rtol=1e-4)


def test_lora_routing_replay_reaches_routers_through_the_adapter():
    _, model = _lora_gpt_oss()
    assert len(find_routers(model)) == 2  # the routers sit beside the wrapped experts, untouched
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=ids)
    recorded = rec.routing()
    _perturb(model, scale=3.0, seed=9)  # the adapter moves: natural routing now differs
    seen = []
    hooks = [mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())) for mlp, _ in
             find_routers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    natural = torch.stack([s.reshape(2, 12, -1) for s in seen])
    assert not torch.equal(natural.sort(-1).values, recorded.sort(-1).values)
    seen.clear()
    with replay_routing(model, recorded):
        lp, _ = backbone_token_logprobs(model, ids)
        lp.sum().backward()
    for h in hooks:
        h.remove()
    forced = torch.stack([s.reshape(2, 12, -1) for s in seen])
    assert torch.equal(forced, recorded)
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for n, p in lora.adapter_parameters(model)
               if "experts" in n and "lora_B" in n)


def test_lora_routing_replay_survives_gradient_checkpointing_in_the_update():
    """The update replays the rollout's experts in the forward and keeps replaying while checkpointed layers are
    recomputed in the backward: the gradients equal those without checkpointing."""
    from agentrl.models.routing import split_by_mask
    from agentrl.train.update import _trimmed, forward_logprobs

    _, model = _lora_gpt_oss()
    batch = _batch(model)
    attn = _trimmed(batch)[1]
    with torch.no_grad(), record_routing(model) as rec:
        forward_logprobs(model, batch, chunk_size=1024, temperature=1.0, compute_entropy=False)
    routing = split_by_mask(rec.routing(), attn)
    _perturb(model, scale=3.0, seed=5)  # natural routing now differs from the recorded one
    grads = []
    for checkpointing in (False, True):
        trained = copy.deepcopy(model)
        if checkpointing:
            trained.gradient_checkpointing_enable()
        params = [p for p in trained.parameters() if p.requires_grad]
        run_update(model=trained, optimizer=torch.optim.SGD(params, lr=0.0), batch=batch,
                   cfg=_cfg("actor.micro_batch_size=3"), temperature=1.0, routing=routing)
        grads.append({n: p.grad for n, p in lora.adapter_parameters(trained)})
    assert any(float(g.abs().max()) > 0 for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5)


def test_lora_sink_attention_matches_eager():
    pytest.importorskip("triton")
    from agentrl.kernels import register_transformers_attention

    register_transformers_attention("agentrl_sink")
    _, eager = _lora_gpt_oss()
    sink = copy.deepcopy(eager)
    sink.set_attn_implementation("agentrl_sink")
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    results = []
    for model in (eager, sink):
        lp, _ = backbone_token_logprobs(model, ids, mask, response_start=4)
        lp.sum().backward()
        results.append((lp.detach(), {n: p.grad for n, p in lora.adapter_parameters(model)}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------- checkpoints
def _train_steps(model, optimizer, steps: range):
    for step in steps:
        run_update(model=model, optimizer=optimizer, batch=_batch(model, seed=step), cfg=_cfg(),
                   temperature=1.0, generator=torch.Generator().manual_seed(step))


def _lora_and_optimizer(seed: int):
    model = _gpt_oss()
    lora.apply_lora(model, lora.LoraSpec(rank=4, alpha=16), seed=seed)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_lora_checkpoint_holds_the_adapter_only_and_resume_is_bit_exact(tmp_path):
    model, optimizer = _lora_and_optimizer(seed=1)
    _train_steps(model, optimizer, range(2))  # B moves at step 1, A from step 2: Adam holds state for both
    ckpt = save_checkpoint(str(tmp_path), step=2, data_position=8, model=model, optimizer=optimizer)
    assert sorted(os.listdir(ckpt)) == ["adapter", "optimizer.pt", "rng.pt", "state.json"]
    assert sorted(os.listdir(os.path.join(ckpt, "adapter"))) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    _, saved = lora.read_adapter(os.path.join(ckpt, "adapter"))
    adapters = lora.adapter_parameters(model)
    assert len(saved) == len(adapters) and all(".lora_" in k for k in saved)
    optim_state = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)["state"]
    assert len(optim_state) == len(adapters)  # Adam state of the adapter alone
    _train_steps(model, optimizer, range(2, 3))
    expected = {n: p.detach().clone() for n, p in adapters}

    resumed, resumed_opt = _lora_and_optimizer(seed=7)  # another init: everything must come from the checkpoint
    assert load_checkpoint(ckpt, model=resumed, optimizer=resumed_opt)["data_position"] == 8
    _train_steps(resumed, resumed_opt, range(2, 3))
    for name, param in lora.adapter_parameters(resumed):
        assert torch.equal(param, expected[name]), name

    with pytest.raises(ValueError, match="holds a LoRA adapter but this run trains the full model"):
        full = _gpt_oss()
        load_checkpoint(ckpt, model=full, optimizer=torch.optim.AdamW(full.parameters()))
    other, other_opt = _gpt_oss(), None
    lora.apply_lora(other, lora.LoraSpec(rank=8))
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="adapter settings .* differ"):
        load_checkpoint(ckpt, model=other, optimizer=other_opt)


def test_lora_run_directory_loads_base_plus_adapter_merged(tmp_path):
    from agentrl.models.loading import load_model

    model = load_model("tiny-gpt-oss", model_kwargs={"num_layers": 1}, seed=3).model
    lora.apply_lora(model, lora.LoraSpec(rank=4))
    _perturb(model)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: tiny-gpt-oss\nmodel_kwargs:\n  num_layers: 1\nseed: 3\nformat: auto\n")
    save_checkpoint(str(run), step=1, data_position=0, model=model,
                    optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0))
    loaded = load_model(str(run))
    assert loaded.checkpoint.endswith("step_000001") and not lora.has_lora(loaded.model)
    assert not lora.lora_layers(loaded.model) and loaded.format_name == "harmony"
    ids = torch.tensor([[200006, 9, 17, 3, 44, 2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    # the files are PEFT's own format: peft loads them onto the base model and gets the same model
    from peft import PeftModel

    base = load_model("tiny-gpt-oss", model_kwargs={"num_layers": 1}, seed=3).model
    peft_model = PeftModel.from_pretrained(base, str(run / "checkpoints" / "step_000001" / "adapter"))
    expert_lora.remove(model)  # PEFT's own expert forward on both sides, so the same adapter gives the same bits
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, model(ids).logits)


def test_lora_adapter_attaches_from_a_peft_config_dict_as_a_weight_sync_sends_it():
    """What a rollout engine does with verl's LoRA weight sync (``peft_config`` dict + adapter tensors under PEFT's
    names): the same adapter on its own copy of the base model, computing exactly what the trainer computes."""
    base, model = _lora_gpt_oss()
    config = model.peft_config[lora.ADAPTER_NAME].to_dict()
    state = lora.adapter_state_dict(model)
    assert all(k.startswith("base_model.model.model.layers.") for k in state)
    rollout_side = copy.deepcopy(base)
    lora.attach_adapter(rollout_side, config, state)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(rollout_side(ids).logits, model(ids).logits)
    _perturb(model, seed=11)  # the next sync: same settings, new tensors, no re-injection
    lora.attach_adapter(rollout_side, config, lora.adapter_state_dict(model))
    with torch.no_grad():
        assert torch.equal(rollout_side(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="do not fit this model's adapter"):
        lora.attach_adapter(rollout_side, config, dict(list(state.items())[1:]))


@pytest.mark.parametrize("arch", ["gpt_oss", "llama"])
def test_lora_adapter_keys_are_the_names_peft_itself_gives(arch):
    """agentrl names the adapter's tensors from the parameter names alone (:func:`lora.adapter_key`: the same under
    every PEFT version and for FSDP2 shards, with no PEFT call); the names must be PEFT's own, the fused experts'
    nested ``ParamWrapper`` included, so the files load into ``PeftModel`` and vLLM and PEFT's files load here."""
    from peft import get_peft_model_state_dict

    model = _gpt_oss() if arch == "gpt_oss" else tiny_llama(0, vocab=V)
    lora.apply_lora(model, lora.LoraSpec(rank=4), seed=1)
    _perturb(model)
    theirs = {lora.PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
    mine = lora.adapter_state_dict(model)
    assert sorted(mine) == sorted(theirs) and len(mine) == len(lora.adapter_parameters(model))
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (arch == "gpt_oss") == any(".mlp.experts.base_layer.lora_A.weight" in k for k in mine)


# ---------------------------------------------------------------------------- FSDP2, 2 CPU processes
@pytest.mark.distributed
def test_lora_fsdp2_on_two_cpu_processes(tmp_path):
    out = tmp_path / "result.json"
    torchrun([str(Path(__file__).parent / "_fsdp2_lora_worker.py"), "--out", str(out), "--run-dir", str(tmp_path / "run")])
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["trainable_only_adapter"]
    ref, fsdp = r["ref"], r["fsdp"]
    assert ref["actor/grad_norm"] > 0.01
    assert abs(fsdp["actor/grad_norm"] - ref["actor/grad_norm"]) <= 1e-5 * ref["actor/grad_norm"]
    # One AdamW step at lr 1e-2 moves each element by about lr * g / (|g| + eps): an element whose gradient is near
    # eps turns the float32 summation-order error of g (two ranks against one process) into a visible step
    # difference (8e-6 seen), while a wrong gradient or a missed shard moves elements by ~lr.
    assert r["adapter_max_abs_diff"] < 2e-3 * 1e-2 and r["base_unchanged"]
    assert r["checkpoint_files"] == ["adapter", "optimizer.pt", "rng.pt", "state.json"]
    assert r["reloaded_equal_fsdp"] and r["reloaded_equal_single_process"]


def test_lora_kl_reference_of_a_base_with_dropout_is_deterministic():
    """A base whose config has dropout: the adapters-off reference runs in eval mode like a separate base copy
    (before, the policy's train mode made the reference random), and the policy is back in train mode after."""
    model = tiny_llama(0, vocab=V, attention_dropout=0.5, attn_implementation="eager").train()
    base = copy.deepcopy(model).eval()
    lora.apply_lora(model, lora.LoraSpec(rank=4), seed=1)
    _perturb(model)
    batch = _batch(base)
    cfg = _cfg("actor.use_kl_loss=true", "actor.kl_loss_coef=0.5")
    results = []
    for ref in ("self", "self", "copy"):
        policy = copy.deepcopy(model).train()
        torch.manual_seed(7)  # the same dropout draws in the policy's forward each time
        results.append(run_update(model=policy, optimizer=torch.optim.SGD(list(policy.parameters()), lr=0.0),
                                  batch=batch, cfg=cfg, temperature=1.0,
                                  ref_model=policy if ref == "self" else base).metrics)
        assert all(m.training for m in policy.modules())
    assert results[0]["actor/kl_loss"] > 0
    assert results[0]["actor/kl_loss"] == results[1]["actor/kl_loss"] == results[2]["actor/kl_loss"]
    assert results[0]["actor/grad_norm"] == results[2]["actor/grad_norm"]


def test_adapter_config_lists_target_modules_in_the_same_order_whatever_the_hash_seed(tmp_path):
    """PEFT keeps target_modules as a set; the file must not depend on PYTHONHASHSEED (the repro comparison of
    two identical LoRA runs would flag it)."""
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    code = ("import sys, torch; from peft import LoraConfig; from agentrl.models import lora; "
            f"lora.save_adapter(sys.argv[1], {{'w': torch.zeros(1)}}, LoraConfig(r=2, target_modules={names!r}))")
    texts = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(lora.__file__).parents[2])}
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=120)
        texts.append((out / lora.CONFIG_FILE).read_text())
    assert texts[0] == texts[1]
    assert json.loads(texts[0])["target_modules"] == sorted(names)


def test_lora_initial_adapters_depend_on_seed_and_name_only_not_on_creation_order():
    """PEFT draws the ``A`` factors from the global RNG in the order it creates the adapters, and 0.22 creates
    GPT-OSS's expert adapters before the attention ones (0.21 the reverse). Each adapter must start from the seed
    and its own name alone: the same tensors whether or not the other kind is targeted too, and whatever the
    global RNG holds; ``B`` zero, so the model is unchanged; another seed, other tensors."""
    def adapters(targets, rng_seed, seed=7):
        model = _gpt_oss(0)
        torch.manual_seed(rng_seed)
        lora.apply_lora(model, lora.LoraSpec(rank=4, target_modules=targets), seed=seed)
        return {lora.adapter_key(n): p.detach().clone() for n, p in lora.adapter_parameters(model)}

    both = adapters(lora.ATTENTION + lora.GPT_OSS_EXPERTS, 0)
    attention, experts = adapters(lora.ATTENTION, 1), adapters(lora.GPT_OSS_EXPERTS, 2)
    assert attention and experts and set(both) == set(attention) | set(experts)
    for key, tensor in {**attention, **experts}.items():
        assert torch.equal(tensor, both[key]), key
    assert all(not t.any() for k, t in both.items() if ".lora_B." in k)
    assert all(t.abs().sum() > 0 for k, t in both.items() if ".lora_A." in k)
    reseeded = adapters(lora.ATTENTION, 0, seed=8)
    assert not any(torch.equal(reseeded[k], attention[k]) for k in attention if ".lora_A." in k)
