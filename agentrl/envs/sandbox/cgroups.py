"""Memory accounting per sandbox worker and per execution, with memory cgroups (v1, or v2 where the controller
is delegated to our own cgroup), and a CPU cgroup per worker (:class:`CpuCgroup`).

RLIMIT_AS bounds one process's mappings; a cgroup bounds everything an execution holds, its processes and the
shared memory and tmpfs files it creates, which no rlimit sees. Each worker gets a cgroup capped at the
worker's total (its session kernels and every process the code forks), and inside it one child per execution
capped at the execution's limit (see :class:`MemoryCgroup`). When a cap is reached the kernel's OOM killer
picks a victim inside that cgroup only. bubblewrap's processes and the worker carry ``oom_score_adj`` -1000
(set by the host) and the code +1000.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

_V1_ROOT = Path("/sys/fs/cgroup/memory")
#: Name prefix of our cgroups: ``agentrl-sandbox-<owner pid>-<pool>-<worker>-<generation>``.
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
    """One worker's memory cgroup: a hard limit on everything the sandbox runs, with three kinds of children.

    - ``sys``: bubblewrap and the worker itself (born there, so the cgroup namespace shows nothing of the host);
    - ``run``: the worker's stateless runs, one at a time; the worker sets its limit to the run's memory limit
      (or less, when its sessions hold the rest of the worker), and replaces it with a ``run<N>`` of its own if a
      finished run's memory is not given back in time;
    - ``s<uid>-<n>``: one per session, created and removed by the worker (the directory is delegated to it: its
      owner is the worker's host uid, so it can create children but never raise the limit above).

    Every execution's memory, including SysV/POSIX shared memory and tmpfs files, is charged to its own child,
    and an OOM kill there stays there: it can never pick the worker or another session.
    """

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @classmethod
    def create(cls, name: str, limit_bytes: int, owner_uid: int | None = None) -> MemoryCgroup | None:
        """Create ``name`` (with ``sys`` and ``run``) under our own memory cgroup with ``limit_bytes``; None if
        this is not possible (no memory controller, not writable, or, on v2, not delegated to our cgroup).
        ``owner_uid``: delegate the directory to this host uid (the worker's, in root mode)."""
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
                (path / "cgroup.subtree_control").write_text("+memory")
            for child in ("sys", "run"):
                (path / child).mkdir()
            if owner_uid is not None:
                for entry in (path, path / "cgroup.procs"):
                    os.chown(entry, owner_uid, owner_uid)
        except OSError:
            group.remove()
            return None
        return group

    def open_dir(self) -> int:
        """A new O_DIRECTORY fd of this cgroup (handed to the worker; the caller closes its copy)."""
        return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)

    def add(self, pid: int, child: str = "sys") -> None:
        """Move ``pid`` into ``child`` (its later children are born inside)."""
        (self.path / child / "cgroup.procs").write_text(str(pid))

    def remove_quietly(self) -> None:
        """Delete the cgroup tree if it is empty; never waits."""
        with contextlib.suppress(OSError):
            for child in self.path.iterdir():
                if child.is_dir():
                    child.rmdir()
            self.path.rmdir()

    def remove(self) -> None:
        """Delete the cgroup and its children once their processes are gone (retries briefly while they exit)."""
        for _ in range(100):
            try:
                for child in self.path.iterdir():
                    if child.is_dir():
                        with contextlib.suppress(FileNotFoundError):
                            child.rmdir()
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


class CpuCgroup:
    """One worker's CPU cgroup (v1 ``cpu`` controller, or v2 where ``cpu`` is enabled for our cgroup's children):
    bubblewrap, the worker and everything its executions start are born inside, and the code cannot leave it (no
    cgroup filesystem in the sandbox, and a cgroup namespace rooted here).

    A worker runs one request at a time and stops its idle sessions' kernels between calls, so the group is the
    running execution's: the kernel's scheduler gives it one share (``cpu.shares`` 1024, v2 ``cpu.weight`` 100)
    however many processes, threads, process groups or sessions it makes, against each other worker's execution
    and every other entity in our own CPU cgroup. Without it, scheduler autogroups group by session only for
    processes in the root CPU cgroup; in a CPU cgroup of its own (a container) each process had a share.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str) -> CpuCgroup | None:
        """Create ``name`` under our own CPU cgroup; None if there is none we can write."""
        parent = _own_cpu_cgroup()
        if parent is None:
            return None
        _remove_stale(parent)
        try:
            (parent / name).mkdir()
        except OSError:
            return None
        return cls(parent / name)

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def remove(self) -> None:
        """Delete the cgroup once its processes are gone (retries briefly while they exit)."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def _own_cpu_cgroup() -> Path | None:
    """The directory of this process's CPU cgroup, if its children can get CPU shares of their own."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = [line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" not in controllers.split(","):
            continue
        for head, tail in (m for m in mounts if len(m) == 2):
            fstype, _, options = tail.split()[:3]
            if fstype == "cgroup" and "cpu" in options.split(","):
                root, mount_point = head.split()[3:5]
                inside = os.path.relpath(path, root) if path.startswith(root) else None
                if inside is not None and not inside.startswith(".."):
                    return (Path(mount_point) / inside).resolve()
        return None
    mount = _cgroup2_mount()
    for line in lines:
        if line.startswith("0::") and mount is not None:
            own = mount / line[3:].lstrip("/")
            try:
                if "cpu" in (own / "cgroup.subtree_control").read_text().split():
                    return own
            except OSError:
                return None
    return None


def _remove_stale(parent: Path) -> None:
    """Delete empty ``agentrl-sandbox-<pid>-...`` cgroups left by pools whose process died without closing."""
    try:
        names = [p.name for p in parent.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            MemoryCgroup(parent / name, 0).remove_quietly()  # (a CPU cgroup is a directory without children)


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
    """The process's ``comm`` (executable name; any bytes its process chose, so never assumed to be UTF-8), or
    "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().decode("utf-8", "replace").strip()
    except OSError:
        return ""
