"""verl's whole PPO trainer on the CPU: `agentrl train backend=verl verl.rollout=agentrl`, then `resume=`.

What runs is verl 0.9.1's own ``main_ppo`` (Ray, the v1 sync trainer with TransferQueue, FSDP2 engine
workers, verl's checkpoint manager), our ``agentrl`` rollout in its hybrid-engine worker (weights synced
from the FSDP actor every step), our agent loop with a multi-turn env registered only in the launching
process, our on-policy loss and our logger backend. verl has no CPU platform, so the test-only
``_verl_cpu_platform`` gives it one (gloo collectives, Ray's ``GPU`` resource faked with
``ray_init.num_gpus=1``); the attention is ``eager`` (the Triton sink kernel needs a GPU or the slow
interpreter). Slow: about 3 to 4 minutes per launch on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

TESTS = Path(__file__).resolve().parent
LAUNCH = "import sys, _verl_test_env as t; t.register_multi_turn(); from agentrl.train.cli import main; sys.exit(main(sys.argv[1:]))"
CPU_OVERRIDES = ("verl.overrides=[trainer.device=cpu,actor_rollout_ref.rollout.dtype=float32,"
                 "+ray_kwargs.ray_init.num_gpus=1,ray_kwargs.ray_init.num_cpus=16,"
                 "+ray_kwargs.ray_init.include_dashboard=false,"
                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=2]")


def _launch(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "VERL_PLATFORM": "agentrl_cpu",
        "VERL_USE_EXTERNAL_MODULES": "_verl_cpu_platform",
        "VERL_ENGINE_DEVICE": "cuda",  # verl's FSDP engine is registered for cuda; it runs on our platform
        "VERL_ENGINE_VENDOR": "nvidia",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
    }
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-c", LAUNCH, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_verl_main_ppo_trains_checkpoints_and_resumes_on_cpu(tmp_path):
    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.models.tiny import tiny_gpt_oss

    model_dir = tmp_path / "model"
    model = tiny_gpt_oss(num_layers=2, hidden=64, seed=0)
    model.config.architectures = ["GptOssForCausalLM"]
    model.save_pretrained(model_dir)
    harmony_hf_tokenizer().save_pretrained(model_dir)
    run = tmp_path / "run"
    common = ["backend=verl", "env=verl_add_multi", f"model={model_dir}", "verl.rollout=agentrl",
              "attn_implementation=eager", "trainer.n_gpus_per_node=1", "trainer.save_every=1",
              "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
              "verl.max_prompt_length=512", "verl.max_response_length=64", "verl.n_train_tasks=16",
              "verl.n_val_tasks=2", "verl.agent_workers=1", CPU_OVERRIDES]

    cwd = tmp_path / "cwd"
    first = _launch([*common, "trainer.total_steps=2", f"run_dir={run}"], cwd)
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2]
    step1 = records[0]
    for key in ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                "perf/throughput", "perf/total_num_tokens", "actor/grad_norm", "actor/pg_loss",
                "critic/score/mean", "rollout_corr/kl", "rollout_corr/k3_kl", "training/rollout_probs_diff_mean"):
        assert isinstance(step1.get(key), (int, float)), key
    # agentrl_onpolicy: verl's vanilla loss at old_log_prob = log_prob.detach(), so the ratio is exactly 1
    assert step1["actor/onpolicy_fix"] == 1.0
    assert step1["actor/ppo_kl"] == 0.0 and step1["actor/pg_clipfrac"] == 0.0
    assert step1["actor/grad_norm"] > 0  # the env scores wrong answers by length: GRPO has a signal
    assert step1["training/off_policy/trajectory_staleness/max"] == 0  # sync trainer: fresh weights
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (run / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    for step in (1, 2):  # every episode, 2 tasks x 2 samples a step, with the weights it was sampled with
        lines = [json.loads(x) for f in (run / "trajectories").glob(f"step_{step:06d}-*.jsonl")
                 for x in f.read_text().splitlines()]
        assert len(lines) == 4 and {x["policy_version"] for x in lines} == {step - 1}
        assert len({x["group"] for x in lines}) == 2

    assert (run / "hydra" / ".hydra" / "overrides.yaml").is_file()  # Hydra's record, in the run directory
    assert not (cwd / "outputs").exists()  # and not in ./outputs of wherever the run was started

    resumed = _launch([f"resume={run}", "trainer.total_steps=3"], cwd)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-6000:]
    assert f"resume: from {run / 'checkpoints' / 'global_step_2'}" in out
    assert "Resuming from" in out and "setting global step to 2" in out
    assert [r["step"] for r in _records(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert list((run / "trajectories").glob("step_000003-*.jsonl"))


@pytest.mark.slow
def test_verl_async_trainer_with_max_staleness_one_on_cpu(tmp_path):
    """``rollout.max_staleness=1`` under backend=verl runs verl's own colocated asynchronous trainer end to end (our
    rollout pausing and resuming requests around each update): every step trains groups at most one weight version
    stale, as verl measures it, and the correction's metrics are there."""
    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.models.tiny import tiny_gpt_oss

    model_dir = tmp_path / "model"
    model = tiny_gpt_oss(num_layers=2, hidden=64, seed=0)
    model.config.architectures = ["GptOssForCausalLM"]
    model.save_pretrained(model_dir)
    harmony_hf_tokenizer().save_pretrained(model_dir)
    run = tmp_path / "run"
    done = _launch(["backend=verl", "env=verl_add_multi", f"model={model_dir}", "verl.rollout=agentrl",
                    "attn_implementation=eager", "trainer.n_gpus_per_node=1", "trainer.save_every=0",
                    "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
                    "verl.max_prompt_length=512", "verl.max_response_length=64", "verl.n_train_tasks=16",
                    "verl.n_val_tasks=2", "verl.agent_workers=1", CPU_OVERRIDES, "rollout.max_staleness=1",
                    "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=3", f"run_dir={run}"],
                   tmp_path / "cwd")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert "trainer_mode: colocate_async" in (run / "verl_config.yaml").read_text()
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["training/off_policy/trajectory_staleness_worst/max"] <= 1, r
        assert isinstance(r.get("rollout_corr/kl"), float)
    assert max(r["training/off_policy/trajectory_staleness/max"] for r in records) == 1  # it did run ahead
