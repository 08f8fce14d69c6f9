"""verl's ``agentrl`` rollout: registered in verl's two rollout registries, built by verl's own
``get_rollout_class`` against a tiny GPT-OSS, serving through its replica server, and synced with verl's
``update_weights`` (a weight update changes what it samples; syncing the old weights back restores it).

The fast tests run the adapter and the server in this process (the server reaches the adapter through a
direct call instead of Ray's ``__ray_call__``). ``test_full_verl_path_on_ray`` (slow: about 75 s on a
2-core machine) runs the same code the way verl's trainer does: Ray, verl's ``LLMServerManager`` (which
resolves our replica by name), verl's load balancer and ``LLMServerClient``, verl's
``CheckpointEngineManager`` (sleep, naive weight sync) and verl's ``AgentLoopWorker`` running our agent
loop. Only verl's FSDP hybrid-engine worker is replaced, by a Ray actor that builds the rollout and syncs
weights the way verl's ``ActorRolloutRefWorker`` does (verl's trainer cannot run on the CPU).
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("verl")

from _verl_test_env import register_multi_turn  # noqa: E402

pytestmark = pytest.mark.verl  # runs verl's own code: the verl tier

LAYERS, HIDDEN = 1, 64


def _verl_config(model_dir, train, val, **verl_extra):
    from agentrl.train.verl_backend.config_map import verl_overrides
    from agentrl.train.verl_backend.validate import compose_verl_config

    cfg = {"env": register_multi_turn(), "model": str(model_dir), "attn_implementation": "eager",
           "rollout": {"batch_size": 4, "n": 1, "temperature": 1.0},
           "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
           "verl": {"rollout": "agentrl", "max_prompt_length": 256, "max_response_length": 256,
                    "overrides": ["actor_rollout_ref.rollout.dtype=float32"], **verl_extra}}
    return compose_verl_config(verl_overrides(cfg, [str(train)], [str(val)]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GPT-OSS checkpoint directory (config + Harmony tokenizer: what verl's workers read), the
    dataset, and verl's composed config for ``verl.rollout=agentrl``."""
    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.models.tiny import tiny_gpt_oss
    from agentrl.train.verl_backend.dataset import write_env_dataset

    root = tmp_path_factory.mktemp("verl_rollout")
    model = tiny_gpt_oss(num_layers=LAYERS, hidden=HIDDEN, seed=0)
    model.config.architectures = ["GptOssForCausalLM"]
    model.config.save_pretrained(root / "model")
    harmony_hf_tokenizer().save_pretrained(root / "model")
    train, val = write_env_dataset(root / "data", register_multi_turn(), tasks="env", n_train=4, n_val=1,
                                   format="harmony", env_kwargs={"max_turns": 2}, max_new_tokens=6)
    return {"dir": root / "model", "train": train, "val": val, "config": _verl_config(root / "model", train, val)}


def _actor(seed):
    """The "trained" model a verl actor would hold: the same architecture, weights from ``seed``."""
    from agentrl.models.tiny import tiny_gpt_oss

    return tiny_gpt_oss(num_layers=LAYERS, hidden=HIDDEN, seed=seed)


def test_registered_in_both_verl_registries():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import agentrl.train.verl_backend.plugin as plugin
    from agentrl.train.verl_backend.rollout import AgentrlRollout
    from agentrl.train.verl_backend.rollout_server import AgentrlReplica

    assert plugin.REGISTERED["rollout"] == ["agentrl"] and "rollout" not in plugin.FAILED
    assert get_rollout_class("agentrl", "async") is AgentrlRollout
    assert get_rollout_replica_class("agentrl") is AgentrlReplica
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    assert {("vllm", "async"), ("sglang", "async"), ("agentrl", "async")} <= set(_ROLLOUT_REGISTRY)


