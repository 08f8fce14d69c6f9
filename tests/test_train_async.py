"""Asynchronous rollouts (issue 33, part 3) end to end on a tiny random GPT-OSS on the CPU: at staleness 0 the
orchestrator is the synchronous trainer bit for bit; at 1 and 2 every token's recorded version is within the bound,
every group of the synchronous schedule is trained exactly once, and a run killed with batches in flight resumes
with the same guarantees."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import agentrl.envs.registry as registry  # noqa: E402
from agentrl.train.async_rollout import AsyncRollouts  # noqa: E402
from agentrl.train.config import ConfigError, build_config  # noqa: E402
from agentrl.train.repro import differing_keys  # noqa: E402
from agentrl.train.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry.register("parity-async-test", "_parity_env:ParityEnv")


BASE = ["env=parity-async-test", "model=tiny-gpt-oss", "data.tasks=env", "rollout.batch_size=2", "rollout.n=2",
        "rollout.max_new_tokens=4", "rollout.max_turns=1", "eval.num_tasks=0", "trainer.progress=false",
        "trainer.max_wall_s=0", "actor.lr=1e-3", "trainer.save_every=1"]
ASYNC = ["rollout.engine=decode", "algorithm.rollout_correction.rollout_is=token",
         "algorithm.rollout_correction.rollout_is_threshold=2.0"]


def _steps(run, total):
    """Per step: the trajectories the step trained on (as JSON dicts)."""
    return {s: [json.loads(x) for x in (run / "trajectories" / f"step_{s:06d}.jsonl").read_text().splitlines()]
            for s in range(1, total + 1)}


def _metrics(run):
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_staleness_zero_is_the_synchronous_trainer_bit_for_bit(tmp_path):
    extra = ["trainer.total_steps=2", "rollout.engine=decode"]
    Trainer(build_config([*BASE, *extra, f"run_dir={tmp_path / 'sync'}"])).fit()
    trainer = Trainer(build_config([*BASE, *extra, "rollout.max_staleness=0", f"run_dir={tmp_path / 'async0'}"]))
    trainer.rollouts = AsyncRollouts(trainer, max_staleness=0)  # the orchestrator's path, which the trainer skips at 0
    trainer.fit()
    assert trainer.rollouts.launched == {1: 0, 2: 1}  # one batch in flight, started after the previous update
    assert differing_keys(tmp_path / "sync", tmp_path / "async0") == []
    sync, async0 = _steps(tmp_path / "sync", 2), _steps(tmp_path / "async0", 2)
    assert [[t["response_ids"] for t in sync[s]] for s in (1, 2)] == [[t["response_ids"] for t in async0[s]]
                                                                      for s in (1, 2)]


@pytest.mark.parametrize("bound, extra", [(1, []), (2, []), (1, ["actor.lora.rank=4"]), (1, ["rollout.engine=transformers"])],
                         ids=["k1", "k2", "k1-lora", "k1-transformers"])
def test_bounded_staleness_trains_every_group_once_within_the_bound(tmp_path, bound, extra):
    total = 4
    run = tmp_path / f"k{bound}"
    trainer = Trainer(build_config([*BASE, *ASYNC, f"trainer.total_steps={total}", f"rollout.max_staleness={bound}",
                                    f"run_dir={run}", *extra]))
    trainer.fit()
    # the last update reached the rollout copy (update_weights, or update_lora for the adapter) as version `total`
    served = dict(trainer.rollouts.engine.model.named_parameters())
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(torch.equal(p, served[n]) for n, p in trained.items())
    assert trainer.rollouts.lora == ("actor.lora.rank=4" in extra) and trainer.rollouts.engine.policy_version == total
    engine_kind = "TransformersEngine" if "rollout.engine=transformers" in extra else "DecodeEngine"
    assert type(trainer.rollouts.engine).__name__ == engine_kind
    # batches start as early as the bound allows: step s at version max(0, s - 1 - bound)
    assert trainer.rollouts.launched == {s: max(0, s - 1 - bound) for s in range(1, total + 1)}
    _check_run(run, total, bound)


def _check_run(run, total, bound):
    steps, metrics = _steps(run, total), _metrics(run)
    for s, trajectories in steps.items():
        proximal = s - 1
        # the synchronous schedule's groups: tasks 2(s-1), 2(s-1)+1, each with its two samples, none dropped
        assert sorted((t["task_id"], t["sample"]) for t in trajectories) == [
            (f"train-{2 * (s - 1) + i}", k) for i in range(2) for k in range(2)]
        for t in trajectories:
            versions = [v for v, m in zip(t["token_versions"], t["response_mask"], strict=True) if m]
            assert versions and all(proximal - bound <= v <= proximal for v in versions), (s, versions)
            assert t["policy_version"] == min(versions)
        assert 0 <= metrics[s]["async/staleness_max"] <= bound
        assert metrics[s]["actor/dropped_groups"] == 0.0


def test_resume_with_batches_in_flight_recollects_them_within_the_bound(tmp_path):
    total, bound = 4, 2
    run = tmp_path / "killed"
    cfg = build_config([*BASE, *ASYNC, f"trainer.total_steps={total}", f"rollout.max_staleness={bound}",
                        f"run_dir={run}"])
    trainer = Trainer(cfg)
    step = trainer.train_step

    async def killed_after_two(pool):
        if trainer.state.step == 2:
            raise RuntimeError("killed")
        return await step(pool)

    trainer.train_step = killed_after_two
    with pytest.raises(RuntimeError, match="killed"):
        trainer.fit()
    assert set(trainer.rollouts.launched) == {1, 2, 3, 4}  # steps 3 and 4 were in flight
    assert not (run / "trajectories" / "step_000003.jsonl").exists()
    resumed = Trainer(cfg)
    resumed.fit()
    assert resumed.state.step == total
    assert resumed.rollouts.launched == {3: 2, 4: 2}  # collected again, from the restored version
    _check_run(run, total, bound)


@pytest.mark.parametrize("extra, message", [
    (["rollout.engine=decode"], "rollout_is=token"),
    (["rollout.engine=transformers"], "rollout_is=token"),
    (["rollout.engine=decode", "algorithm.rollout_correction.rollout_rs=token_k3",
      "algorithm.rollout_correction.rollout_rs_threshold=0.1", "rollout.deterministic=true"], "deterministic=false"),
])
def test_config_says_what_async_needs(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config([*BASE, "rollout.max_staleness=1", *extra])
