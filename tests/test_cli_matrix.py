"""The CLI convention, as a user meets it: every command x {--help, unknown key, bad value, unknown command},
run as real ``agentrl`` subprocesses. Each error exits 2 with one line on stderr that names what was wrong
and suggests the fix; nothing prints a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentrl.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]

#: command -> (unknown-key argv, the key it should suggest, bad-value argv, the key it should name,
#:             a misspelling of the command)
MATRIX: dict[str, tuple[list[str], str, list[str], str, list[str]]] = {
    "train": (["env=retool", "rollout.temperatur=0.5"], "rollout.temperature",
              ["env=retool", "rollout.temperature=hot"], "rollout.temperature", ["trian"]),
    "sft": (["env=retool", "sft.stpes=3"], "sft.steps", ["env=retool", "sft.lr=fast"], "sft.lr", ["sfft"]),
    "eval": (["env=gsm8k", "model=http://127.0.0.1:9/v1", "temperatur=0.5"], "temperature",
             ["env=gsm8k", "model=http://127.0.0.1:9/v1", "temperature=hot"], "temperature", ["evl"]),
    "view": (["runs/x", "limt=3"], "limit", ["runs/x", "limit=many"], "limit", ["veiw"]),
    "plot": (["runs/x", "dip=100"], "dpi", ["runs/x", "dpi=high"], "dpi", ["plto"]),
    "serve model": (["model=tiny-gpt-oss", "prot=8000"], "port",
                    ["model=tiny-gpt-oss", "port=abc"], "port", ["serve", "modle"]),
    "serve sandbox": (["prot=8080"], "port", ["port=abc"], "port", ["serve", "sandbx"]),
}


def agentrl(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("OPENAI_BASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *argv], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )


def _run_all(cases: list[list[str]]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda argv: agentrl(*argv), cases))


def _one_line_error(proc: subprocess.CompletedProcess, label: str) -> str:
    assert proc.returncode == 2, (label, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, (label, proc.stderr)
    line = proc.stderr.strip()
    assert line and "\n" not in line, (label, proc.stderr)
    return line


def test_every_command_is_in_the_matrix():
    assert set(COMMANDS) == set(MATRIX), "add the new command to MATRIX"


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    cases: dict[tuple[str, str], list[str]] = {}
    for name, (unknown, _, bad, _, typo) in MATRIX.items():
        words = name.split()
        cases[(name, "help")] = [*words, "--help"]
        cases[(name, "unknown_key")] = [*words, *unknown]
        cases[(name, "bad_value")] = [*words, *bad]
        cases[(name, "unknown_command")] = [*typo, *unknown[:1]]
    procs = _run_all(list(cases.values()))
    return dict(zip(cases, procs, strict=True))


@pytest.mark.parametrize("name", list(MATRIX))
def test_help(results, name):
    proc = results[(name, "help")]
    assert proc.returncode == 0, proc.stderr
    assert f"usage: agentrl {name}" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", list(MATRIX))
def test_unknown_key_suggests_the_key(results, name):
    line = _one_line_error(results[(name, "unknown_key")], f"{name} unknown key")
    assert f"Did you mean: {MATRIX[name][1]}" in line, line


@pytest.mark.parametrize("name", list(MATRIX))
def test_bad_value_names_its_key_and_an_example(results, name):
    line = _one_line_error(results[(name, "bad_value")], f"{name} bad value")
    key = MATRIX[name][3]
    assert f"{key}=" in line and "e.g." in line, line
    assert "could not convert" not in line.lower()


@pytest.mark.parametrize("name", list(MATRIX))
def test_unknown_command_suggests_the_command(results, name):
    line = _one_line_error(results[(name, "unknown_command")], f"{name} unknown command")
    assert f"Did you mean: {name}" in line, line


def test_values_and_groups():
    procs = _run_all(
        [
            ["serve", "model", "model=tiny-gpt-oss", "format=harmoni"],
            ["eval", "env=gsm8k", "model=http://127.0.0.1:9/v1", "api=chatt"],
            ["eval", "env=gsmk", "model=http://127.0.0.1:9/v1"],
            ["eval", "env=gsm8k"],
            ["serve"],
            ["serve", "--help"],
            ["--help"],
            ["view", "runs/x", "limit"],
        ]
    )
    assert "Did you mean: harmony?" in _one_line_error(procs[0], "enum value")
    assert "Did you mean: chat?" in _one_line_error(procs[1], "enum value")
    assert "Did you mean: gsm8k?" in _one_line_error(procs[2], "env name")
    assert "model is required, e.g." in _one_line_error(procs[3], "required key")
    assert "serve model" in _one_line_error(procs[4], "group without a command")
    assert procs[5].returncode == 0 and "serve model" in procs[5].stdout and "serve sandbox" in procs[5].stdout
    assert procs[6].returncode == 0 and all(name in procs[6].stdout for name in MATRIX)
    assert "Did you mean limit=...?" in _one_line_error(procs[7], "bare word")


def test_failed_eval_start_writes_nothing(tmp_path):
    """`env=gsmk` is refused before anything is written; the corrected command then starts cleanly."""
    out = tmp_path / "run"
    proc = agentrl("eval", "env=gsmk", "model=http://127.0.0.1:9/v1", f"out={out}")
    _one_line_error(proc, "typo env")
    assert not out.exists()