def _teacher_forced_logprobs(model, prompt, tokens):
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def test_adapter_and_server_follow_verls_weight_sync(tiny):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    from agentrl.train.verl_backend.rollout import call_local
    from agentrl.train.verl_backend.rollout_server import AgentrlRolloutServer

    vcfg = tiny["config"]
    config = omega_conf_to_dataclass(vcfg.actor_rollout_ref.rollout)
    model_config = omega_conf_to_dataclass(vcfg.actor_rollout_ref.model)
    assert (config.name, config.load_format, config.free_cache_engine) == ("agentrl", "dummy", True)
    # what verl's hybrid-engine worker does with rollout.name=agentrl
    rollout = get_rollout_class(config.name, config.mode)(config=config, model_config=model_config, device_mesh=None)
    info = rollout.describe()
    assert info["model"] == "GptOssForCausalLM" and info["attn_implementation"] == "eager"
    assert (info["device"], info["dtype"]) == ("cpu", "float32")

    async def call(method, *args):
        return call_local(None, rollout.replica_rank, method, *args)

    server = AgentrlRolloutServer(config, rollout.replica_rank, [], info, call=call)
    prompts = [[200006, 17360, 200008, 1000 + i] for i in range(3)]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
              "max_tokens": 6, "stop_token_ids": []}

    def sample(params):
        async def run():
            return await asyncio.gather(*[server.generate(prompt_ids=p, sampling_params=dict(params),
                                                          request_id=f"r{i}") for i, p in enumerate(prompts)])
        return asyncio.run(run())

    with pytest.raises(RuntimeError, match="not the actor's"):  # dummy weights: verl syncs first
        sample(greedy)

    a, b = _actor(0), _actor(1)

    def sync(actor, step):
        asyncio.run(server.sleep())  # verl: sleep_replicas() -> frees the rollout's weights
        with pytest.raises(RuntimeError, match="not the actor's"):
            sample(greedy)
        asyncio.run(rollout.resume(tags=["weights"]))  # verl's naive update_weights on the worker
        asyncio.run(rollout.update_weights(iter(actor.state_dict().items()), global_steps=step,
                                           peft_config=None, base_sync_done=True))
        asyncio.run(rollout.resume(tags=["kv_cache"]))

    sync(a, 1)
    batches = rollout.engine.stats["batches"]
    out_a = sample(greedy)
    assert rollout.engine.stats["batches"] == batches + 1  # three concurrent requests, one batch
    for p, o in zip(prompts, out_a, strict=True):
        assert len(o.token_ids) == 6 and o.stop_reason == "completed" and o.extra_fields["global_steps"] == 1
        assert o.log_probs == pytest.approx(_teacher_forced_logprobs(a, p, o.token_ids), abs=1e-4)

    sync(b, 2)
    out_b = sample(greedy)
    assert all(o.extra_fields["global_steps"] == 2 for o in out_b)
    assert [o.token_ids for o in out_b] != [o.token_ids for o in out_a]  # the update changed the samples
    for p, o in zip(prompts, out_b, strict=True):
        assert o.log_probs == pytest.approx(_teacher_forced_logprobs(b, p, o.token_ids), abs=1e-4)

    sync(a, 3)
    assert [o.token_ids for o in sample(greedy)] == [o.token_ids for o in out_a]  # exactly the old weights again

    # sampled (temperature 1): exact log-probs of the sampled ids; per-request limits share one batch
    sampled = dict(greedy, temperature=1.0, seed=5)
    limits = [2, 6, 4]

    async def mixed():
        return await asyncio.gather(*[
            server.generate(prompt_ids=p, sampling_params=dict(sampled, max_tokens=n), request_id=f"m{i}")
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))])

    batches = rollout.engine.stats["batches"]
    out = asyncio.run(mixed())
    assert rollout.engine.stats["batches"] == batches + 1
    assert [len(o.token_ids) for o in out] == limits
    for p, o in zip(prompts, out, strict=True):
        assert o.log_probs == pytest.approx(_teacher_forced_logprobs(a, p, o.token_ids), abs=1e-4)
    no_lp = asyncio.run(server.generate(prompt_ids=prompts[0], sampling_params=dict(sampled, logprobs=False),
                                        request_id="x"))
    assert no_lp.log_probs is None and len(no_lp.token_ids) == 6

    # verl's defaults when a request names no limit / stop ids: response_length, the model's EOS ids
    assert server.default_stop == info["eos_token_ids"] != []
    with pytest.raises(ValueError, match="no room to generate"):
        asyncio.run(server.generate(prompt_ids=list(range(600)), sampling_params=greedy, request_id="long"))
    with pytest.raises(ValueError, match="repetition_penalty"):
        asyncio.run(server.generate(prompt_ids=prompts[0], sampling_params=dict(greedy, repetition_penalty=1.1),
                                    request_id="rp"))
    with pytest.raises(ValueError, match="text only"):
        asyncio.run(server.generate(prompt_ids=prompts[0], sampling_params=greedy, request_id="img",
                                    image_data=[object()]))


