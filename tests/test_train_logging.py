"""Episode metrics, the metrics sink (JSONL + TensorBoard), plots, and atomic checkpoints."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from agentrl.episodes import EpisodeResult
from agentrl.harmony.trajectory import ToolRecord, Trajectory, TurnRecord
from agentrl.harmony.types import ParsedTurn, ParseError, ParseErrorKind
from agentrl.rundir import latest_checkpoint, list_checkpoints, read_metrics
from agentrl.train.checkpoint import load_checkpoint, save_checkpoint
from agentrl.train.metrics import MetricsSink, episode_metrics, mean_and_sem
from agentrl.train.plots import PANELS
from agentrl.train.plots import main as plot_main


def _episode(reward, tools=(), parse_error=False, usable=True, truncated=False):
    parsed = ParsedTurn(errors=[ParseError(ParseErrorKind.BAD_JSON, "x")] if parse_error else [])
    turn = TurnRecord(model_span=(0, 2), env_span=(2, 3), parsed=parsed,
                      tools=[ToolRecord("python", {}, "out", 0.5, err) for err in tools])
    traj = Trajectory(prompt_ids=[1, 2], response_ids=[5, 6, 7], response_mask=[1, 1, 0], rollout_logprobs=[-1, -1, 0],
                      reward=reward, reward_components={"correct": reward}, turns=[turn], truncated=truncated)
    return EpisodeResult(traj, "answer", task_id="t", error=None if usable else "RuntimeError: x")


def test_episode_metrics():
    eps = [_episode(1.0, tools=[None, "tool_timeout"]), _episode(0.0, parse_error=True, truncated=True),
           _episode(1.0, usable=False)]
    m = episode_metrics(eps)
    assert m["critic/score/mean"] == pytest.approx(1 / 3)  # the failed episode counts as 0
    assert m["reward/correct/mean"] == pytest.approx(2 / 3)
    assert m["episode/tool_calls_mean"] == pytest.approx(2 / 3)
    assert m["episode/tool_error_rate"] == pytest.approx(0.5)
    assert m["episode/parse_error_rate"] == pytest.approx(1 / 3)
    assert m["episode/truncated_frac"] == pytest.approx(1 / 3)
    assert m["episode/rollout_errors"] == 1.0
    assert m["response_length/mean"] == 2.0 and m["response_length/env_tokens_mean"] == 1.0
    assert mean_and_sem([0.0, 1.0]) == pytest.approx((0.5, 0.5))


def test_sink_jsonl_tensorboard_and_truncate(tmp_path):
    sink = MetricsSink(str(tmp_path), tensorboard=True, wandb=False, wandb_project="x", config={})
    for step in range(1, 4):
        sink.log(step, {"critic/score/mean": step / 10, "actor/grad_norm": float("nan")})
    sink.close()
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3] and records[0]["actor/grad_norm"] is None
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
    sink.truncate_after(2)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_plot_overlays_runs(tmp_path, capsys):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        run = tmp_path / name
        run.mkdir()
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, 5):
                f.write(json.dumps({"step": step, "critic/score/mean": scale * step, "actor/entropy": 1.0,
                                    "actor/grad_norm": 0.5, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0,
                                    "rollout_corr/logprob_abs_diff_mean": 1e-3}) + "\n")
    out = tmp_path / "plots"
    assert plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    for stem in PANELS:
        assert (out / f"{stem}.png").stat().st_size > 1000
    assert (out / "overview.png").exists()
    assert plot_main([str(tmp_path / "missing")]) == 2


def test_plot_held_out_panels_show_before_sft_after_sft_and_after_rl(tmp_path, monkeypatch):
    import matplotlib.axes

    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": 0, "eval_before/critic/score/mean": 0.0, "eval_before/episode/tool_call_rate": 0.0,
         "eval/critic/score/mean": 0.6, "eval/episode/tool_call_rate": 0.9},  # before and after the SFT stage
        {"step": 1, "critic/score/mean": 0.5},
        {"step": 2, "critic/score/mean": 0.7, "eval/critic/score/mean": 0.8, "eval/episode/tool_call_rate": 1.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn: dict[str, list] = {}
    real_plot = matplotlib.axes.Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        drawn.setdefault(f"{self.get_title() or '?'}|{kwargs.get('label')}", []).append((list(x), list(y)))
        return real_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    assert plot_main([str(run), "--out", str(tmp_path / "plots")]) == 0
    # titles are set after plotting, so the recorded key has '?' for the title: look the series up by values
    series = [xy for xys in drawn.values() for xy in xys]
    assert ([0, 2], [0.6, 0.8]) in series and ([0], [0.0]) in series and ([0, 2], [0.9, 1.0]) in series
    assert any(label.endswith("(before SFT)") for label in drawn)


def test_checkpoint_roundtrip_keep_and_atomicity(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step=step, data_position=step * 4, model=model, optimizer=opt, keep=2)
    assert list_checkpoints(str(tmp_path)) == ["step_000002", "step_000003"]
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    # a crash mid-save leaves a temporary directory that is never picked up
    os.makedirs(tmp_path / "checkpoints" / ".tmp-step_000004")
    assert latest_checkpoint(str(tmp_path)).endswith("step_000003")
    saved_weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    fresh_opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = load_checkpoint(latest_checkpoint(str(tmp_path)), model=model, optimizer=fresh_opt)
    assert state["step"] == 3 and state["data_position"] == 12
    assert torch.equal(model.weight, saved_weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
