"""Ctrl-C and SIGTERM stop a training run with one line that says how to resume it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from _tiny_run import TINY

pytest.importorskip("torch")

ARGS = ["env=gsm8k", *TINY, "eval.num_tasks=0", "sft.steps=0",
        "trainer.tensorboard=false", "trainer.progress=false"]


@pytest.mark.parametrize(("stop", "what", "code"), [
    ("interrupt", "interrupted", 130),
    ("sigterm", "terminated (SIGTERM)", 143),
])
def test_a_stopped_run_says_how_to_resume(stop, what, code, tmp_path, monkeypatch, capsys):
    from agentrl.cli import main
    from agentrl.train.trainer import Trainer

    def fit(self):
        if stop == "interrupt":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` or a job scheduler would
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(Trainer, "fit", fit)
    before = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    assert main(["train", *ARGS, f"run_dir={run}"]) == code
    err = capsys.readouterr().err.strip()
    assert err == f"agentrl train: {what}; `agentrl train resume={run}` continues the run from the start (no checkpoint yet)"
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the command's only
