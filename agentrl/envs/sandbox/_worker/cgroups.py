"""The worker's memory cgroups: one for the stateless runs, one per session."""

import os
import time


class Cgroups:
    """The worker's view of its memory cgroup (a directory fd from the host): a ``run`` child (created by the host;
    replaced by ``run<N>`` children the worker creates if a finished run's memory is not freed) holds the
    stateless runs, ``s<uid>`` (created here) one session each. All paths are relative to that fd, so no cgroup
    filesystem is mounted in the sandbox."""

    def __init__(self, cfg):
        self.dir_fd = cfg["fd"]
        self.version = cfg["version"]
        self.limit_file = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        # Opened while the worker is still root on the host (these files stay root's); written through later.
        self.run_name = "run"
        self.run_procs = os.open("run/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        self.run_limit_fd = os.open("run/" + self.limit_file, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        self.run_limit = None
        self.run_stat = os.open("run/memory.stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        self.usage_file = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        #: memory.stat lines (each after a newline) that count anonymous and shared memory.
        self.held_keys = (
            (b"\ntotal_rss ", b"\ntotal_shmem ") if self.version == 1 else (b"\nanon ", b"\nshmem ")
        )

    def set_limit(self, name, limit):
        fd = os.open(f"{name}/{self.limit_file}", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        try:
            os.write(fd, str(limit).encode())
        finally:
            os.close(fd)

    def set_run_limit(self, limit):
        if limit != self.run_limit:
            os.pwrite(self.run_limit_fd, str(limit).encode(), 0)
            self.run_limit = limit

    def replace_run(self):
        """Give the stateless runs a fresh cgroup ``run-<random>``; returns the old one's name (the caller removes
        it once its memory is freed). The code reads its cgroup's name in /proc/self/cgroup: a count in it would
        tell a run how often earlier runs left memory behind, which a run can choose to do."""
        name = _random_name("run")
        os.mkdir(name, dir_fd=self.dir_fd)
        stat = os.open(f"{name}/memory.stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        procs = os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        limit = os.open(f"{name}/{self.limit_file}", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        for fd in (self.run_procs, self.run_limit_fd, self.run_stat):
            os.close(fd)
        old, self.run_name = self.run_name, name
        self.run_stat, self.run_procs, self.run_limit_fd, self.run_limit = stat, procs, limit, None
        return old

    def create_session(self, uid, limit):
        """A fresh cgroup for one session; returns (name, an fd of its cgroup.procs to join it). Its name is
        random (the code reads it in /proc/self/cgroup; a count would tell how many sessions this worker made)."""
        name = _random_name(f"s{uid}")
        os.mkdir(name, dir_fd=self.dir_fd)
        self.set_limit(name, limit)
        return name, os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def remove(self, name):
        """Remove a cgroup once its processes are gone; False if it cannot be removed."""
        for _ in range(100):
            try:
                os.rmdir(name, dir_fd=self.dir_fd)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.002)
        return False

    def held(self, name):
        """Bytes of anonymous memory and shared memory (SysV, POSIX, tmpfs) still charged to ``name``."""
        if name == self.run_name:
            text = os.pread(self.run_stat, 1 << 16, 0)
        else:
            text = self._read(f"{name}/memory.stat")
            if text is None:
                return 0
        text = b"\n" + text
        total = 0
        for key in self.held_keys:
            at = text.find(key)
            if at >= 0:
                end = text.find(b"\n", at + len(key))
                total += int(text[at + len(key) : end if end >= 0 else len(text)])
        return total

    def held_all(self, name):
        """Bytes charged to ``name`` that reclaim cannot take back: everything but its file cache (so also kernel
        memory such as pipe and socket buffers, which :meth:`held` does not count)."""
        usage = self._read(f"{name}/{self.usage_file}")
        stat = self._read(f"{name}/memory.stat")
        if usage is None or stat is None:
            return 0
        fields = dict(line.split(b" ", 1) for line in stat.splitlines() if b" " in line)
        if self.version == 1:
            cache = int(fields.get(b"total_active_file", 0)) + int(fields.get(b"total_inactive_file", 0))
        else:
            cache = int(fields.get(b"file", 0)) - int(fields.get(b"shmem", 0))
        return max(0, int(usage) - cache)

    def _read(self, path):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:
            return None
        try:
            return os.read(fd, 1 << 16)
        finally:
            os.close(fd)

    def oom_kills(self, name):
        """How many processes the OOM killer has ended in ``name`` so far."""
        events = "memory.oom_control" if self.version == 1 else "memory.events"
        return self._counter(f"{name}/{events}", "oom_kill")

    def worker_limit_hits(self):
        """How often the worker's whole cgroup reached its own limit so far (v1 ``memory.failcnt``, v2 the
        ``max`` events of the worker's cgroup alone)."""
        if self.version == 1:
            text = self._read("memory.failcnt")
            return int(text) if text else 0
        return self._counter("memory.events.local", "max")

    def _counter(self, path, key):
        text = self._read(path)
        for line in (text or b"").decode().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0


def _random_name(prefix):
    return f"{prefix}-{os.urandom(6).hex()}"
