"""backend=verl: dataset rows, config mapping, validation by verl's own config, and the dry-run plan."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytest.importorskip("verl")

from _verl_test_env import register  # noqa: E402

from agentrl.train.verl_backend.config_map import VerlConfigError, hydra_value, verl_overrides  # noqa: E402


def _cfg(tmp_path, **over):
    cfg = {
        "env": register(),
        "model": "openai/gpt-oss-20b",
        "run_dir": str(tmp_path / "run"),
        "rollout": {"batch_size": 32, "n": 8, "max_new_tokens": 512, "temperature": 1.0, "top_k": 0},
        "actor": {"lr": 1e-6, "ppo_epochs": 1, "num_mini_batches": 1, "kl_loss_type": "low_var_kl"},
        "algorithm": {"adv_estimator": "grpo",
                      "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}},
        "trainer": {"n_gpus_per_node": 8, "nnodes": 2, "total_steps": 50},
        "verl": {"rollout": "vllm", "tensor_parallel": 4, "ulysses_sp": 2, "n_train_tasks": 16, "n_val_tasks": 4},
    }
    for key, value in over.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def test_dry_run_plan_is_valid_for_verl(tmp_path, capsys):
    from omegaconf import OmegaConf

    from agentrl.train.verl_backend.launch import main, plan

    assert main(_cfg(tmp_path), dry_run=True) == 0
    printed = capsys.readouterr().out
    assert "-m verl.trainer.main_ppo" in printed and "--dry-run: nothing launched." in printed

    p = plan(_cfg(tmp_path))
    r = p.resolved
    assert p.command[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert r.actor_rollout_ref.model.path == "openai/gpt-oss-20b"
    assert r.actor_rollout_ref.model.override_config.attn_implementation == "agentrl_sink"
    assert r.actor_rollout_ref.actor.policy_loss.loss_mode == "agentrl_onpolicy"
    assert r.actor_rollout_ref.rollout.agent.default_agent_loop == "agentrl"
    assert (r.actor_rollout_ref.rollout.name, r.actor_rollout_ref.rollout.tensor_model_parallel_size) == ("vllm", 4)
    assert r.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert r.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2
    assert r.algorithm.rollout_correction.rollout_is == "token"
    assert r.actor_rollout_ref.rollout.top_k == -1
    assert (r.data.train_batch_size, r.actor_rollout_ref.rollout.n) == (32, 8)
    assert (r.trainer.n_gpus_per_node, r.trainer.nnodes) == (8, 2)
    assert OmegaConf.load(p.config_path) == r  # the saved file is the resolved config
    # verl's own entry point, given our exact command, composes exactly the config we validated
    job = subprocess.run(p.command + ["--cfg", "job"], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout.strip() == OmegaConf.to_yaml(r).strip()

    # verl's own dataset class reads our parquet, and each row carries what the agent loop needs
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from agentrl.train.verl_backend.agent_loop import parse_spec

    class _Tok:  # RLHFDataset only stores the tokenizer when overlong filtering is off
        pass

    ds = RLHFDataset(list(r.data.train_files), _Tok(), OmegaConf.create(OmegaConf.to_container(r.data)))
    assert len(ds) == 16
    row = ds[3]
    assert row["agent_name"] == "agentrl" and row["index"] == 3
    spec = parse_spec(row["agentrl"])
    assert spec["env"] == "verl_add" and spec["max_new_tokens"] == 512 and "answer" in spec["task"]
    assert spec["entry_point"] == "_verl_test_env:AddEnv"  # verl's workers build it even unregistered there
    assert spec["trajectory_dir"] == str(tmp_path / "run" / "trajectories")
    assert row["raw_prompt"][0]["content"] == spec["task"]["prompt"]
    assert row["reward_model"] == {"style": "agentrl_env", "ground_truth": spec["task"]["answer"]}


def test_dataset_follows_the_embedded_trainers_task_source(tmp_path):
    import pyarrow.parquet as pq

    from agentrl.envs import env_class
    from agentrl.envs.task_source import TaskSource
    from agentrl.train.verl_backend.agent_loop import parse_spec
    from agentrl.train.verl_backend.dataset import write_env_dataset

    train, val = write_env_dataset(tmp_path, register(), tasks="arithmetic", n_train=5, n_val=2, seed=3, level=2,
                                   eval_seed=77, format_reward=0.5, max_new_tokens=64)
    source = TaskSource(env_class("verl_add"), "arithmetic", seed=3, level=2, eval_seed=77)
    train_specs = [parse_spec(r) for r in pq.read_table(train).column("agentrl").to_pylist()]
    val_specs = [parse_spec(r) for r in pq.read_table(val).column("agentrl").to_pylist()]
    assert [s["task"] for s in train_specs] == [source.train(i, num_held_out=2) for i in range(5)]
    assert [s["task"] for s in val_specs] == source.held_out(2)
    assert {s["format_reward"] for s in train_specs} == {0.5}


def test_verl_rejects_unknown_key_before_launch(tmp_path):
    from agentrl.train.verl_backend.launch import plan

    with pytest.raises(VerlConfigError, match=r"actor_rollout_ref\.actor\.clip_ration") as err:
        plan(_cfg(tmp_path, **{"verl.overrides": ["actor_rollout_ref.actor.clip_ration=0.3"]}))
    assert "does not exist in verl's ppo_trainer config" in str(err.value)


def test_verl_rejects_incompatible_sizes_before_launch(tmp_path):
    from agentrl.train.verl_backend.launch import plan

    with pytest.raises(VerlConfigError, match="divisible") as err:
        plan(_cfg(tmp_path, **{"rollout.batch_size": 3, "verl.use_dynamic_bsz": False}))
    assert "rollout.batch_size x rollout.n" in str(err.value) and "real_train_batch_size" in str(err.value)
    assert not (tmp_path / "run").exists()  # a refused plan leaves no run directory behind


def test_lora_with_a_vllm_rollout_plans_without_vllm_installed(tmp_path, capsys):
    """The README's GPT-OSS-20B LoRA dry run on a machine without vLLM: verl's vLLM LoRA-rank check needs
    vLLM, which the nodes have; the plan goes through and says vLLM is missing here."""
    import importlib.util

    from omegaconf import OmegaConf

    from agentrl.train.verl_backend.launch import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: verl checks the LoRA rank itself")
    cfg = _cfg(tmp_path, **{"actor.lora": {"rank": 32, "alpha": None, "dropout": 0.0, "target_modules": []}})
    assert main(cfg, dry_run=True) == 0
    printed = capsys.readouterr().out
    assert "actor_rollout_ref.model.lora_rank = 32" in printed and "vllm is not installed here" in printed
    saved = OmegaConf.load(tmp_path / "run" / "verl_config.yaml").actor_rollout_ref.model
    assert saved.lora_rank == 32 and not (saved.get("lora") or {}).get("merge", False)  # only the check's copy merges


@pytest.mark.parametrize(
    "over, message",
    [
        ({"verl.tensor_parallel": 3}, "verl.tensor_parallel=3 must be >= 1 and divide the GPU count"),
        ({"verl.rollout": "trtllm"}, "verl.rollout='trtllm' is not valid"),
        ({"verl.rollout": "agentrl"}, "verl.rollout=agentrl runs one engine per GPU; set verl.tensor_parallel=1"),
        ({"model": "smollm2-135m"}, "GGUF checkpoint"),
        ({"verl.ulysses": 2}, "Valid verl.\\* keys"),
        ({"rollout.batch_size": 30, "actor.num_mini_batches": 4}, "divisible by actor.num_mini_batches"),
        ({"attn_implementation": "eager"}, "verl.ulysses_sp needs packed sequences"),
    ],
)
def test_our_checks(tmp_path, over, message):
    with pytest.raises(VerlConfigError, match=message):
        verl_overrides(_cfg(tmp_path, **over), ["t.parquet"], ["v.parquet"])


def test_mapping_details(tmp_path):
    overrides = verl_overrides(
        _cfg(tmp_path, **{"actor.num_mini_batches": 4, "model": "Qwen/Qwen3-8B", "trainer.wandb": True}),
        ["/d/t.parquet"], ["/d/v.parquet"],
    )
    kv = dict(o.split("=", 1) for o in overrides)
    assert kv["actor_rollout_ref.actor.ppo_mini_batch_size"] == "8"
    assert "+actor_rollout_ref.model.override_config.attn_implementation" not in kv  # not GPT-OSS
    assert kv["trainer.logger"] == "[console,agentrl,wandb]"  # ours: metrics.jsonl + TensorBoard
    assert kv["data.train_files"] == "[/d/t.parquet]"
    assert [hydra_value(v) for v in (None, True, 3, "a b", "it's", "x/y-1.5")] == [
        "null", "true", "3", "'a b'", "'it\\'s'", "x/y-1.5"]
    assert json.loads(json.dumps(kv))  # plain strings only


def test_run_dir_logging_checkpoints_and_resume_mapping(tmp_path):
    run = tmp_path / "run"
    kv = dict(o.split("=", 1) for o in verl_overrides(
        _cfg(tmp_path, **{"trainer.keep_checkpoints": 2, "trainer.save_every": 5, "trainer.tensorboard": False}),
        ["t.parquet"], ["v.parquet"]))
    assert kv["trainer.default_local_dir"] == str(run / "checkpoints")
    assert kv["+trainer.agentrl.run_dir"] == str(run)
    assert kv["+trainer.agentrl.tensorboard"] == "false"
    assert (kv["trainer.save_freq"], kv["trainer.max_actor_ckpt_to_keep"]) == ("5", "2")
    assert kv["trainer.resume_mode"] == "auto" and "trainer.resume_from_path" not in kv

    # resume=RUN_DIR: the checkpoint verl's tracker names, or a clear error before anything starts
    with pytest.raises(VerlConfigError, match="no verl checkpoint there") as err:
        verl_overrides(_cfg(tmp_path, resume=str(run)), ["t.parquet"], ["v.parquet"])
    assert "start it again without resume=" in str(err.value)
    (run / "checkpoints" / "global_step_4").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    kv = dict(o.split("=", 1) for o in verl_overrides(_cfg(tmp_path, resume=str(run)), ["t.parquet"], ["v.parquet"]))
    assert kv["trainer.resume_mode"] == "resume_path"
    assert kv["trainer.resume_from_path"] == str(run / "checkpoints" / "global_step_4")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("7")  # names a missing folder
    with pytest.raises(VerlConfigError, match="no verl checkpoint there"):
        verl_overrides(_cfg(tmp_path, resume=str(run)), ["t.parquet"], ["v.parquet"])


def test_cli_resume_reloads_the_saved_config(tmp_path, capsys):
    """`agentrl train backend=verl ...` saves RUN_DIR/config.yaml; `resume=RUN_DIR` reloads it, applies new
    overrides on top and points verl at the latest checkpoint (dry runs: nothing is launched)."""
    from agentrl.train.cli import main

    run = tmp_path / "run"
    argv = ["backend=verl", f"env={register()}", "model=openai/gpt-oss-20b", "verl.rollout=agentrl",
            "trainer.n_gpus_per_node=1", "trainer.total_steps=4", "verl.n_train_tasks=8", "verl.n_val_tasks=2",
            f"run_dir={run}", "--dry-run"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert f"run directory: {run}" in first and "resume: auto" in first
    assert f"hydra.run.dir={run / 'hydra'}" in first  # Hydra's own output in the run dir, never ./outputs
    assert (run / "config.yaml").is_file() and (run / "verl_data" / "train.parquet").is_file()

    assert main([f"resume={run}", "trainer.total_steps=6", "--dry-run"]) == 2  # no checkpoint yet
    assert "no verl checkpoint there" in capsys.readouterr().err
    (run / "checkpoints" / "global_step_4").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    assert main([f"resume={run}", "trainer.total_steps=6", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"resume: from {run / 'checkpoints' / 'global_step_4'}" in out
    assert "trainer.total_training_steps = 6" in out and "actor_rollout_ref.rollout.name = 'agentrl'" in out


@pytest.mark.parametrize("word, code, says", [
    ("--dry-run=true", 2, "--dry-run applies to backend=verl only"),  # read as the bare flag
    ("--dry-run=1", 2, "--dry-run applies to backend=verl only"),
    ("--dry-run=maybe", 2, "--dry-run takes true or false, got 'maybe'"),
])
def test_dry_run_takes_a_bool_value_like_every_flag(capsys, word, code, says):
    from agentrl.train.cli import main

    assert main(["env=retool", word]) == code
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("model, attention, packed", [
    ("openai/gpt-oss-20b", None, True),  # agentrl_sink: packed rows kept apart
    ("openai/gpt-oss-20b", "eager", False),  # GPT-OSS eager attends across packed rows: padded rows instead
    ("Qwen/Qwen3-8B", None, True),  # verl's default flash_attention_2
    ("Qwen/Qwen3-8B", "sdpa", False),
])
def test_packed_rows_only_with_an_attention_that_keeps_them_apart(tmp_path, model, attention, packed):
    over = {"model": model, "verl.ulysses_sp": 1, "attn_implementation": attention}
    kv = dict(o.split("=", 1) for o in verl_overrides(_cfg(tmp_path, **over), ["t.parquet"], ["v.parquet"]))
    assert kv["actor_rollout_ref.model.use_remove_padding"] == ("true" if packed else "false")


# ---------------------------------------------------------------------------- the policy loss verl runs
@pytest.mark.parametrize("over, loss_mode", [
    ({}, "agentrl_onpolicy"),
    # raw overrides decide, because the choice is made on verl's resolved config
    ({"verl.overrides": ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]}, "vanilla"),
    ({"verl.overrides": ["actor_rollout_ref.actor.ppo_epochs=2"]}, "vanilla"),
    ({"actor.num_mini_batches": 4, "verl.overrides": ["actor_rollout_ref.actor.ppo_mini_batch_size=32"]},
     "agentrl_onpolicy"),
    # a chosen loss is composed with the fix, never replaced
    ({"actor.policy_loss": "gspo"}, "agentrl_onpolicy_gspo"),
    ({"actor.policy_loss": "cispo"}, "agentrl_onpolicy_cispo"),
    ({"actor.policy_loss": "gspo", "actor.num_mini_batches": 4}, "gspo"),
    ({"verl.overrides": ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"]}, "agentrl_onpolicy_sapo"),
    ({"actor.onpolicy_fix": False}, "vanilla"),
    ({"verl.overrides": ["algorithm.rollout_correction.bypass_mode=true"]}, "vanilla"),
])
def test_policy_loss_is_chosen_on_the_resolved_config(tmp_path, over, loss_mode):
    from omegaconf import OmegaConf

    from agentrl.train.verl_backend.launch import describe, plan

    p = plan(_cfg(tmp_path, **over))
    assert p.resolved.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert OmegaConf.load(p.config_path).actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert f"policy loss: {loss_mode}: " in describe(p)
    # the printed command resolves to the same loss (it is the last override when we composed the fix)
    from agentrl.train.verl_backend.validate import compose_verl_config

    assert compose_verl_config(p.command[3:]).actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode


@pytest.mark.parametrize("over, message", [
    ({"verl.overrides": ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"]}, "cannot take the on-policy fix"),
    ({"verl.overrides": ["actor_rollout_ref.actor.policy_loss.loss_mode=agentrl_onpolicy",
                         "actor_rollout_ref.actor.ppo_epochs=2"]}, "stale old_log_prob"),
    ({"verl.overrides": ["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"]}, "check the spelling"),
])
def test_policy_loss_refusals_are_clear(tmp_path, over, message):
    from agentrl.train.verl_backend.launch import plan

    with pytest.raises(VerlConfigError, match=message):
        plan(_cfg(tmp_path, **over))


def test_choose_policy_loss_on_plain_dicts():
    from agentrl.train.verl_backend.config_map import choose_policy_loss, optimizer_steps_per_batch

    def resolved(batch=32, mini=32, epochs=1, loss="vanilla", bypass=False):
        return {"data": {"train_batch_size": batch},
                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs,
                                                "policy_loss": {"loss_mode": loss}}},
                "algorithm": {"rollout_correction": {"bypass_mode": bypass}}}

    assert optimizer_steps_per_batch(resolved(32, 8, 2)) == 8
    assert optimizer_steps_per_batch(resolved(30, 8, 1)) == 4  # a last, smaller mini-batch is a step too
    assert choose_policy_loss(resolved())[0] == "agentrl_onpolicy"
    assert choose_policy_loss(resolved(loss="geo_mean"))[0] == "agentrl_onpolicy_geo_mean"
    assert choose_policy_loss(resolved(mini=16))[0] == "vanilla"
    loss, why = choose_policy_loss(resolved(mini=16, loss="gspo"))
    assert loss == "gspo" and "2 optimizer steps per batch" in why
    with pytest.raises(VerlConfigError, match="not among them"):
        choose_policy_loss(resolved(loss="my_loss"), registered={"vanilla", "my_loss", "agentrl_onpolicy"})


def test_verl_run_takes_the_verl_profile_and_prints_it(tmp_path):
    from agentrl.train.config import build_config
    from agentrl.train.verl_backend.launch import describe, plan

    cfg = build_config([f"env={register()}", "backend=verl", "model=openai/gpt-oss-20b", f"run_dir={tmp_path / 'run'}",
                        "rollout.batch_size=32", "rollout.n=8", "verl.n_train_tasks=4", "verl.n_val_tasks=2",
                        "trainer.n_gpus_per_node=8"])
    p = plan(cfg)
    assert p.resolved.actor_rollout_ref.actor.optim.lr == 1e-6  # not the CPU run's 1e-5
    assert p.resolved.actor_rollout_ref.rollout.temperature == 1.0
    assert p.resolved.trainer.total_training_steps == 200
    assert describe(p).startswith("backend=verl defaults: actor.lr=1e-06 ")


def test_lora_keys_map_to_verls_lora_settings_and_verl_composes_them(tmp_path, capsys):
    from agentrl.train.verl_backend.launch import main, plan

    cfg = _cfg(tmp_path, **{"actor.lora": {"rank": 16, "alpha": None, "dropout": 0.0, "target_modules": []},
                            "verl.rollout": "agentrl", "verl.tensor_parallel": 1})  # verl checks vLLM's LoRA here
    assert main(cfg, dry_run=True) == 0
    printed = capsys.readouterr().out
    for shown in ("actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                  "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                  "+actor_rollout_ref.model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"):
        assert shown in printed, shown  # the dry run shows them
    model = plan(cfg).resolved.actor_rollout_ref.model  # as verl's own config resolves them
    assert (model.lora_rank, model.lora_alpha) == (16, 32)
    assert list(model.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert list(model.target_parameters) == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    def lora_kv(model_name, **section):
        lora = {"rank": 8, "alpha": None, "dropout": 0.0, "target_modules": [], **section}
        kv = dict(o.split("=", 1) for o in verl_overrides(_cfg(tmp_path, model=model_name, **{"actor.lora": lora}),
                                                           ["t.parquet"], ["v.parquet"]))
        return {k: v for k, v in kv.items() if "lora" in k or "target_" in k}

    assert lora_kv("Qwen/Qwen3-8B") == {"actor_rollout_ref.model.lora_rank": "8",
                                        "actor_rollout_ref.model.lora_alpha": "16",
                                        "actor_rollout_ref.model.target_modules": "all-linear"}
    assert lora_kv("openai/gpt-oss-20b", alpha=4.0, target_modules=["q_proj", "gate_up_proj"]) == {
        "actor_rollout_ref.model.lora_rank": "8", "actor_rollout_ref.model.lora_alpha": "4",
        "actor_rollout_ref.model.target_modules": "[q_proj]",
        "+actor_rollout_ref.model.target_parameters": "[gate_up_proj]"}
    assert "actor_rollout_ref.model.lora_alpha" not in lora_kv("Qwen/Qwen3-8B", rank=0)  # no LoRA


@pytest.mark.parametrize("section, message", [
    ({"alpha": 12.5}, r"actor.lora.alpha=12.5: verl's lora_alpha is an integer"),
    ({"dropout": 0.05}, "verl's LoRA has no dropout; set actor.lora.dropout=0"),
    ({"target_modules": ["mlp.router"]}, "MoE router"),
])
def test_lora_settings_verl_cannot_take_are_refused(tmp_path, section, message):
    lora = {"rank": 8, "alpha": None, "dropout": 0.0, "target_modules": [], **section}
    with pytest.raises(VerlConfigError, match=message):
        verl_overrides(_cfg(tmp_path, **{"actor.lora": lora}), ["t.parquet"], ["v.parquet"])


def test_max_staleness_maps_to_verls_own_async_trainer(tmp_path):
    """``rollout.max_staleness=k`` runs verl's colocated asynchronous v1 trainer: k warm-up batches in flight, a
    group may span k + 1 weight versions (a lag of k updates), dropless ('wait'); verl's own config composes and
    validates it. At 0 verl's synchronous trainer stays."""
    from agentrl.train.config import ConfigError, build_config
    from agentrl.train.verl_backend.launch import plan

    base = [f"env={register()}", "backend=verl", "model=openai/gpt-oss-20b", f"run_dir={tmp_path / 'run'}",
            "rollout.batch_size=32", "rollout.n=8", "verl.n_train_tasks=4", "verl.n_val_tasks=2",
            "trainer.n_gpus_per_node=8", "algorithm.rollout_correction.rollout_is=token"]
    v1 = plan(build_config([*base, "rollout.max_staleness=2"])).resolved.trainer
    assert (v1.use_v1, v1.v1.trainer_mode, v1.v1.colocate_async.num_warmup_batches) == (True, "colocate_async", 2)
    assert (v1.v1.sampler.max_off_policy_threshold, v1.v1.sampler.max_off_policy_strategy) == (3, "wait")
    r = plan(build_config([*base, "rollout.max_staleness=1"])).resolved
    assert (r.trainer.v1.colocate_async.num_warmup_batches, r.trainer.v1.sampler.max_off_policy_threshold) == (1, 2)
    assert r.algorithm.rollout_correction.rollout_is == "token"  # behaviour -> proximal, as verl recomputes old log-probs
    assert plan(build_config(base)).resolved.trainer.v1.trainer_mode == "sync"
    with pytest.raises(ConfigError, match="rollout.max_staleness=1: stale tokens need decoupled PPO's"):
        build_config([*base[:-1], "rollout.max_staleness=1"])
