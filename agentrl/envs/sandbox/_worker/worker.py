"""The worker: answers the host's requests, runs stateless runs and sessions, collects their output, and
after every request cleans up and checks that the sandbox is as clean as a fresh one."""

import collections
import ctypes
import os
import resource
import select
import signal
import time

from .confine import Confinement
from .execute import _precompile, execute, fresh_main
from .frames import _HEADER, parse_result, result_frame_limit, write_frame, write_result
from .kernel import Kernel, kernel_main
from .procs import (
    SETUP_DONE,
    Leftovers,
    _alive,
    _await_exit_status,
    _await_setup,
    _close,
    _cpu_seconds,
    _decode,
    _drain_nonblocking,
    _drain_stale,
    _first_child,
    _frame_complete,
    _kick_unix_gc,
    _kill,
    _lines,
    _read_rest,
    _read_some,
    _reap,
    _report_setup_failure,
    _rmtree,
    _running,
    _signal,
    _signame,
    _status_pipe,
    _stdin_fd,
    _uid_tasks,
)

#: How long the worker sleeps on a stateless run's exit alone before it also reads the run's pipes, seconds.
_QUIET_WAIT_S = 0.01
#: The worker's health check waits at most this long for the kernel to free a finished run's memory.
_SETTLE_S = 2.0
#: How often an idle worker checks that its sessions' kernels stay stopped, and the CPU time one may use between
#: two calls before it is killed (seconds). See Worker.watch_idle.
_IDLE_CHECK_S, _IDLE_CPU_S = 0.1, 0.5
#: The shortest wait between two checks of a session kernel's CPU time during a call, seconds (see collect).
_CPU_CHECK_MIN_S = 0.05
#: How long a session's kernel may take to be set up, seconds.
_SETUP_TIMEOUT_S = 10.0


