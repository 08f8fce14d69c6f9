"""The trainer end to end on a tiny random GPT-OSS: metrics, on-policy fix, off-policy path with KL,
rollout correction and freezing, run-directory contents and plots."""

from __future__ import annotations

import json

import pytest
import torch
from _parity_env import ParityEnv
from _tiny_run import QUIET, TINY

import agentrl.envs.registry as registry
from agentrl.train.config import build_config
from agentrl.train.plots import plot_runs
from agentrl.train.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry.register("parity-test", "_parity_env:ParityEnv")


BASE = ["env=parity-test", "model=tiny-gpt-oss", *QUIET, "data.tasks=env", "rollout.batch_size=2", "rollout.n=4",
        "rollout.max_new_tokens=4", "rollout.temperature=1.0", "eval.num_tasks=4", "trainer.progress=false",
        "trainer.max_wall_s=0", "actor.lr=1e-3"]


def _fit(tmp_path, name, extra):
    cfg = build_config([*BASE, f"run_dir={tmp_path / name}", *extra])
    trainer = Trainer(cfg)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    summary = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return trainer, before, summary, records


def test_on_policy_step_has_ratio_exactly_one(tmp_path):
    trainer, before, summary, records = _fit(tmp_path, "onpolicy", ["trainer.total_steps=1"])
    assert trainer.ref_model is None  # no loss uses a KL reference: no copy of the model is built
    assert [r["step"] for r in records] == [0, 1]
    step = records[1]
    assert step["actor/on_policy"] == 1.0
    assert step["actor/ppo_ratio_max"] == 1.0 and step["actor/ppo_ratio_min"] == 1.0
    assert step["actor/pg_clipfrac"] == 0.0
    assert step["rollout_corr/logprob_abs_diff_mean"] < 1e-3  # engine and trainer agree (fp32)
    assert step["actor/grad_norm"] > 0
    for key in ("critic/score/mean", "reward/even/mean", "response_length/mean", "episode/turns_mean",
                "episode/tool_calls_mean", "episode/tool_error_rate", "episode/parse_error_rate",
                "actor/entropy", "rollout_corr/k3_kl", "rollout_corr/logprob_abs_diff_max",
                "timing_s/gen", "timing_s/tools", "timing_s/update_actor", "perf/gen_tokens_per_s",
                "perf/train_tokens_per_s", "eval/mean_reward"):
        assert key in step, key
    assert "eval/mean_reward" in records[0] and "eval/pass@1" in records[0]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    run = tmp_path / "onpolicy"
    assert (run / "config.yaml").exists() and (run / "summary.json").exists()
    assert summary["eval_before"]["step"] == 0 and summary["eval_after"]["step"] == 1
    assert len((run / "trajectories" / "step_000001.jsonl").read_text().splitlines()) == 8
    assert len(plot_runs([str(run)], str(tmp_path / "plots"))) == 12  # 11 panels + the overview


