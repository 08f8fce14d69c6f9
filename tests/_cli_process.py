"""Run ``agentrl <command>`` as a user would: in a child process of its own (own session, so a test can kill it
with its whole process group) for tests of crash-and-resume, many commands in one child (:func:`run_many`) for
tests of what each prints and returns, or in this process (:func:`run_here`) where no process boundary is tested
(the imports are already paid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

#: the child of :func:`run_many`: ``agentrl.cli.main`` (what the ``agentrl`` script runs) on each argv read from
#: stdin, its stdout/stderr captured and its exit status taken as the process's would be (an uncaught
#: exception prints its traceback and exits 1)
_MANY = r"""
import contextlib, io, json, sys, traceback
from agentrl.cli import main
out = []
for argv in json.load(sys.stdin):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append([int(code or 0), stdout.getvalue(), stderr.getvalue()])
sys.__stdout__.write(json.dumps(out))
"""


@dataclass
class CliResult:
    """What one ``agentrl`` command printed and returned (the fields of ``subprocess.CompletedProcess``)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_many(cases: list[list[str]], *, env: dict[str, str] | None = None, cwd: str | None = None,
             timeout: float = 600) -> list[CliResult]:
    """Run each argv of ``cases`` as ``agentrl ARGV`` in one child Python process (the imports are paid once;
    every command still starts from ``agentrl.cli.main``, as the console script does); results in order."""
    proc = subprocess.run([sys.executable, "-c", _MANY], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [CliResult(argv, *result) for argv, result in zip(cases, json.loads(proc.stdout), strict=True)]


def start_cli(command: str, args: list[str]) -> subprocess.Popen:
    """``python -m agentrl.cli COMMAND ARGS...`` with unbuffered output; stdout and stderr in one text pipe."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", command, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def kill_at(command: str, args: list[str], prefix: str) -> None:
    """Start ``agentrl COMMAND ARGS...`` (:func:`start_cli`) and SIGKILL its process group as soon as it prints a
    line starting with ``prefix`` (a step line, printed once that step's checkpoint is complete); asserts it
    died of that kill."""
    import signal

    proc = start_cli(command, args)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)


def run_here(command: str, args: list[str]) -> str:
    """``agentrl COMMAND ARGS...`` through ``agentrl.cli.main`` in this process; asserts it returned 0 and
    returns what it printed. torch's thread count (``threads=`` sets it) is restored afterwards."""
    import contextlib
    import io

    import torch

    from agentrl.cli import main

    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main([*command.split(), *args])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, out.getvalue()[-3000:]
    return out.getvalue()