def test_weight_sync_refusals_and_routing_capture(tiny):
    import dataclasses

    import torch
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    from agentrl.engines.base import SamplingParams
    from agentrl.train.verl_backend.rollout import call_local
    from agentrl.train.verl_backend.rollout_server import AgentrlRolloutServer

    vcfg = tiny["config"]
    config = dataclasses.replace(omega_conf_to_dataclass(vcfg.actor_rollout_ref.rollout),
                                 enable_rollout_routing_replay=True)
    rollout = get_rollout_class("agentrl", "async")(
        config=config, model_config=omega_conf_to_dataclass(vcfg.actor_rollout_ref.model), device_mesh=None,
        replica_rank=7,
    )
    weights = dict(_actor(0).state_dict())

    def update(items, **kw):
        asyncio.run(rollout.update_weights(iter(items), global_steps=1, **kw))

    with pytest.raises(ValueError, match="did not cover 1 parameter"):
        update([(k, v) for k, v in weights.items() if k != "model.norm.weight"])
    with pytest.raises(KeyError, match="model.extra.weight"):
        update([*weights.items(), ("model.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        update([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(NotImplementedError, match="checkpoint_engine.backend=naive"):
        update([], wire_format="delta_flush")
    assert not rollout.synced  # a failed update leaves the rollout refusing to sample
    with pytest.raises(RuntimeError, match="not the actor's"):
        rollout.generate_batch([[1, 2]], SamplingParams(), [1])
    update(weights.items())
    assert rollout.synced and rollout.global_steps == 1

    # routing replay: the MoE experts chosen for every token fed, as verl's [tokens, layers, top_k]
    async def call(method, *args):
        return call_local(None, 7, method, *args)

    server = AgentrlRolloutServer(config, 7, [], rollout.describe(), call=call)
    prompt = [200006, 17360, 200008, 1000]
    out = asyncio.run(server.generate(prompt_ids=prompt, request_id="moe", sampling_params={
        "temperature": 1.0, "max_tokens": 4, "stop_token_ids": [], "logprobs": True}))
    assert len(out.token_ids) == 4 and out.extra_fields["global_steps"] == 1
    assert out.routed_experts.shape == (len(prompt) + 4 - 1, LAYERS, 2)  # the last sampled token was not fed
    assert ((out.routed_experts >= 0) & (out.routed_experts < 4)).all()


def _peft_actor(seed):
    """A LoRA actor as verl's FSDP engine builds it (``get_peft_model`` with ``target_modules`` and GPT-OSS's
    experts as ``target_parameters``), its adapter moved away from PEFT's init (B = 0) as training would."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, bias="none",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    actor = get_peft_model(_actor(0), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return actor.eval()


def _verl_lora_sync(actor, base_sync_done):
    """The tensors verl's FSDP engine sends for a LoRA actor (``get_per_tensor_param`` without an FSDP wrapper:
    verl's ``collect_lora_params``, ``replace_lora_wrapper`` on a base sync, ``convert_weight_keys``)."""
    from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper
    from verl.utils.model import convert_weight_keys

    config = actor.peft_config["default"]
    params = collect_lora_params(module=actor, layered_summon=False, base_sync_done=base_sync_done)
    if not base_sync_done:
        params = {replace_lora_wrapper(k, config): v for k, v in params.items()}
    return list(convert_weight_keys(params, actor).items()), config


def test_lora_weight_syncs_base_once_then_adapters_through_sleep(tiny):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    from agentrl.engines.base import SamplingParams
    from agentrl.models import lora

    vcfg = tiny["config"]
    rollout = get_rollout_class("agentrl", "async")(
        config=omega_conf_to_dataclass(vcfg.actor_rollout_ref.rollout),
        model_config=omega_conf_to_dataclass(vcfg.actor_rollout_ref.model), device_mesh=None, replica_rank=11)
    prompt = [200006, 17360, 200008, 1000]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=[])

    def update(items, **kw):
        asyncio.run(rollout.update_weights(iter(items), **kw))

    a, b = _peft_actor(1), _peft_actor(2)
    base, config = _verl_lora_sync(a, base_sync_done=False)
    assert any(".base_layer." in n for n, _ in base) and not any("lora_" in n for n, _ in base)
    adapter, _ = _verl_lora_sync(a, base_sync_done=True)
    assert adapter and all("lora_" in n for n, _ in adapter)
    with pytest.raises(RuntimeError, match="before the base weights"):  # dummy weights, no base sync yet
        update(adapter, peft_config=config, base_sync_done=True)
    update(base, peft_config=config, base_sync_done=False, global_steps=1)  # verl's first sync: the base
    with pytest.raises(RuntimeError, match="not the actor's"):  # the adapter has not arrived yet
        rollout.generate_batch([prompt], greedy, [5])
    update(adapter, peft_config=config, base_sync_done=True, global_steps=1)
    assert lora.has_lora(rollout.model)
    out_a = rollout.generate_batch([prompt], greedy, [5])[0][0]
    assert out_a.logprobs == pytest.approx(_teacher_forced_logprobs(a, prompt, out_a.token_ids), abs=1e-4)

    asyncio.run(rollout.release())  # verl's sleep before training: a LoRA rollout keeps its base weights
    assert not rollout._released
    update(_verl_lora_sync(b, base_sync_done=True)[0], peft_config=config, base_sync_done=True, global_steps=2)
    out_b = rollout.generate_batch([prompt], greedy, [5])[0][0]
    assert out_b.logprobs == pytest.approx(_teacher_forced_logprobs(b, prompt, out_b.token_ids), abs=1e-4)
    assert out_b.logprobs != pytest.approx(out_a.logprobs, abs=1e-4)  # the adapter sync changed the policy

    other = dict(config.to_dict(), r=8)
    with pytest.raises(ValueError, match="adapter settings"):
        update(adapter, peft_config=other, base_sync_done=True)


def test_split_moe_experts_are_packed_back():
    """verl's FSDP engine sends transformers-5 packed experts (Qwen-style MoE) split per expert
    (``unfuse_moe_params``); the loader packs them back into the rollout model's tensors."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from agentrl.train.verl_backend.rollout import WeightLoader

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=3,
                            num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(0)
    actor = Qwen3MoeForCausalLM(config)
    rollout = Qwen3MoeForCausalLM(config)
    sent = list(unfuse_moe_params(actor.state_dict().items(), "qwen3_moe"))
    assert any(".experts.2.up_proj.weight" in n for n, _ in sent)  # verl did split them
    loader = WeightLoader(rollout)
    for name, tensor in sent:
        loader.write(name, tensor)
    loader.finish()
    for (name, mine), theirs in zip(rollout.state_dict().items(), actor.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


@pytest.mark.slow
def test_full_verl_path_on_ray(tiny):
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.rollout.llm_server import LLMServerManager

    vcfg = tiny["config"]

    @ray.remote(num_cpus=0)
    class HybridWorker:
        """Stands in for verl's ActorRolloutRefWorker: builds the rollout as verl does and runs verl's naive
        weight sync (resume weights, update_weights from the actor's full tensors, resume kv_cache)."""

        def __init__(self, rollout_cfg, model_cfg):
            os.environ["RANK"] = "0"
            from verl.workers.rollout.base import get_rollout_class

            self.config = omega_conf_to_dataclass(rollout_cfg)
            self.train_to(0)
            self.rollout = get_rollout_class(self.config.name, self.config.mode)(
                config=self.config, model_config=omega_conf_to_dataclass(model_cfg), device_mesh=None)

        def train_to(self, seed):  # stands in for optimizer steps: the actor's weights change
            from agentrl.models.tiny import tiny_gpt_oss

            self.actor = tiny_gpt_oss(num_layers=LAYERS, hidden=HIDDEN, seed=seed)

        async def update_weights(self, global_steps=None, mode="naive"):
            assert mode == "naive"
            await self.rollout.resume(tags=["weights"])
            await self.rollout.update_weights(iter(self.actor.state_dict().items()), peft_config=None,
                                              base_sync_done=True, global_steps=global_steps)
            await self.rollout.resume(tags=["kv_cache"])

    class WorkerGroup:
        def __init__(self, workers):
            self.workers, self.world_size = workers, len(workers)

        def update_weights(self, global_steps=None, mode="naive"):
            return [w.update_weights.remote(global_steps=global_steps, mode=mode) for w in self.workers]

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        group = WorkerGroup([HybridWorker.remote(vcfg.actor_rollout_ref.rollout, vcfg.actor_rollout_ref.model)])
        manager = LLMServerManager.create(config=vcfg, worker_group=group)  # resolves "agentrl" -> our replica
        assert manager.get_addresses() == ["agentrl-replica-0"]
        sync_config = omega_conf_to_dataclass(vcfg.actor_rollout_ref.rollout.checkpoint_engine)
        sync_config.backend = "naive"  # what verl's v1 trainer uses for a hybrid engine
        weights = CheckpointEngineManager(config=sync_config, actor_wg=group, replicas=manager.get_replicas())
        client = manager.get_client()
        params = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
                  "max_tokens": 5, "stop_token_ids": []}

        def sample():
            async def run():
                return await asyncio.gather(*[client.generate(f"r{i}", prompt_ids=[200006, 17360, 1000 + i],
                                                              sampling_params=dict(params)) for i in range(3)])
            return asyncio.run(run())

        weights.sleep_replicas()  # verl's trainer: sleep after init, sync before the first rollout
        weights.update_weights(1)
        first = sample()
        assert all(o.extra_fields["global_steps"] == 1 and len(o.log_probs) == 5 for o in first)
        weights.sleep_replicas()
        ray.get(group.workers[0].train_to.remote(1))
        weights.update_weights(2)
        second = sample()
        assert [o.token_ids for o in second] != [o.token_ids for o in first]
        assert all(o.extra_fields["global_steps"] == 2 for o in second)

        # our agent loop, run by verl's AgentLoopWorker, through the same servers
        worker = AgentLoopWorker(vcfg, manager.get_client())
        dataset = RLHFDataset([tiny["train"]], worker.tokenizer, vcfg.data)
        rows = [dataset[i] for i in range(4)]
        out = asyncio.run(worker.generate_sequences(DataProto.from_single_dict(collate_fn(rows))))
        assert out.batch["responses"].shape == (4, 256)
        assert list(out.non_tensor_batch["__num_turns__"]) == [4, 4, 4, 4]  # 2 actions, 1 env answer
        sampled = out.batch["response_mask"].bool()
        assert bool((out.batch["rollout_log_probs"][sampled] < 0).all())
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "requested, installed, name, reason",
    [
        ("agentrl", {}, "agentrl", "verl.rollout=agentrl: agentrl's transformers engine"),
        ("auto", {"vllm": "0.11.0", "sglang": "0.5.0"}, "vllm", "verl.rollout=auto: vllm 0.11.0 is installed here"),
        ("auto", {"sglang": "0.5.0"}, "sglang", "verl.rollout=auto: sglang 0.5.0 is installed here"),
        ("auto", {}, "vllm", "verl.rollout=auto: neither vllm nor sglang is installed here, so it stays vllm"),
        ("sglang", {}, "sglang", "verl.rollout=sglang: sglang is NOT installed here"),
    ],
)
def test_dry_run_states_the_rollout_backend_and_why(tmp_path, monkeypatch, capsys, requested, installed, name, reason):
    from agentrl.train.verl_backend import rollout_backend
    from agentrl.train.verl_backend.launch import main, plan

    monkeypatch.setattr(rollout_backend, "installed_version", installed.get)
    cfg = {"env": register_multi_turn(), "model": "Qwen/Qwen3-0.6B", "run_dir": str(tmp_path / "run"),
           "rollout": {"batch_size": 4, "n": 2, "max_batch_size": 64}, "algorithm": {"adv_estimator": "grpo"},
           "trainer": {"n_gpus_per_node": 1, "nnodes": 1}, "verl": {"rollout": requested, "n_train_tasks": 4, "n_val_tasks": 1}}
    assert main(cfg, dry_run=True) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    at = lines.index(f"rollout backend: {name}")
    assert lines[at + 1] == f"  why: {plan(cfg).rollout.reason}" and reason in lines[at + 1]
    resolved = plan(cfg).resolved.actor_rollout_ref.rollout
    assert resolved.name == name
    assert resolved.max_num_seqs == (64 if name == "agentrl" else 256)  # rollout.max_batch_size; verl's default
    if installed.get(name) or name == "agentrl":
        assert "warning" not in printed
        return
    # not installed: the dry run warns, and launching stops before verl starts, suggesting agentrl
    assert f"warning: {name} is not installed here: launching from this machine stops" in printed
    assert main(cfg, dry_run=False) == 2
    err = capsys.readouterr().err
    assert "set verl.rollout=agentrl" in err and f"pip install {name}" in err