def test_off_policy_with_kl_rollout_correction_and_freeze(tmp_path):
    trainer, before, _, records = _fit(tmp_path, "offpolicy", [
        "trainer.total_steps=1", "actor.ppo_epochs=2", "actor.num_mini_batches=2", "actor.micro_batch_size=2",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.freeze=[embeddings,router]",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", "eval.before=false",
    ])
    step = records[-1]
    assert step["actor/on_policy"] == 0.0 and step["actor/optimizer_steps"] == 4.0
    assert "actor/kl_loss" in step and step["actor/kl_loss"] >= 0
    assert any(k.startswith("rollout_corr/rollout_is") for k in step)
    assert any(k.startswith("rollout_corr/rollout_rs") for k in step)
    assert "timing_s/old_log_prob" in step and "timing_s/ref" in step
    params = dict(trainer.model.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(params["lm_head.weight"], before["lm_head.weight"])


def test_routing_replay_run(tmp_path):
    _, _, _, records = _fit(tmp_path, "replay", [
        "trainer.total_steps=1", "actor.routing_replay=true", "actor.ppo_epochs=2", "eval.num_tasks=0",
    ])
    step = records[-1]
    assert step["actor/on_policy"] == 0.0 and step["actor/grad_norm"] > 0
    # replaying the rollout's experts, the old-policy pass reproduces the rollout log-probs
    assert step["rollout_corr/logprob_abs_diff_max"] < 1e-3


def test_decode_engine_runs_on_the_cpu_when_asked(tmp_path):
    """``rollout.engine=auto`` is the transformers engine on the CPU (``tests/test_engine_decode.py``);
    ``rollout.engine=decode`` runs the decode engine there: per-episode clients, deterministic batches, the
    rollout's routing replayed, and its cache released after the rollout."""
    from agentrl.engines.decode.decode_engine import DecodeEngine

    trainer, _, _, records = _fit(tmp_path, "decode", [
        "trainer.total_steps=1", "rollout.engine=decode", "rollout.deterministic=true", "actor.routing_replay=true",
    ])
    assert isinstance(trainer.engine, DecodeEngine) and trainer.engine.deterministic
    assert not trainer.engine.runner.cache.allocated
    step = records[-1]
    assert step["actor/grad_norm"] > 0 and step["perf/gen_tokens_per_s"] > 0
    assert step["rollout_corr/logprob_abs_diff_max"] < 1e-3


def test_decode_engine_rolls_out_through_the_lora_adapter(tmp_path):
    """LoRA on the attention and the fused experts (PEFT's wrappers, as the trainer builds them): the decode
    engine runs the model itself, unmerged; after the first update the next step's rollout log-probs equal the
    trainer's replayed recomputation, so the engine saw the new adapter without a rebuild."""
    from agentrl.engines.decode.decode_engine import DecodeEngine

    trainer, _, _, records = _fit(tmp_path, "decode_lora", [
        "trainer.total_steps=2", "rollout.engine=decode", "actor.routing_replay=true", "actor.lora.rank=4",
    ])
    assert isinstance(trainer.engine, DecodeEngine)
    assert type(trainer.model.model.layers[0].mlp.experts).__name__ == "ParamWrapper"
    assert [r["step"] for r in records] == [0, 1, 2]
    assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)  # B moved off 0
    for step in records[1:]:
        assert step["actor/grad_norm"] > 0
        assert step["rollout_corr/logprob_abs_diff_max"] < 1e-3


def test_a_wall_time_stop_is_the_summarys_headline_and_the_last_line(tmp_path, capsys):
    from agentrl.train.cli import run_trainer

    run = tmp_path / "budget"
    cfg = build_config([*BASE, f"run_dir={run}", "trainer.total_steps=5", "trainer.max_wall_s=0.001"])
    assert run_trainer(cfg, "agentrl train") == 0
    summary = json.loads((run / "summary.json").read_text())
    # the headline: the first keys, next to the evaluation figures
    assert list(summary)[:4] == ["complete", "stopped_by", "steps", "total_steps"]
    assert summary["complete"] is False and summary["stopped_by"] == "max_wall_s"
    assert summary["steps"] == 1 and summary["total_steps"] == 5 and summary["max_wall_s"] == 0.001
    assert summary["eval_after"]["step"] == 1
    assert 0 < summary["peak_rss_gb"] < 64 and summary["peak_rss_children_gb"] >= 0  # GiB, recorded by every run
    assert (run / "checkpoints" / "step_000001" / "state.json").exists()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("agentrl train: INCOMPLETE: stopped by trainer.max_wall_s=0.001 after 1/5 steps")
    after = summary["eval_after"]
    assert f"{after['mean']:.3f} ± {after['sem']:.3f} after step 1 (4 tasks)" in last and last.endswith(str(run))


def test_a_run_bounded_by_steps_is_complete(tmp_path, capsys):
    from agentrl.train.cli import run_trainer

    run = tmp_path / "steps"
    assert run_trainer(build_config([*BASE, f"run_dir={run}", "trainer.total_steps=1"]), "agentrl train") == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["complete"] is True and summary["stopped_by"] is None and summary["steps"] == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("agentrl train: complete (1/1 steps); held-out reward ")
    assert " before, " in last and " after step 1 (4 tasks)" in last


