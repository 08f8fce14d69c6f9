"""An aggregate memory cap per sandbox worker, with a memory cgroup (v1, or v2 where the controller is
delegated to our own cgroup).

RLIMIT_AS bounds one process; a cgroup bounds the sum over everything a worker runs (its session kernels
and every process the code forks), so ``max_processes x memory_mb`` can no longer exhaust the host. When the
cap is reached the kernel's OOM killer picks a victim inside the cgroup only. It never picks
bubblewrap's processes (``oom_score_adj`` -1000, set by the host), and the worker and the code it forks
carry +1000, so the kernel picks the largest of them: the process that hogs memory.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

_V1_ROOT = Path("/sys/fs/cgroup/memory")
#: Name prefix of our cgroups: ``agentrl-sandbox-<owner pid>-<worker>-<generation>``.
PREFIX = "agentrl-sandbox-"


def _own_memory_cgroup() -> tuple[Path, int] | None:
    """This process's memory cgroup directory and the cgroup version, or None if there is none we can use."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and _V1_ROOT.is_dir():
            return _V1_ROOT / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            mount = _cgroup2_mount()
            if mount is not None:
                return mount / line[3:].lstrip("/"), 2
    return None


def _cgroup2_mount() -> Path | None:
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ")
            if len(fields) == 2 and fields[1].startswith("cgroup2 "):
                return Path(line.split()[4])
    except OSError:
        pass
    return None


class MemoryCgroup:
    """One child memory cgroup with a hard limit; processes are added with :meth:`add`."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | None:
        """Create ``name`` under our own memory cgroup with ``limit_bytes``; None if this is not possible
        (no memory controller, not writable, or, on v2, not delegated to our cgroup)."""
        found = _own_memory_cgroup()
        if found is None:
            return None
        parent, version = found
        _remove_stale(parent)
        path = parent / name
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, version)
        try:
            if version == 1:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            else:
                (path / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0")
        except OSError:
            group.remove()
            return None
        return group

    def add(self, pid: int) -> None:
        """Move ``pid`` into this cgroup (its later children are born inside)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Delete the cgroup once its processes are gone (retries briefly while they exit)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def _remove_stale(parent: Path) -> None:
    """Delete empty ``agentrl-sandbox-<pid>-...`` cgroups left by pools whose process died without closing."""
    try:
        names = [p.name for p in parent.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                (parent / name).rmdir()


def descendants(pid: int) -> list[int]:
    """``pid`` and all its descendants, from a scan of /proc (for moving a just-started sandbox whole)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def protect_from_oom(pid: int) -> None:
    """Make ``pid`` exempt from the OOM killer (needs root)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/oom_score_adj").write_text("-1000")


def command_name(pid: int) -> str:
    """The process's ``comm`` (executable name), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
