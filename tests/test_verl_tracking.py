"""verl's logger metrics in agentrl's run directory: the `agentrl` backend of verl's `Tracking`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("verl")


def _config(run_dir, **trainer):
    return {"trainer": {"agentrl": {"run_dir": str(run_dir), "tensorboard": True}, "resume_mode": "auto",
                        "default_local_dir": str(run_dir / "checkpoints"), **trainer}}


def _tracking(run_dir, **trainer):
    from verl.utils.tracking import Tracking

    return Tracking("agentrl", run_dir.name, default_backend=["console", "agentrl"], config=_config(run_dir, **trainer))


def test_verl_tracking_writes_our_jsonl_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from verl.utils.tracking import Tracking

    from agentrl.rundir import read_metrics

    assert "agentrl" in Tracking.supported_backend  # registered by the plugin on `import verl`
    run = tmp_path / "run"
    tracker = _tracking(run)
    step1 = {"timing_s/step": 1.5, "perf/throughput": np.float32(2048.0), "actor/grad_norm": torch.tensor(0.25),
             "training/global_step": np.int64(1), "num_turns/max": np.int32(3), "flag": True,
             "rollout_corr/kl": float("nan"), "table": "not a number", "hist": np.arange(4)}
    tracker.log(data=step1, step=1)
    tracker.log(data={"timing_s/step": 0.5, "critic/score/mean": 0.25}, step=2)
    tracker.finish()
    tracker.finish()  # verl calls it again from __del__: a no-op
    assert "step:1 - timing_s/step:1.5" in capsys.readouterr().out  # verl's own console backend still runs

    records = read_metrics(str(run))
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, "timing_s/step": 1.5, "perf/throughput": 2048.0, "actor/grad_norm": 0.25,
                          "training/global_step": 1, "num_turns/max": 3, "flag": 1, "rollout_corr/kl": None}
    assert records[1] == {"step": 2, "timing_s/step": 0.5, "critic/score/mean": 0.25}

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert "rollout_corr/kl" not in events.Tags()["scalars"]  # non-finite values stay out of TensorBoard
    assert [(e.step, e.value) for e in events.Scalars("timing_s/step")] == [(1, 1.5), (2, 0.5)]
    assert [e.value for e in events.Scalars("perf/throughput")] == [2048.0]


def test_a_resumed_run_rewrites_the_steps_after_its_checkpoint(tmp_path):
    from agentrl.rundir import read_metrics

    run = tmp_path / "run"
    first = _tracking(run)
    for step in (1, 2, 3):  # step 3 was logged, but the run died before checkpointing it
        first.log(data={"x": float(step)}, step=step)
    first.finish()
    (run / "checkpoints" / "global_step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")

    resumed = _tracking(run)
    assert [r["step"] for r in read_metrics(str(run))] == [1, 2]
    resumed.log(data={"x": 30.0}, step=3)
    resumed.finish()
    assert [(r["step"], r["x"]) for r in read_metrics(str(run))] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_resumed_step_follows_verls_resume_modes(tmp_path):
    from agentrl.train.verl_backend.tracking import resumed_step

    root = tmp_path / "ckpt"
    assert resumed_step({"resume_mode": "auto", "default_local_dir": str(root)}) == 0  # nothing saved yet
    (root / "global_step_7").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    assert resumed_step({"resume_mode": "auto", "default_local_dir": str(root)}) == 7
    assert resumed_step({"resume_mode": "disable", "default_local_dir": str(root)}) == 0
    assert resumed_step({"resume_mode": "resume_path", "resume_from_path": "/x/global_step_12"}) == 12
    (root / "latest_checkpointed_iteration.txt").write_text("9")  # names a folder that does not exist
    assert resumed_step({"resume_mode": "auto", "default_local_dir": str(root)}) == 0


def test_missing_run_dir_is_a_clear_error(tmp_path):
    from verl.utils.tracking import Tracking

    with pytest.raises(ValueError, match=r"trainer\.agentrl\.run_dir is not set"):
        Tracking("p", "e", default_backend=["agentrl"], config={"trainer": {}})


def test_jsonl_lines_are_plain_json(tmp_path):
    run = tmp_path / "run"
    tracker = _tracking(run)
    tracker.log(data={"a": np.float64(1.25), "b": torch.tensor([2.0])}, step=4)
    tracker.finish()
    assert json.loads((run / "metrics.jsonl").read_text()) == {"step": 4, "a": 1.25, "b": 2.0}
