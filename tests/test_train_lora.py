"""LoRA through the trainer (``actor.lora.*``) on a tiny random GPT-OSS: only the adapter trains, the on-policy
ratio is exactly 1, the KL reference is the base model with the adapters disabled (no second copy), checkpoints
hold the adapter and its optimizer state only and ``resume=`` continues bit for bit, ``agentrl sft lora.rank=``
takes the same keys, and the config refuses what cannot work."""

from __future__ import annotations

import json

import pytest
import torch
from _cli_process import run_here
from _tiny_run import TINY
from safetensors.torch import load_file

import agentrl.envs.registry as registry
from agentrl.models import lora
from agentrl.models.loading import load_model
from agentrl.train.config import ConfigError, build_config, help_text
from agentrl.train.trainer import Trainer
from agentrl.train.update import batched_logprobs


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry.register("parity-test", "test_train_trainer:ParityEnv")  # reward varies within a group


BASE = ["env=parity-test", *TINY, "data.tasks=env",
        "rollout.batch_size=2", "rollout.n=4", "rollout.max_new_tokens=4", "rollout.temperature=1.0",
        "eval.num_tasks=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.max_wall_s=0",
        "threads=1", "actor.lora.rank=4", "actor.lr=1e-2", "trainer.save_every=1"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _fit(tmp_path, name, extra=()):
    trainer = Trainer(build_config([*BASE, f"run_dir={tmp_path / name}", *extra]))
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.fit()
    return trainer, before, _records(tmp_path / name)


def test_lora_trainer_trains_only_the_adapter_on_policy_and_checkpoints_it_alone(tmp_path):
    trainer, before, records = _fit(tmp_path, "run", ["trainer.total_steps=1", "trainer.export_hf=true"])
    adapter = dict(lora.adapter_parameters(trainer.model))
    assert adapter and all(".lora_" in n for n in adapter)
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in adapter.values()}  # the optimizer holds the adapter only
    step = records[-1]
    assert step["actor/on_policy"] == 1.0 and step["actor/grad_norm"] > 0
    assert step["actor/ppo_ratio_max"] == 1.0 and step["actor/ppo_ratio_min"] == 1.0 and step["actor/pg_clipfrac"] == 0
    assert "perf/gpu_peak_gb" not in step  # a CUDA-only figure
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all(n in adapter for n in changed)  # base weights bit-identical, adapters moved
    assert any("lora_B" in n for n in changed)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "hf", "optimizer.pt", "rng.pt", "state.json"]
    saved = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(adapter) and all(".lora_" in k for k in saved)
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(optim["state"]) == len(adapter)


def test_lora_kl_reference_is_the_base_with_adapters_disabled_and_no_copy(tmp_path):
    trainer, _, records = _fit(tmp_path, "kl", ["trainer.total_steps=2", "actor.use_kl_loss=true",
                                                "actor.kl_loss_coef=0.1"])
    assert trainer.ref_model is trainer.model  # no second copy of the weights
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["actor/kl_loss"] == 0.0  # step 1: B = 0, the policy is the base exactly
    assert records[1]["actor/kl_loss"] > 0  # step 2: the adapter has moved away from the base
    assert not (tmp_path / "kl" / "sft" / "reference.pt").exists()
    base = load_model("tiny-gpt-oss", device="cpu", dtype="float32", seed=0, model_kwargs={"num_layers": 1}).model
    from _tiny_update import ragged_batch

    batch = ragged_batch(6, seed=3)
    with lora.adapters_disabled(trainer.model):
        ref = batched_logprobs(trainer.model, batch, micro_batch_size=8, chunk_size=1024, temperature=1.0)
    assert torch.equal(ref, batched_logprobs(base, batch, micro_batch_size=8, chunk_size=1024, temperature=1.0))
    assert not torch.equal(ref, batched_logprobs(trainer.model, batch, micro_batch_size=8, chunk_size=1024,
                                                 temperature=1.0))


def test_lora_resume_through_agentrl_train_is_bit_exact(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_here("train", [*BASE, "trainer.total_steps=2", f"run_dir={whole}"])
    run_here("train", [*BASE, "trainer.total_steps=1", f"run_dir={split}"])
    out = run_here("train", [f"resume={split}", "trainer.total_steps=2"])
    assert "resumed from" in out
    a, b = (run / "checkpoints" / "step_000002" for run in (whole, split))
    assert not (b / "model.pt").exists() and (b / "adapter" / "adapter_config.json").exists()
    wa, wb = (load_file(c / "adapter" / "adapter_model.safetensors") for c in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (a, b))
    assert all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in ("exp_avg", "exp_avg_sq"))
    ra, rb = _records(whole), _records(split)
    assert [r["step"] for r in rb] == [1, 2] and ra[-1]["actor/pg_loss"] == rb[-1]["actor/pg_loss"]


