"""Run ``agentrl <command>`` in a child process, as a user would (own session, so a test can kill it with its
whole process group), for tests of crash-and-resume."""

from __future__ import annotations

import os
import subprocess
import sys


def start_cli(command: str, args: list[str]) -> subprocess.Popen:
    """``python -m agentrl.cli COMMAND ARGS...`` with unbuffered output; stdout and stderr in one text pipe."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", command, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def finish_cli(proc: subprocess.Popen, timeout: float) -> str:
    """Wait up to ``timeout`` seconds for ``proc``; assert it exited 0; return its output."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out
