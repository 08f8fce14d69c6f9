"""The CLI convention, as a user meets it: every command x {--help, unknown key, bad value, unknown command},
run through ``agentrl.cli.main`` in a child process (one child for all the cases: :func:`_cli_process.run_many`).
Each error exits 2 with one line on stderr that names what was wrong and suggests the fix; nothing prints a
traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _cli_process import run_many

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


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("OPENAI_BASE_URL", None)
    return env


def _run_all(cases: list[list[str]]) -> list:
    return run_many(cases, env=_env(), cwd=str(REPO))


def _one_line_error(proc, label: str) -> str:
    assert proc.returncode == 2, (label, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, (label, proc.stderr)
    line = proc.stderr.strip()
    assert line and "\n" not in line, (label, proc.stderr)
    return line


def test_every_command_is_in_the_matrix():
    assert set(COMMANDS) == set(MATRIX), "add the new command to MATRIX"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    cases: dict[tuple[str, str], list[str]] = {}
    for name, (unknown, _, bad, _, typo) in MATRIX.items():
        words = name.split()
        cases[(name, "help")] = [*words, "--help"]
        cases[(name, "unknown_key")] = [*words, *unknown]
        cases[(name, "bad_value")] = [*words, *bad]
        cases[(name, "unknown_command")] = [*typo, *unknown[:1]]
    cases.update({("extra", str(i)): argv for i, argv in enumerate(EXTRA)})
    failed_start = tmp_path_factory.mktemp("eval") / "run"
    cases[("failed_start", str(failed_start))] = ["eval", "env=gsmk", "model=http://127.0.0.1:9/v1", f"out={failed_start}"]
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


#: more cases, run in the same child as the matrix
EXTRA = [
    ["serve", "model", "model=tiny-gpt-oss", "format=harmoni"],
    ["eval", "env=gsm8k", "model=http://127.0.0.1:9/v1", "api=chatt"],
    ["eval", "env=gsmk", "model=http://127.0.0.1:9/v1"],
    ["eval", "env=gsm8k"],
    ["serve"],
    ["serve", "--help"],
    ["--help"],
    ["view", "runs/x", "limit"],
]


def test_values_and_groups(results):
    procs = [results[("extra", str(i))] for i in range(len(EXTRA))]
    assert "Did you mean: harmony?" in _one_line_error(procs[0], "enum value")
    assert "Did you mean: chat?" in _one_line_error(procs[1], "enum value")
    assert "Did you mean: gsm8k?" in _one_line_error(procs[2], "env name")
    assert "model is required, e.g." in _one_line_error(procs[3], "required key")
    assert "serve model" in _one_line_error(procs[4], "group without a command")
    assert procs[5].returncode == 0 and "serve model" in procs[5].stdout and "serve sandbox" in procs[5].stdout
    assert procs[6].returncode == 0 and all(name in procs[6].stdout for name in MATRIX)
    assert "Did you mean: limit=...?" in _one_line_error(procs[7], "bare word")


def test_failed_eval_start_writes_nothing(results):
    """`env=gsmk` is refused before anything is written."""
    ((key, proc),) = [(k, p) for k, p in results.items() if k[0] == "failed_start"]
    _one_line_error(proc, "typo env")
    assert not Path(key[1]).exists()
