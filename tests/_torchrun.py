"""One way for tests to launch ``torch.distributed.run`` on the CPU, and to say why it failed.

:func:`torchrun` runs ``python -m torch.distributed.run --standalone --nproc_per_node=N <args>`` with:

- an environment cleaned of a parent's torchrun variables (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``, ...),
  one OpenMP thread per rank, and the agentrl tree under test first on ``PYTHONPATH``;
- gloo and the rendezvous on the loopback interface (``GLOO_SOCKET_IFNAME=lo`` where it exists, ``--local-addr 127.0.0.1``),
  so a host name that resolves to an address of another interface cannot break the launch;
- one more try when the launch failed in the transport (rendezvous, store or gloo connection errors), which is
  the machine's failure, never the code's: a worker's own exception or assertion fails at once;
- on failure, ``pytest.fail`` with every rank's output (not a truncated repr), so a CI log shows the traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import agentrl

AGENTRL_TREE = str(Path(agentrl.__file__).resolve().parent.parent)
"""The directory that holds the ``agentrl`` package under test; the ranks import it first."""

_PARENT_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT")

TRANSPORT_FAILURE = re.compile(
    r"DistNetworkError|DistStoreError|RendezvousError|RendezvousTimeoutError|Address already in use"
    r"|Connection (?:reset|refused|closed) by peer|Connection refused|Socket Timeout|connectFullMesh"
    r"|gloo/transport/tcp"
)
"""What a launch that failed in the machine's transport, not in the code under test, prints."""


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test launch (see the module docstring); ``extra`` overrides."""
    env = {k: v for k, v in os.environ.items()
           if k not in _PARENT_LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": os.pathsep.join(p for p in (AGENTRL_TREE, os.environ.get("PYTHONPATH")) if p)})
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(extra or {})
    return env


def torchrun(args: list[str], *, nproc: int = 2, cwd: str | Path | None = None, timeout: float = 300,
             env: dict[str, str] | None = None, tries: int = 2) -> subprocess.CompletedProcess:
    """Run ``args`` (a script and its arguments, or ``-m module ...``) on ``nproc`` local CPU ranks; returns the
    finished process (exit code 0), or fails the test with every rank's output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--local-addr", "127.0.0.1", *args]
    return run_launch(cmd, cwd=cwd, timeout=timeout, env=env, tries=tries)


def run_launch(cmd: list[str], *, cwd: str | Path | None = None, timeout: float = 300,
               env: dict[str, str] | None = None, tries: int = 2) -> subprocess.CompletedProcess:
    """Run ``cmd``, a command that launches ranks itself (e.g. ``agentrl train trainer.n_gpus=2``), in the
    environment of :func:`torchrun_env`, with the same retry and failure report as :func:`torchrun`."""
    attempt = 1
    while True:
        proc = subprocess.run(cmd, cwd=cwd, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return proc
        output = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-12000:]}"
        if attempt < tries and TRANSPORT_FAILURE.search(proc.stderr):
            print(f"torchrun try {attempt} failed in the transport; trying again:\n{output}", file=sys.stderr)
            attempt += 1
            continue
        pytest.fail(f"torchrun exited {proc.returncode} (try {attempt} of {tries}): {' '.join(map(str, cmd))}\n{output}",
                    pytrace=False)
