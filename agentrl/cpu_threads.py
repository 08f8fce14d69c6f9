"""How torch's CPU threads wait and how many there are: set by the ``agentrl`` command before torch loads.

torch runs its CPU kernels on a GNU OpenMP (libgomp) thread pool. With no wait policy set, a libgomp thread
that has to wait (for the next parallel region, or at a barrier for a thread the kernel has not scheduled
yet) spins for 300,000 iterations, about 3 ms, before it sleeps. On an idle machine the other thread
arrives within microseconds. On a busy one it is often descheduled for a whole time slice, and the spinning
thread burns its 3 ms for nothing, taking the CPU from that very thread and from everything else: the
same work then costs several times the CPU-seconds (``benchmarks/contention_bench.py``: ``agentrl eval``
beside a competing load).

:func:`configure` sets, for what the user left unset:

- ``GOMP_SPINCOUNT=30000``: a waiting thread spins a tenth as long (about 0.3 ms) before it sleeps, so on a
  busy machine it burns a tenth of the CPU for nothing, while on a quiet one the other thread still arrives
  within the spin. ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) is slower on a quiet machine (the A/B in
  benchmarks/RESULTS.md, "The embedded default after the 2026-12-02 merges ... and OpenMP waiting"); the user can still choose it. Nothing is set when
  ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set already.
- ``OMP_NUM_THREADS``: the CPUs this process may use (its affinity mask, and its cgroup's CPU quota) when
  they are fewer than the machine's; torch would otherwise size its pool by the machine's cores, e.g. 64
  threads in a container limited to 2 CPUs.

libgomp reads its environment when torch is imported (and child processes inherit it), so the settings
must be in place before: :func:`configure` does nothing once torch is loaded.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

#: the spin count :func:`configure` sets when the user set neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``
SPIN_COUNT = "30000"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_dirs(proc_cgroup: str) -> list[Path]:
    """The cgroup directories of this process that may limit its CPU, innermost first (v2 and v1)."""
    dirs = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            base = CGROUP_ROOT
        elif "cpu" in controllers.split(","):
            base = CGROUP_ROOT / controllers
            if not base.is_dir():
                base = CGROUP_ROOT / "cpu"
        else:
            continue
        here = base / path.lstrip("/")
        while True:  # a parent's quota limits its children too
            dirs.append(here)
            if here == base:
                break
            here = here.parent
    return dirs


def _quota(directory: Path) -> float | None:
    """CPUs allowed by the quota in ``directory`` (``cpu.max`` or ``cpu.cfs_quota_us``), None if unlimited."""
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (directory / "cpu.cfs_quota_us").is_file():
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by the CPU quota of its cgroups (rounded up)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        return cpus
    quotas = [q for q in map(_quota, _cgroup_dirs(proc_cgroup)) if q is not None]
    if quotas:
        cpus = min(cpus, max(1, math.ceil(min(quotas))))
    return cpus


def configure(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``GOMP_SPINCOUNT`` and ``OMP_NUM_THREADS`` in ``environ`` (default ``os.environ``) as the
    module docstring says, never overriding the user's; returns the variables set. Nothing is set once
    torch is imported (too late for libgomp)."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        return {}
    chosen: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        chosen["GOMP_SPINCOUNT"] = SPIN_COUNT
    cpus = available_cpus()
    if "OMP_NUM_THREADS" not in environ and cpus < (os.cpu_count() or cpus):
        chosen["OMP_NUM_THREADS"] = str(cpus)
    environ.update(chosen)
    return chosen