def test_lora_resume_refuses_a_run_with_other_lora_settings(tmp_path):
    run = tmp_path / "run"
    run_here("train", [*BASE, "trainer.total_steps=1", f"run_dir={run}"])
    cfg = build_config([*BASE, "trainer.total_steps=2", f"run_dir={run}", "actor.lora.rank=8"])
    with pytest.raises(ValueError, match="actor.lora settings"):
        Trainer(cfg).maybe_resume()


def test_lora_config_keys_validation_help_and_learning_rates():
    cfg = build_config(["env=retool", "actor.lora.rank=16", "actor.lora.target_modules=[q_proj,gate_up_proj]"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, list(cfg.actor.lora.target_modules)) == (16, None, ["q_proj", "gate_up_proj"])
    plain = build_config(["env=retool"])
    assert cfg.actor.lr == 10 * plain.actor.lr and cfg.sft.lr == 10 * plain.sft.lr  # LoRA's larger steps
    assert build_config(["env=retool", "actor.lora.rank=16", "actor.lr=3e-5"]).actor.lr == 3e-5
    assert build_config(["env=retool", "actor.lora.rank=16", "device=cuda"]).actor.lr == pytest.approx(1e-5)
    from agentrl.train.config import SFT_SPEC

    sft = build_config(["env=retool", "lora.rank=8", "lora.alpha=8"], spec=SFT_SPEC, profile="sft")
    assert (sft.actor.lora.rank, sft.actor.lora.alpha, sft.sft.lr) == (8, 8.0, 10 * plain.sft.lr)
    for bad, message in [
        ("actor.lora.rank=-1", "actor.lora.rank must be >= 0"),
        ("actor.lora.alpha=0", "actor.lora.alpha must be > 0"),
        ("actor.lora.dropout=1.0", r"actor.lora.dropout=1.0 must be in \[0, 1\)"),
        ("actor.freeze=[attention]", "drop actor.freeze"),
        ("actor.lora.rnak=4", "Did you mean: actor.lora.rank"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(["env=retool", "actor.lora.rank=4", bad])
    text = help_text()
    for name in ("actor.lora.rank", "actor.lora.alpha", "actor.lora.dropout", "actor.lora.target_modules"):
        assert name in text
    assert "lora.rank=16 is actor.lora.rank=16" in help_text(SFT_SPEC, profile="sft")


def test_lora_agentrl_sft_trains_and_saves_the_adapter(tmp_path):
    run = tmp_path / "sft"
    out = run_here("sft", ["env=retool", *TINY, "lora.rank=4",
                           "steps=2", "num_demos=2", "batch_size=2", "micro_batch_size=2", "eval.num_tasks=0",
                           "trainer.progress=false", "trainer.tensorboard=false",
                           "threads=1", f"run_dir={run}"])
    assert "LoRA rank 4" in out
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model.pt").exists()
    sft = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft) == 2 and sft[-1]["sft/grad_norm"] > 0
    loaded = load_model(str(run), device="cpu", dtype="float32")  # base + adapter, merged for serving
    assert not lora.has_lora(loaded.model)


@pytest.mark.distributed
def test_lora_agentrl_train_with_fsdp2_on_two_cpu_processes_saves_and_resumes_the_adapter(tmp_path):
    """``trainer.n_gpus=2`` on the CPU (torchrun, gloo): the adapter is injected before sharding, checkpoints
    gather the adapter alone (no model.pt), and the run resumes from them."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [sys.executable, "-m", "agentrl.cli", "train", "env=gsm8k", "model=tiny-gpt-oss", "device=cpu",
            "model_kwargs.num_layers=1", "trainer.n_gpus=2", "trainer.save_every=1", "trainer.progress=false",
            "trainer.tensorboard=false", "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4",
            "eval.num_tasks=0", "actor.lora.rank=4", f"run_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def torchrun(extra):
        out = subprocess.run(args + extra, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
        return out.stdout + out.stderr

    assert "LoRA rank 4" in torchrun(["trainer.total_steps=1"])
    ckpt = run / "checkpoints" / "step_000001"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model.pt").exists()
    saved = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    names = [name for group in optim["param_groups"] for name in group["params"]]  # keyed by name under FSDP2
    assert len(names) == len(saved) and all(".lora_" in name for name in names)  # the adapter's alone
    assert "resumed from" in torchrun([f"resume={run}", "trainer.total_steps=2"])
    assert [r["step"] for r in _records(run)] == [1, 2]
