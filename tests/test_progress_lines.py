"""When stdout is not a terminal (a log file), long phases print a plain progress line at a fixed interval:
evaluations (``agentrl eval`` and the trainer's held-out ones), rollouts and SFT data generation."""

from __future__ import annotations

import asyncio
import io
import re
import time

import pytest
from _tiny_run import TINY

from agentrl.progress import ProgressLines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_per_interval_while_nothing_finishes_and_none_on_a_terminal():
    log = io.StringIO()
    with ProgressLines("eval before", 128, interval_s=0.05, stream=log) as lines:
        time.sleep(0.6)  # no episode finishes: the phase still reports
        lines.update(32, failed=1)
        time.sleep(0.3)
    out = log.getvalue().splitlines()
    assert len(out) >= 4 and out[0].startswith("eval before: 0/128 episodes, ") and "ETA" not in out[0]
    assert re.fullmatch(r"eval before: 32/128 episodes, 1 failed, \d+ s elapsed, ETA \d+ s", out[-1]), out[-1]
    terminal = _Terminal()
    with ProgressLines("rollout", 4, interval_s=0.01, stream=terminal):
        time.sleep(0.1)
    assert terminal.getvalue() == ""  # the rich bars show it there
    off = io.StringIO()
    with ProgressLines("rollout", 4, interval_s=0, stream=off):
        time.sleep(0.05)
    assert off.getvalue() == ""


@pytest.fixture
def slow_generate(monkeypatch):
    """Each sampling call of the transformers engine takes at least 0.3 s, so a phase spans several intervals
    of 0.1 s whatever the machine's speed."""
    from agentrl.engines.transformers_engine import TransformersEngine

    real = TransformersEngine.generate

    async def generate(self, *args, **kwargs):
        t0 = time.monotonic()
        out = await real(self, *args, **kwargs)
        await asyncio.sleep(max(0.0, 0.3 - (time.monotonic() - t0)))
        return out

    monkeypatch.setattr(TransformersEngine, "generate", generate)


def _lines(text: str, label: str) -> list[str]:
    """The progress lines of ``label`` (not the result line an evaluation prints at its end)."""
    return [line for line in text.splitlines() if re.match(rf"{label}: \d+/(\d+|\?) episodes, ", line)]


def test_agentrl_eval_prints_progress_lines_into_a_log(tmp_path, capsys, slow_generate):
    from agentrl.cli import main

    assert main(["eval", "env=gsm8k", "model=tiny-gpt-oss", "limit=2", "max_new_tokens=4", "progress_interval_s=0.1",
                 f"out={tmp_path / 'eval'}"]) == 0
    lines = _lines(capsys.readouterr().out, "eval gsm8k")  # "0/?" while the model loads, then the total
    assert any(re.match(r"eval gsm8k: [012]/2 episodes, ", line) for line in lines), lines
    assert all(re.match(r"eval gsm8k: ([012]/2|0/\?) episodes, ", line) for line in lines), lines


def test_train_prints_progress_lines_for_evaluations_and_rollouts(tmp_path, capsys, slow_generate):
    from agentrl.cli import main

    argv = ["train", "env=retool", *TINY, "trainer.total_steps=1", "eval.num_tasks=2", "eval.after=false",
            "sft.steps=1", "sft.num_demos=2", "sft.batch_size=2", "rollout.batch_size=1", "rollout.n=2",
            "rollout.max_new_tokens=4", "trainer.progress_interval_s=0.1", "trainer.tensorboard=false",
            "env_kwargs.sandbox_kwargs.workers=1", f"run_dir={tmp_path / 'run'}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label, total in (("eval before", 2), ("eval after_sft", 2), ("rollout", 2)):
        lines = _lines(out, label)
        assert lines and all(f"/{total} episodes" in line for line in lines), (label, [x for x in lines if f"/{total} episodes" not in x])