class Worker(Confinement):
    """One worker: its requests (:meth:`handle`), its executions and sessions, and its health check."""

    def __init__(self, cfg, child_filter, cgroups):
        self.cfg = cfg
        self.cap = cfg["output_cap"]
        self.mode = cfg["mode"]
        # The code's seccomp program (a sock_fprog address for prctl), or None.
        self.child_filter = ctypes.addressof(child_filter[0]) if child_filter is not None else None
        self._child_filter_keepalive = child_filter
        lim = cfg["limits"]
        self.base_rlimits = (
            (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
            (resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"])),
        )
        size = b"size=%d,nr_inodes=%d," % (cfg["tmpfs_bytes"], cfg["tmpfs_inodes"])
        self.tmp_opts = size + b"mode=0700,uid=%d,gid=%d"  # % (uid, uid)
        self.shm_opts = size + b"mode=1777"
        self.kernels = {}  # session key -> Kernel
        self.me = os.getpid()
        self.cpus = len(os.sched_getaffinity(0))  # how many CPUs one execution's threads may use at once
        self.cgroups = cgroups
        # Code uids, least recently used first; a uid is here only while no task of it exists.
        if self.mode == "root":
            self.free_uids = collections.deque(
                range(cfg["uid_base"] + 1, cfg["uid_base"] + cfg["n_uids"] + 1)
            )
        else:
            self.free_uids = collections.deque([os.getuid()])
        self.refusal = None  # why this worker takes no new work (its health check failed)
        self.baseline_fds = None
        self.pending = []  # (uid, cgroup, working dir) of executions ended by the last request, to release
        self.ran_stateless = False  # the last request was a stateless run
        self.strays_left = None  # pids the last request's stray sweep left (zombies), or None if not swept
        self.oom_seen = {}  # cgroup -> OOM kills counted so far
        #: Memory all executions of this worker may hold together, and the share each live session (and the
        #: stateless runs) is guaranteed of it, bytes.
        self.capacity, self.reserved = cfg["worker_bytes"], cfg["reserved_bytes"]
        self.evicted = {}  # session key -> MiB it held when it was ended to make room for another execution
        self.orphans = {}  # replaced cgroup -> bytes it still held (memory of finished executions not yet freed)
        self.limit_hits = cgroups.worker_limit_hits() if cgroups is not None else 0
        isolated = self.mode != "none"
        self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if isolated else None
        self.own_net_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC) if isolated else None
        # opened in the worker's own network namespace
        self.leftovers = Leftovers(cfg.get("sysvipc_fds") or {}) if isolated else None
        self.run_net_fd = self.run_unix_fd = None
        if isolated:
            self.new_run_netns()
        # The status channel of stateless runs (one at a time): each child reports its setup on it, then closes its
        # copy; the worker reads what is there once the child is gone.
        self.run_status_r, self.run_status_w = _status_pipe()
        os.set_blocking(self.run_status_r, False)

    # -- requests
    def handle(self, req):
        op = req.get("op")
        if op == "run":
            if req.get("session") is None:
                if self.refusal:
                    return {"refused": self.refusal}
                return self.run_stateless(req)
            if req["session"] not in self.kernels and self.refusal:
                return {"refused": self.refusal}
            return self.run_in_kernel(req)
        if op == "close":
            self.end_kernel(req["session"])
            self.evicted.pop(req["session"], None)
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def take_uid(self):
        if not self.free_uids:
            raise RuntimeError("no free uid left in this worker's block")
        return self.free_uids.popleft() if self.mode == "root" else self.free_uids[0]

    def run_stateless(self, req):
        memory = self.cfg["limits"]["as_bytes"]
        if req.get("memory_bytes"):  # a per-run limit may only lower the pool's
            memory = min(int(req["memory_bytes"]), memory)
        limit = self.memory_for(None, memory)
        if limit is None:
            return {"refused": "the memory of finished executions is not freed"}
        start = time.monotonic()  # making room above is the worker's business, not charged to the run
        uid = self.take_uid()
        self.ran_stateless = True
        if self.cgroups is not None:
            self.cgroups.set_run_limit(limit)
        self.pending.append((uid, self.cgroups.run_name if self.cgroups is not None else None, "run"))
        if self.mode == "none":
            self.make_unsafe_workdir("run")
        cpu_s = int(req["timeout"]) + 1
        compiled = _precompile(req["code"])
        fetch = req.get("fetch_files", ())
        as_limit = memory if memory != self.cfg["limits"]["as_bytes"] else None
        plan = self.plan(uid, cpu_s, as_limit, False, "run")
        (out_r, out_w), (err_r, err_w), (res_r, res_w) = pipes = [os.pipe() for _ in range(3)]
        stdin_fd = _stdin_fd(req["stdin"])
        try:
            pid = self.fork_execution()
        except BaseException:
            for fd in (stdin_fd, *(fd for pair in pipes for fd in pair)):
                _close(fd)
            raise
        if pid == 0:
            self._stateless_child(req, plan, (stdin_fd, out_w, err_w, res_w), self.run_status_w, compiled)
        for fd in (out_w, err_w, res_w, stdin_fd):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        # Sleep until the child exits; read its pipes only then, unless it runs longer (e.g. blocked on a full
        # pipe). Every page the worker writes while the child lives is copied (copy-on-write); once the child is
        # gone, the page is the worker's alone again and merely made writable.
        exited = bool(select.select((pidfd,), (), (), min(_QUIET_WAIT_S, req["timeout"]))[0])
        try:
            col = self.collect(
                (pid, pidfd, out_r, err_r, res_r),
                start + req["timeout"],
                fetch,
                lambda c, _exited: self.stop_run(pid, c),
                exited=exited,
            )
            col["setup"] = _read_rest(self.run_status_r)
        finally:
            for fd in (out_r, err_r, res_r, pidfd):
                _close(fd)
        col["cpu_limit_s"] = cpu_s
        run_cgroup = self.cgroups.run_name if self.cgroups is not None else None
        col["oom_killed"] = self.oom_killed(run_cgroup, col["wait_status"])
        return self.finish(col, start, req["timeout"], memory, limit, session=False)

    def _stateless_child(self, req, plan, fds, status_fd, compiled):
        """The child of a stateless run: confine itself, run the code, send the result; never returns."""
        try:
            self.enter_namespaces(plan, self.cgroups.run_procs if self.cgroups is not None else None)
            self.drop_into_code(plan, fds, status_fd)
        except BaseException as exc:
            _report_setup_failure(status_fd, exc)
            os._exit(71)
        fetch = req.get("fetch_files", ())
        result = execute(req["code"], fresh_main(), False, self.cap, req.get("files"), fetch, compiled)
        try:
            write_result(3, result)
        except OSError:  # the code closed its result channel: its exit status still tells
            pass
        os._exit(result["exit_code"])

    def stop_run(self, pid, col):
        """SIGKILL a stateless run's process (pid 1 of its namespace: every other process of the run dies with
        it) and reap it; records its CPU seconds in ``col``. Returns its wait status."""
        _kill(pid)
        try:
            _, status, usage = os.wait4(pid, 0)
        except ChildProcessError:
            return None
        col["cpu_s"] = usage.ru_utime + usage.ru_stime
        return status

    def start_kernel(self, key):
        """Start a session's kernel; raises RuntimeError if it could not be set up."""
        uid = self.take_uid()
        cgroup = procs = None
        if self.cgroups is not None:
            cgroup, procs = self.cgroups.create_session(uid, self.cfg["limits"]["as_bytes"])
        ctl_r, ctl_w = os.pipe()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = _status_pipe()
        devnull = os.open("/dev/null", os.O_RDONLY)
        if self.mode == "none":
            self.make_unsafe_workdir("s" + key)
        plan = self.plan(uid, None, None, True, "s" + key)
        fds = (devnull, out_w, err_w, ctl_r, res_w)
        child = self.fork_execution()
        if child == 0:
            try:
                self.enter_namespaces(plan, procs)
                if self.mode == "none":
                    self.drop_into_code(plan, fds, st_w)
                    kernel_main(self.cap)
                self.session_init(plan, fds, st_w)
            except BaseException as exc:
                _report_setup_failure(st_w, exc)
            os._exit(71)
        for fd in (ctl_r, res_w, out_w, err_w, devnull, st_w):
            os.close(fd)
        if procs is not None:
            os.close(procs)
        failure = _await_setup(st_r, _SETUP_TIMEOUT_S)
        pid = child if self.mode == "none" or failure else _first_child(child)
        if failure or pid is None:
            _kill(child)
            _reap(child)
            for fd in (ctl_w, res_r, out_r, err_r, st_r):
                _close(fd)
            self.pending.append((uid, cgroup, "s" + key))
            raise RuntimeError(f"the session's kernel could not be set up: {failure or 'no kernel process'}")
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        kernel = Kernel(
            pid, None if self.mode == "none" else child, uid, ctl_w, res_r, out_r, err_r, st_r, cgroup
        )
        self.kernels[key] = kernel
        return kernel

    def end_session(self, kernel, exited):
        """End every process of a session and return the kernel's wait status: the one its init reported if the
        kernel had exited by itself, otherwise that of a SIGKILL."""
        if kernel.init is None:  # mode "none": the kernel is the worker's own child
            try:
                os.killpg(kernel.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill(kernel.pid)
            return _reap(kernel.pid)
        status = _await_exit_status(kernel.status_r, 2.0) if exited else None
        _kill(kernel.init)  # pid 1 of the session's namespace: the kernel ends the rest
        _reap(kernel.init)
        return status if status is not None else signal.SIGKILL  # the wait status of a SIGKILLed process

    def end_kernel(self, key):
        """End a session's kernel (its namespaces and tmpfs die with it); its uid is verified by the check."""
        kernel = self.kernels.pop(key, None)
        if kernel is None:
            return
        self.end_session(kernel, False)
        kernel.close_fds()
        self.pending.append((kernel.uid, kernel.cgroup, "s" + key))

    def run_in_kernel(self, req):
        key = req["session"]
        evicted = self.evicted.pop(key, None)
        limit = self.memory_for(key, self.cfg["limits"]["as_bytes"])
        start = time.monotonic()  # making room above is the worker's business, not charged to the call
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.start_kernel(key)
        else:
            _signal(kernel.pid, signal.SIGCONT)  # frozen since its last call, background threads included
        if self.cgroups is not None and limit is not None and limit != kernel.limit:
            try:
                self.cgroups.set_limit(kernel.cgroup, limit)
                kernel.limit = limit
            except OSError:  # cannot go below what it holds (it only holds what was free): keep the old one
                pass
        self.set_cpu_limit(kernel, req["timeout"])
        for fd in (kernel.out_r, kernel.err_r):
            _drain_nonblocking(fd)
        _drain_stale(kernel.res_r)
        fetch = req.get("fetch_files", ())
        nonce = os.urandom(8).hex()
        try:
            msg = {
                "code": req["code"],
                "stdin": req["stdin"],
                "files": req.get("files"),
                "fetch_files": fetch,
            }
            write_frame(kernel.ctl_w, {**msg, "nonce": nonce})
        except OSError:
            pass  # the kernel died between calls; collect() sees it exit
        col = self.collect(
            (kernel.pid, kernel.pidfd, kernel.out_r, kernel.err_r, kernel.res_r),
            start + req["timeout"],
            fetch,
            lambda _col, exited: self.end_session(kernel, exited),
            one_shot=False,
            nonce=nonce,
            cpu_cap=None if kernel.cpu_limit is None else kernel.cpu_limit + 1,
        )
        col["setup"] = SETUP_DONE
        col["cpu_limit_s"] = kernel.cpu_limit
        col["oom_killed"] = self.oom_killed(kernel.cgroup, col["wait_status"])
        if col["reset"]:
            self.kernels.pop(key, None)
            kernel.close_fds()
            self.pending.append((kernel.uid, kernel.cgroup, "s" + key))
        else:
            self.freeze(kernel)
            if self.cgroups is not None:
                kernel.held = self.cgroups.held_all(kernel.cgroup)
        reply = self.finish(col, start, req["timeout"], self.cfg["limits"]["as_bytes"], limit, session=True)
        if evicted is not None:
            reply["evicted"] = {"held_mb": evicted, "reserved_mb": self.reserved >> 20}
        return reply

    def freeze(self, kernel):
        """Stop a session's kernel until its next call: a thread it left behind must not burn CPU, start
        processes, or print into later calls, outside any limit. SIGSTOP alone does not hold it (a timer of its
        own, or a child it left that the sweep has not killed yet, may SIGCONT it): :meth:`watch_idle` does."""
        _signal(kernel.pid, signal.SIGSTOP)
        kernel.frozen_cpu = _cpu_seconds(kernel.pid)

    def watch_idle(self):
        """Between requests, every _IDLE_CHECK_S: a session's kernel found running (it resumed itself) is
        stopped again, every process started meanwhile is killed, and once it has used more than _IDLE_CPU_S of
        CPU since its call ended it is killed (its next call reports its state lost). So a session runs between
        calls for at most about that long, and starts nothing that outlives a check."""
        thawed = False
        for kernel in self.kernels.values():
            if not _running(kernel.pid):
                continue
            thawed = True
            if _cpu_seconds(kernel.pid) - kernel.frozen_cpu > _IDLE_CPU_S:
                _kill(kernel.pid)
            else:
                _signal(kernel.pid, signal.SIGSTOP)
        if thawed:
            self.kill_strays()

    def set_cpu_limit(self, kernel, timeout):
        """The CPU-time limit of a session's kernel for its next call: the CPU time it used so far plus the call's
        timeout (a process's CPU limit counts all its life; the kernel dies by SIGXCPU when it is reached).

        Only the soft limit is set. A hard limit, once lowered, could never be raised again for a later call (that
        takes CAP_SYS_RESOURCE on the host, which the worker does not hold), so the kernel's stays as it started;
        :meth:`collect` kills the kernel itself once it passes the soft limit by a second, as the hard limit
        did, even if the code ignores SIGXCPU or raises its own soft limit."""
        soft = int(_cpu_seconds(kernel.pid)) + int(timeout) + 2
        try:
            hard = resource.prlimit(kernel.pid, resource.RLIMIT_CPU)[1]
            if hard != resource.RLIM_INFINITY:  # the code lowered it itself
                soft = min(soft, hard)
            resource.prlimit(kernel.pid, resource.RLIMIT_CPU, (soft, hard))
            kernel.cpu_limit = soft
        except OSError:  # it died between calls; collect() sees it
            pass

    def cpu_check_in(self, pid, cap):
        """Seconds until ``pid`` could at the earliest have used ``cap`` CPU-seconds (every CPU of the sandbox
        busy with it), or 0.0 once it has."""
        return max(0.0, cap - _cpu_seconds(pid)) / self.cpus

    # -- memory shares
    def memory_for(self, key, want):
        """Bytes the execution ``key`` (a session key, or None for a stateless run) may use now: ``want``, or what
        the worker's other executions leave of its capacity if that is less. When less than the reserved share
        is left, idle sessions holding more than their share are ended first, largest excess first (they learn
        why on their next call). None for a stateless run that cannot get its share (the worker refuses it)."""
        if self.cgroups is None:
            return want
        free = self.free_memory(key)
        if free < self.reserved:
            greedy = [k for k, kern in self.kernels.items() if k != key and kern.held > self.reserved]
            for other in sorted(greedy, key=lambda k: -self.kernels[k].held):
                self.evict(other)
                free = self.free_memory(key)
                if free >= self.reserved:
                    break
        if free < self.reserved and key is None:
            return None
        return max(min(want, free), min(want, self.reserved))

    def free_memory(self, key):
        """The worker's capacity less what its other executions hold (and memory not yet freed), bytes."""
        held = sum(kern.held for k, kern in self.kernels.items() if k != key)
        return self.capacity - held - sum(self.orphans.values())

    def evict(self, key):
        """End the idle session ``key`` to give its memory to another execution, and release it now."""
        self.evicted[key] = self.kernels[key].held >> 20
        self.end_kernel(key)
        pending, self.pending = self.pending, []
        for uid, cgroup, name in pending:
            self.release(uid, cgroup, name, self.kill_strays())

    def oom_killed(self, cgroup, wait_status):
        """Whether the OOM killer ended a process of ``cgroup`` during the last run (read only after a SIGKILL
        or when the run's result is missing, the only ways an OOM kill shows)."""
        if self.cgroups is None or cgroup is None:
            return False
        if wait_status is not None and not (
            os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL
        ):
            return False
        count = self.cgroups.oom_kills(cgroup)
        before, self.oom_seen[cgroup] = self.oom_seen.get(cgroup, 0), count
        return count > before

    def worker_limit_hit(self):
        """Whether the worker's whole cgroup reached its own limit since the last look."""
        hits = self.cgroups.worker_limit_hits()
        before, self.limit_hits = self.limit_hits, hits
        return hits > before

    def collect(self, procs, deadline, fetch, stop, exited=False, one_shot=True, nonce="", cpu_cap=None):
        """Gather output until the run finishes (a one-shot child exits, a kernel answers) or the deadline.

        ``procs``: (pid, pidfd, stdout, stderr and result pipes). ``exited``: the process has already exited (its
        output is still in the pipes). When the process is finished (one-shot, died, timed out or corrupted its
        channel) ``stop(col, exited)`` ends it and returns its wait status; in every case all other processes of
        the sandbox are killed after it. The result frame may be at most as large as the request allows
        (:func:`result_frame_limit`) and must carry ``nonce``. ``cpu_cap``: CPU-seconds at which the process is
        killed (checked when it could first have used them), or None.
        """
        pid, pidfd, out_r, err_r, res_r = procs
        bufs = {out_r: bytearray(), err_r: bytearray()}
        dropped = {out_r: 0, err_r: 0}
        res_buf = bytearray()
        limit = result_frame_limit(self.cap, fetch)
        col = {"result": None, "timed_out": False, "wait_status": None, "bad_frame": False, "reset": False}
        col["over_cpu"] = False
        poller = select.poll()
        for fd in (out_r, err_r, res_r, pidfd):
            poller.register(fd, select.POLLIN)
        # the first check: the call's cap lies at least its time limit beyond what the process had used
        now = time.monotonic()
        check_at = now + max(0.0, deadline - now) / self.cpus if cpu_cap is not None else float("inf")
        while not exited:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                col["timed_out"] = True
                break
            if now >= check_at:
                wait = self.cpu_check_in(pid, cpu_cap)
                if wait <= 0.0:
                    col["over_cpu"], col["cpu_s"] = True, _cpu_seconds(pid)
                    break
                check_at = now + max(wait, _CPU_CHECK_MIN_S)
            for fd, _ in poller.poll(max(0.0, min(remaining, check_at - now)) * 1000.0):
                if fd in bufs:
                    if not self._pump(fd, bufs, dropped):
                        poller.unregister(fd)
                elif fd == res_r:
                    chunk = _read_some(res_r)
                    if not chunk:
                        poller.unregister(res_r)
                    res_buf += chunk
                elif fd == pidfd:
                    exited = True
            if len(res_buf) > limit:
                col["bad_frame"] = True
                break
            if not one_shot and _frame_complete(res_buf):
                break
        finished = one_shot or exited or col["timed_out"] or col["bad_frame"] or col["over_cpu"]
        if finished:
            col["wait_status"] = stop(col, exited)
        self.strays_left = self.kill_strays()
        # Every writer is dead now; for a live kernel, all it wrote before answering is already in the pipe.
        drain_deadline = time.monotonic() + 2.0
        for fd in (out_r, err_r):
            self._drain(fd, bufs, dropped, drain_deadline if finished else None)
        if one_shot:
            res_buf += _read_rest(res_r)
        if res_buf and not col["bad_frame"]:
            try:
                if not _frame_complete(res_buf) or len(res_buf) != 4 + _HEADER.unpack(bytes(res_buf[:4]))[0]:
                    raise ValueError("incomplete or trailing result frame")
                col["result"] = parse_result(bytes(res_buf[4:]), fetch, self.cap, nonce)
            except (ValueError, RecursionError, UnicodeDecodeError):
                col["result"], col["bad_frame"] = None, True
        col["reset"] = not one_shot and (finished or col["result"] is None)
        if col["reset"] and not finished:  # it answered, but with a corrupt frame: end it
            col["wait_status"] = stop(col, False)
        col["stdout"], col["stdout_dropped"] = bytes(bufs[out_r]), dropped[out_r]
        col["stderr"], col["stderr_dropped"] = bytes(bufs[err_r]), dropped[err_r]
        return col

    def _pump(self, fd, bufs, dropped):
        """Move available bytes from ``fd`` into its capped buffer; False at EOF or when nothing is ready."""
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return False
        if not chunk:
            return False
        room = self.cap - len(bufs[fd])
        if room > 0:
            bufs[fd] += chunk[:room]
        dropped[fd] += len(chunk) - max(0, min(room, len(chunk)))
        return True

    def _drain(self, fd, bufs, dropped, deadline):
        """Read ``fd`` to EOF (waiting until ``deadline``), or, with no deadline, only what is ready now."""
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                if (
                    deadline is None
                    or not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
                ):
                    return
                continue
            except OSError:
                return
            if not chunk:
                return
            room = self.cap - len(bufs[fd])
            if room > 0:
                bufs[fd] += chunk[:room]
            dropped[fd] += len(chunk) - max(0, min(room, len(chunk)))

    def finish(self, col, start, timeout, memory, limit, session):
        """The answer to a run: output, status, and an ``event`` (what happened, for the host to word).

        ``memory``: the execution's own limit; ``limit``: what its memory cgroup allowed this time (less when the
        worker's other executions held the rest of its capacity)."""
        duration = time.monotonic() - start
        result = col["result"] or {}
        status = result.get("kind")
        exit_code = result.get("exit_code")
        event = None
        ws = col["wait_status"]
        if col["timed_out"]:  # (a time limit too short for even the setup is still the run's)
            status, exit_code = "timeout", None
            event = {"kind": "timeout", "timeout_s": timeout}
        elif not col["setup"].startswith(SETUP_DONE):  # the sandbox failed before any code ran
            detail = col["setup"][1:].decode(errors="replace") or "the execution's process died during setup"
            status, exit_code, event = "sandbox_error", None, {"kind": "internal", "detail": detail}
        elif col["bad_frame"]:
            status, exit_code = "error", None
            event = {"kind": "corrupted"}
        elif ws is not None and os.WIFSIGNALED(ws) and (col["result"] is None or not session):
            sig = os.WTERMSIG(ws)
            if col["result"] is None or sig != signal.SIGKILL:
                exit_code = -sig
                over_cpu = col.get("cpu_s", 0.0) >= (col.get("cpu_limit_s") or float("inf"))
                if sig == signal.SIGXCPU or (
                    sig == signal.SIGKILL and over_cpu and not col.get("oom_killed")
                ):
                    status, event = "timeout", {"kind": "cpu_limit"}
                elif sig == signal.SIGKILL and col.get("oom_killed"):
                    status, event = "oom", self.memory_event(memory, limit)
                else:
                    status, event = "killed", {"kind": "signal", "signal": _signame(sig)}
        elif col["result"] is None:
            code = os.WEXITSTATUS(ws) if ws is not None and os.WIFEXITED(ws) else None
            exit_code = code
            status = "ok" if code == 0 else "error"
        if status not in ("oom", "sandbox_error") and col.get("oom_killed"):
            event = event or self.memory_event(memory, limit)
        stdout, t1 = _decode(col["stdout"], col["stdout_dropped"], "stdout")
        stderr, t2 = _decode(col["stderr"], col["stderr_dropped"], "stderr")
        return {
            "stdout": stdout,
            "stderr": stderr,
            "exit_code": exit_code,
            "status": status or "error",
            "duration_s": duration,
            "truncated": t1 or t2,
            "display": result.get("display"),
            "event": event,
            "error": result.get("error"),
            "files": result.get("files") or {},
            "reset": col["reset"] and session,
            "evicted": None,
        }

    def memory_event(self, memory, limit):
        """What an OOM kill means: the execution's own limit, or the worker running out (its limit was lowered
        because other executions held the rest, or the worker's whole cgroup reached its own)."""
        if self.cgroups is not None and (self.worker_limit_hit() or (limit or memory) < memory):
            return {
                "kind": "worker_memory",
                "limit_mb": (limit or memory) >> 20,
                "memory_mb": memory >> 20,
                "worker_mb": self.capacity >> 20,
            }
        return {"kind": "memory", "memory_mb": memory >> 20}

    # -- cleanup and the health check (after the answer is sent: charged to no run)
    def kill_strays(self):
        """SIGKILL every process of the sandbox but the worker, live kernels and their inits. A process counts as
        alive while any of its threads is (its main thread may have exited while others run). Returns the pids
        left (zombies: every thread exited, not yet reaped by their parent), or None if some survive SIGKILL."""
        if self.mode == "none":
            return []
        protect = {self.me}
        for k in self.kernels.values():
            protect.update((k.pid, k.init))
        for _ in range(400):
            victims, dead = [], []
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) not in protect:
                    (victims if _alive(name) else dead).append(int(name))
            if not victims:
                return dead
            for pid in victims:
                _kill(pid)
            time.sleep(0.0005)
        return None

    def release(self, uid, cgroup, dirname, strays):
        """Give back what an ended execution held once nothing of it is left; returns the problems found.

        ``strays``: the sweep's result (:meth:`kill_strays`). The uid is reused (last) only if no task of it
        exists in any state; the cgroup is removed once its memory is freed (if that takes too long it is set
        aside, its memory counted as held, and replaced if it was the stateless runs')."""
        problems = []
        if uid is not None and self.mode == "root":
            if strays is None or any(k.uid == uid for k in self.kernels.values()) or _uid_tasks(uid, strays):
                problems.append(f"uid {uid} may still have processes")
            else:
                self.free_uids.append(uid)
        if self.cgroups is not None and cgroup is not None:
            held = self._settle(cgroup)
            if held > 1 << 20:
                self.orphans[cgroup] = held
                if cgroup == self.cgroups.run_name:
                    self.cgroups.replace_run()
            elif cgroup != self.cgroups.run_name:
                self.oom_seen.pop(cgroup, None)
                if not self.cgroups.remove(cgroup):
                    problems.append(f"could not remove cgroup {cgroup}")
        if self.mode == "none" and dirname:
            _rmtree(self.unsafe_workdir(dirname))
        return problems

    def cleanup_and_check(self):
        """Remove what the last request left and check the sandbox against a fresh one. Returns the health frame.

        Checks what the next run would meet: no process but the worker's, live kernels' and their inits'; the
        ended executions' uids hold no task (then they are reused, last); their memory (anonymous and shared)
        released; nothing in the sandbox's own /tmp, /dev/shm, SysV IPC tables, POSIX message queues or unix
        sockets (code never runs there: anything found is an escape from the per-run namespaces); no leaked
        worker fds. Memory of ended executions that is not freed in time is counted against the worker's
        capacity; more than a reserved share of it fails the check. Unix sockets a stateless run left in flight
        only give later runs a fresh network namespace.
        """
        t0 = time.monotonic()
        problems = []
        strays, self.strays_left = self.strays_left, None
        if strays is None:
            strays = self.kill_strays()
        if strays is None:
            problems.append("processes of the last run survived SIGKILL")
        pending, self.pending = self.pending, []
        for uid, cgroup, dirname in pending:
            problems += self.release(uid, cgroup, dirname, strays)
        for name in [n for n in self.orphans if self.cgroups.held(n) <= 1 << 20]:
            del self.orphans[name]
            self.cgroups.remove(name)
        if sum(self.orphans.values()) > self.reserved:
            problems.append(f"{sum(self.orphans.values()) >> 20} MiB of memory of ended executions not freed")
        if self.mode != "none":
            problems.extend(self.leftovers.find())
            if self.ran_stateless and _lines(self.run_unix_fd) > 1:
                self.new_run_netns()
        self.ran_stateless = False
        fds = len(os.listdir("/proc/self/fd"))
        if self.baseline_fds is None:
            self.baseline_fds = fds
        elif fds > self.baseline_fds + 6 * len(self.kernels):
            problems.append(f"the worker holds {fds} fds (baseline {self.baseline_fds})")
        if problems and not self.refusal:
            self.refusal = "; ".join(problems)
        return {"health": not problems, "problems": problems, "cleanup_s": time.monotonic() - t0}

    def _settle(self, name):
        """Bytes still held by cgroup ``name``, waiting up to _SETTLE_S for the kernel to free a dead run's
        namespaces (an IPC namespace is freed asynchronously, after an RCU grace period)."""
        deadline = time.monotonic() + _SETTLE_S
        delay = 0.0005
        kicked = False
        while True:
            held = self.cgroups.held(name)
            if held <= 1 << 20 or time.monotonic() > deadline:
                return held
            if not kicked:
                _kick_unix_gc()
                kicked = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