# ---------------------------------------------------------------------------- one real `agentrl train` run
TRAIN_RUN = ["train", "env=retool", *TINY, "rollout.batch_size=2",
             "rollout.n=2", "rollout.max_new_tokens=8", "eval.num_tasks=3", "sft.steps=0", "trainer.total_steps=1",
             "trainer.progress=false", "trainer.tensorboard=false", "threads=1",
             "env_kwargs.sandbox_kwargs.workers=1"]


@pytest.fixture(scope="module")
def retool_run(tmp_path_factory):
    """`agentrl train` on retool (a tiny GPT-OSS, one RL step, three held-out tasks), as a user runs it."""
    from agentrl.cli import main

    run = tmp_path_factory.mktemp("retool") / "run"
    assert main([*TRAIN_RUN, f"run_dir={run}"]) == 0
    return run


def test_agentrl_eval_on_the_run_reproduces_eval_after(retool_run, tmp_path):
    from agentrl import rundir
    from agentrl.cli import main
    from agentrl.evaluation.metrics import headline

    assert main(["eval", "env=retool", f"model={retool_run}", f"out={tmp_path / 'eval'}", "progress=false"]) == 0
    summary = json.loads((retool_run / "summary.json").read_text())
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert summary["eval_after"] == {"step": 1, **headline(metrics)}
    assert metrics["episodes"] == 3 and metrics["env"] == "retool"
    # the same problems, token for token: the run's held-out episodes after its last step
    ours = {t.task_id: t for t in rundir.load_trajectories(tmp_path / "eval").records}
    run_eval = rundir.load_trajectories(retool_run / "eval" / "step_000001").records
    assert len(run_eval) == 3
    for t in run_eval:
        assert (ours[t.task_id].prompt_ids, ours[t.task_id].response_ids) == (t.prompt_ids, t.response_ids)
        assert ours[t.task_id].rollout_logprobs == t.rollout_logprobs


def test_viewer_shows_the_gap_heat_map_of_real_training_output(retool_run, tmp_path):
    from agentrl.cli import main
    from agentrl.viewer.html import build_payload, load_view_items

    assert main(["view", str(retool_run), f"out={tmp_path / 'view.html'}"]) == 0  # `agentrl view runs/<run>`
    page = (tmp_path / "view.html").read_text()
    assert page.count('"has_gap":true') == 4 and page.count('"has_gap":false') == 6  # trained vs held-out

    items, problems = load_view_items(retool_run)
    assert not problems
    trained = [(s, t) for s, t in items if s.startswith("trajectories/step_")]
    assert len(trained) == 4 and all(t.train_logprobs is not None and t.policy_version == 0 for _, t in trained)
    payload = build_payload(trained, None)
    assert all(r["has_gap"] and r["max_gap"] is not None for r in payload)
    # the recorded train-side log-probs are the update's: within float noise of the sampler's (fp32, on-policy)
    assert all(r["max_gap"] < 1e-3 for r in payload)


class BrokenEnv(ParityEnv):
    """Every episode fails: its reward raises."""

    def reward(self, ctx):
        raise RuntimeError(f"grader down for {ctx.task['id']}")


def test_failure_budget_stops_after_consecutive_all_failed_steps(tmp_path, capsys):
    from agentrl.cli import main

    registry.register("broken-test", f"{__name__}:BrokenEnv")
    argv = [a for a in BASE if not a.startswith("env=")]
    code = main(["train", "env=broken-test", *argv, "model_kwargs.num_layers=1", "eval.num_tasks=0",
                 "trainer.total_steps=5", "trainer.max_failed_steps=2", "trainer.tensorboard=false",
                 f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err, err
    assert "every episode failed in 2 consecutive steps (trainer.max_failed_steps=2)" in err
    assert "the first exception: step 1, task train-0: RuntimeError: grader down" in err
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
