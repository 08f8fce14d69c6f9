"""The budget guard of ``.ci/run`` (``tests/_tiers.py``): a deliberately slow test outside every tier fails
the run and is named; the same test in a tier, or a run without the guard's options, passes; a run over the
whole budget fails. Each case is a child pytest on a two-test directory, with the guard loaded as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SLOW_TEST = """
import time
import pytest

{mark}
def test_sleeps_half_a_second():
    time.sleep(0.5)

def test_instant():
    pass
"""


def _pytest(tmp_path: Path, mark: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    kernels: a tier\n")
    (tmp_path / "test_guarded.py").write_text(SLOW_TEST.format(mark=mark))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_tiers", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_slow_test_outside_every_tier_fails_the_run_and_is_named(tmp_path):
    run = _pytest(tmp_path, "", "--test-limit-s=0.2")
    assert run.returncode == 1, run.stdout
    assert "2 passed" in run.stdout  # the tests themselves passed: the guard failed the run
    assert "1 test(s) outside every tier took over 0.2 s" in run.stdout
    assert "test_guarded.py::test_sleeps_half_a_second" in run.stdout
    assert "test_instant" not in run.stdout.split("budget guard:")[-1]


@pytest.mark.parametrize("mark,args", [("@pytest.mark.kernels", ("--test-limit-s=0.2",)), ("", ())],
                         ids=["in-a-tier", "guard-off"])
def test_a_slow_test_in_a_tier_or_without_the_guard_passes(tmp_path, mark, args):
    run = _pytest(tmp_path, mark, *args)
    assert run.returncode == 0, run.stdout
    assert "outside every tier" not in run.stdout


def test_a_run_over_the_whole_budget_fails(tmp_path):
    run = _pytest(tmp_path, "", "--budget-s=0.1", "--test-limit-s=60")
    assert run.returncode == 1, run.stdout
    assert "OVER BUDGET" in run.stdout and "2 passed" in run.stdout
