"""How one execution is confined: its pid, mount, IPC and network namespaces, tmpfs, /proc, memory cgroup,
rlimits, uid, capabilities and seccomp filter, set up in the child the worker forks for it."""

import os
import resource
import struct

from .execute import WORKDIR
from .kernel import kernel_main
from .libc import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    PR_SET_DUMPABLE,
    PR_SET_SECCOMP,
    SECCOMP_MODE_FILTER,
    _check,
    _clear_capabilities,
    _prctl,
    _sys_mount,
    _sys_prctl,
    _sys_setns,
    _sys_unshare,
    _unshare,
)
from .procs import SETUP_DONE, _close, _report_setup_failure, _rmtree

#: Options of each execution's /proc: its own pid namespace (so only its own processes), processes only (no
#: system-wide files such as /proc/locks, /proc/stat or /proc/cmdline, which would be channels or leak the host),
#: and only those of its own uid (not its session's init).
_PROC_OPTIONS = b"hidepid=invisible,subset=pid"


class Confinement:
    """The part of :class:`~.worker.Worker` that sets up one execution's process (a mixin: the worker's
    ``__init__`` sets the attributes it reads: ``mode``, ``cfg``, ``cap``, ``base_rlimits``, ``tmp_opts``,
    ``shm_opts``, ``child_filter``, ``pidns_fd``, ``own_net_fd``, ``run_net_fd`` and ``run_unix_fd``)."""

    # -- namespaces of executions
    def fork_execution(self):
        """fork(); in isolated modes the child is pid 1 of a new pid namespace: it sees no other execution's
        processes or pids, and when it dies the kernel ends every other process of its namespace.

        Every fork of the worker after its startup goes through here. Between two executions the namespace the
        worker's children would enter stays the last execution's: the kernel makes a new pid namespace only from
        the caller's own, so each call first goes back to it. Going back right after the fork would cost more (it
        was a tenth of a millisecond): until the child exits, every page the worker writes is copied."""
        if self.pidns_fd is None:
            return os.fork()
        _check(_sys_setns(self.pidns_fd, CLONE_NEWPID), "setns")
        _unshare(CLONE_NEWPID)
        return os.fork()

    def new_run_netns(self):
        """A fresh network namespace for the stateless runs (each session has its own). Unix sockets that a run
        leaves in flight live there until the kernel's garbage collector frees them; the worker watches them
        through ``run_unix_fd`` and starts a fresh namespace for later runs when any are left."""
        _unshare(CLONE_NEWNET)
        try:
            net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            unix = os.open("/proc/self/net/unix", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            _check(_sys_setns(self.own_net_fd, CLONE_NEWNET), "setns")
        for fd in (self.run_net_fd, self.run_unix_fd):
            if fd is not None:
                _close(fd)
        self.run_net_fd, self.run_unix_fd = net, unix

    # -- the child's confinement
    def plan(self, uid, cpu_s, memory_bytes, own_net, name):
        """What :meth:`enter_namespaces` and :meth:`drop_into_code` need for one execution, computed in the worker
        before the fork (a child pays for every page it writes, so it should only make system calls)."""
        rlimits = list(self.base_rlimits)
        if memory_bytes is not None:
            rlimits.append((resource.RLIMIT_AS, (memory_bytes, memory_bytes)))
        if cpu_s is not None:
            rlimits.append((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)))
        flags = CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if own_net else 0)
        workdir = WORKDIR if self.mode != "none" else self.unsafe_workdir(name)
        net_fd = None if own_net else self.run_net_fd
        return uid, flags, self.tmp_opts % (uid, uid), rlimits, own_net, net_fd, workdir

    def enter_namespaces(self, plan, cgroup_procs):
        """In a freshly forked child (still with the worker's privileges): private mount, IPC and network
        namespaces, tmpfs /tmp and /dev/shm, a /proc of its own pid namespace (pids only), its memory cgroup."""
        _, flags, tmp_opts, _, own_net, net_fd, _ = plan
        if self.mode != "none":
            _check(_sys_unshare(flags), "unshare")
            if net_fd is not None:
                _check(_sys_setns(net_fd, CLONE_NEWNET), "setns")
            _check(_sys_mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, tmp_opts), "mount /tmp")
            _check(
                _sys_mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, self.shm_opts),
                "mount /dev/shm",
            )
            proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            _check(_sys_mount(b"proc", b"/proc", b"proc", proc_flags, _PROC_OPTIONS), "mount /proc")
            if own_net:  # a session lists its own POSIX queues (a stateless run skips the cost)
                _check(_sys_mount(b"mqueue", b"/dev/mqueue", b"mqueue", proc_flags, None), "mount mqueue")
        if cgroup_procs is not None:
            os.write(cgroup_procs, b"0")

    def drop_into_code(self, plan, fds, status_fd):
        """Last steps before the code runs, in the process that will run it: own session, fds 0..N, rlimits, the
        code's uid, no capabilities, the seccomp filter. Then one byte on ``status_fd`` says setup is done, and
        the fd is closed: the code never holds the channel on which the sandbox reports its own failures."""
        uid, _, _, rlimits, _, _, workdir = plan
        os.setsid()
        isolated = self.mode != "none"
        if isolated:
            # The worker is not dumpable, so its child's /proc files are not the child's to write until this.
            _prctl(PR_SET_DUMPABLE, 1)
        try:  # the code, never the worker, is the OOM killer's choice
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(fd, b"1000")
            os.close(fd)
        except OSError:
            pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(len(fds), status_fd)
        os.closerange(status_fd + 1, 1 << 16)
        for res, value in rlimits:
            resource.setrlimit(res, value)
        if self.mode == "root":
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root of the worker's namespace: clears every capability
        if isolated:
            _clear_capabilities()
            _prctl(PR_SET_DUMPABLE, 1)  # again (the uid change reset it): the code sees its own processes
            if self.child_filter is not None:
                _check(_sys_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self.child_filter, 0, 0), "seccomp")
        os.chdir(workdir)
        if not isolated:  # isolated: HOME and TMPDIR are always WORKDIR, set once in the worker
            os.environ["HOME"] = os.environ["TMPDIR"] = workdir
        os.write(status_fd, SETUP_DONE)
        os.close(status_fd)

    def session_init(self, plan, fds, status_fd):
        """Pid 1 of a session's pid namespace (the worker's uid, no capabilities): start the kernel (pid 2), reap
        every process orphaned in the namespace, report the kernel's wait status on ``status_fd``, then exit,
        which ends every process left in the namespace."""
        kernel = os.fork()
        if kernel == 0:
            try:
                self.drop_into_code(plan, fds, status_fd)
            except BaseException as exc:
                _report_setup_failure(status_fd, exc)
                os._exit(71)
            kernel_main(self.cap)
        os.closerange(0, status_fd)
        os.closerange(status_fd + 1, 1 << 16)
        _clear_capabilities()
        while True:
            pid, status = os.wait()
            if pid == kernel:
                os.write(status_fd, b"W" + struct.pack(">i", status))
                os._exit(0)

    def unsafe_workdir(self, name):
        """Mode "none": the host directory that serves as an execution's working directory."""
        return os.path.join(self.cfg["tmp_root"], name)

    def make_unsafe_workdir(self, name):
        path = self.unsafe_workdir(name)
        _rmtree(path)
        os.mkdir(path, 0o700)
