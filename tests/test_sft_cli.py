"""``agentrl sft``: help, errors with suggestions, an end-to-end run with the scripted teacher through the real
env and sandbox, exact resume after SIGKILL, and the result loading as ``model=RUN_DIR``."""

from __future__ import annotations

import json

import pytest
from _cli_process import kill_at, run_here
from _tiny_run import TINY

from agentrl.cli import main as cli_main

ARGS = [
    "env=retool", *TINY, "steps=3", "num_demos=4", "batch_size=2",
    "sft.save_every=1", "eval.num_tasks=2", "rollout.max_new_tokens=8", "threads=1", "trainer.tensorboard=false",
    "trainer.progress=false", "env_kwargs.sandbox_kwargs.workers=1",
]


def test_help_and_errors(capsys):
    assert cli_main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    assert "sft.steps" in out and "sft.teacher" in out and "resume=" in out
    # its own defaults, not train's (sft= declarations)
    assert "  sft.steps = 12 " in out and "  trainer.total_steps = 0 " in out and "  eval.num_tasks = 32 " in out
    assert cli_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  sft.steps = 6 " in out and "  trainer.total_steps = 10 " in out
    assert cli_main(["--help"]) == 0 and "sft" in capsys.readouterr().out
    cases = [
        (["env=retool", "sft.stpes=3"], "Did you mean: sft.steps"),
        (["env=retool", "teacher=scriptd"], "Did you mean: scripted"),
        (["env=retool", "teacher_api=chatt"], "Did you mean: chat"),
        (["env=retool", "steps=0"], "sft.steps >= 1"),
        (["env=retool", "steps=three"], "sft.steps"),
        (["env=gsm8k"], "no scripted teacher"),
        (["steps=2"], "env is required"),
        (["env=retool", "data=/nonexistent.jsonl"], "does not exist"),
    ]
    for argv, message in cases:
        assert cli_main(["sft", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """An uninterrupted ``agentrl sft`` run (no process boundary to test): its directory and printed output."""
    ref = tmp_path_factory.mktemp("sft") / "ref"
    return ref, run_here("sft", [*ARGS, f"run_dir={ref}"])


def _final_weights(run):
    import torch

    return torch.load(run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "model.pt")


def test_sft_run_reports_and_loads_as_model(sft_run):
    torch = pytest.importorskip("torch")
    ref, out = sft_run
    summary = json.loads(ref.joinpath("summary.json").read_text())
    assert summary["sft"]["steps"] == 3 and summary["sft"]["data"]["kept"] == 4
    assert {"eval_before", "eval_after"} <= set(summary)  # each evaluation once:
    assert "eval_after_sft" not in summary  # no RL step: the evaluation after SFT is the final one
    assert "sft 3/3" in out

    from agentrl.models.loading import load_model

    final = _final_weights(ref)
    loaded = load_model(str(ref))  # a run directory is a model name
    assert all(torch.equal(v, final[k]) for k, v in loaded.model.state_dict().items())
    assert loaded.format_name == "harmony"


def test_sft_killed_run_resumes_to_the_same_weights(sft_run, tmp_path):
    torch = pytest.importorskip("torch")
    ref, _ = sft_run
    killed = tmp_path / "killed"
    kill_at("sft", [*ARGS, f"run_dir={killed}"], "sft 2/3")  # an SFT step line follows its checkpoint
    assert (killed / "checkpoints" / "latest").read_text() == "sft_000002"

    out = run_here("sft", [f"resume={killed}"])
    assert "resumed from" in out and "sft 3/3" in out and "sft 1/3" not in out
    steps = [json.loads(line)["step"] for line in (killed / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    a, b = _final_weights(ref), _final_weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the resumed run ends with exactly the same weights


def test_kl_reference_is_the_policy_after_sft(tmp_path):
    torch = pytest.importorskip("torch")
    from agentrl.train.config import build_config
    from agentrl.train.trainer import Trainer

    run = tmp_path / "kl"
    cfg = build_config([
        "env=retool", *TINY, "sft.steps=2", "sft.num_demos=2",
        "sft.batch_size=2", "sft.lr=1e-3", "actor.use_kl_loss=true", "trainer.total_steps=1", "rollout.batch_size=1",
        "rollout.n=2", "rollout.max_new_tokens=4", "eval.num_tasks=0", "threads=1", "trainer.tensorboard=false",
        "trainer.progress=false", "env_kwargs.sandbox_kwargs.workers=1", f"run_dir={run}",
    ])
    trainer = Trainer(cfg)
    initial = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    summary = trainer.fit()
    assert summary["sft"]["steps"] == 2
    reference = torch.load(run / "sft" / "reference.pt")
    assert any(not torch.equal(reference[k], initial[k]) for k in initial)  # SFT moved the weights ...
    assert all(torch.equal(v, reference[k]) for k, v in trainer.ref_model.state_dict().items())  # ... and KL uses them
