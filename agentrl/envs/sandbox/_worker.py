"""The fork server that runs INSIDE a sandbox (stdlib only; run by the sandbox's own interpreter).

It is started once per pool worker (``python3 -I _worker.py``), reads its config as the first frame on stdin,
then answers requests from the host on stdin/stdout (frames: 4-byte big-endian length + UTF-8 JSON). It forks a
child per stateless run, so a run costs a fork instead of an interpreter start, and keeps one long-lived kernel
process per stateful session. It must stay importable by old Pythons (3.8+): no third-party imports except
libseccomp's binding, loaded only when asked for.

Requests (``op``):

- ``run`` {code, stdin, timeout, session, files, fetch_files, memory_bytes}: ``session`` None is stateless (a
  fresh child per run; ``memory_bytes`` may lower its memory limits); otherwise the key of a stateful kernel (a
  long-lived child keeping globals, started on first use). Answer: {stdout, stderr, exit_code, status,
  duration_s, truncated, display, event, error, files, reset}.
- ``close`` {session}: end that session's kernel. Answer: {ok}.

Every answer is followed by a health frame {health: bool, problems: [str], cleanup_s}: after answering, the
worker removes what the request left behind and checks that the sandbox is as clean as a fresh one. A worker
whose check fails refuses new stateless runs and sessions ({refused: reason}) and keeps serving its live
sessions, so that the host can replace it without losing them.

Isolation of one execution from every other (``mode`` "root" or "userns"):

- its own mount namespace with a private, size- and inode-capped tmpfs ``/tmp`` (the working directory) and
  ``/dev/shm``, and its own IPC namespace (SysV objects, POSIX message queues and semaphores); a session's
  kernel also gets its own network namespace (abstract unix sockets). Everything dies with the execution's
  last process, so nothing is left to clean up or to leak into a later run;
- its own memory cgroup (one for the stateless runs of this worker, one per session), so that memory, shared
  memory and tmpfs files count against the execution's limit and an OOM kill stays inside it;
- in "root" mode, its own uid: stateless runs take uids round-robin from the worker's block and a uid goes back
  only after the check verified that none of its processes remain; ``/proc`` is mounted with
  ``hidepid=invisible``, so code sees only its own processes (never a session's command line or the worker);
- no capabilities at all (effective, permitted, inheritable, ambient and bounding sets are empty), a seccomp
  filter (no sockets but AF_UNIX, no ptrace, namespaces, mounts, keyrings, kernel-module or BPF calls), rlimits
  on address space, processes, file size, open files and CPU time;
- a wall-clock deadline: then the whole process group and every other process of the call is SIGKILLed; after
  every call any process left (double-forked, setsid'd) is killed and zombies are reaped; a session's kernel
  is SIGSTOPped between calls;
- stdout/stderr are capped per stream; the result frame the code's process writes is untrusted and validated.

"root" mode: the worker starts as root with CAP_SETUID/SETGID/SYS_ADMIN inside bubblewrap, mounts ``/proc``,
then moves into a user namespace of its own in which it is root but maps to an unprivileged host uid
(``uid_base``), with the code's uids mapped one-to-one; from then on it holds no capability on the host.
"userns" mode (the pool runs as an ordinary user): bubblewrap's user namespace maps one uid, so code runs as
the worker's uid. "none": no isolation at all (trusted code only).
"""

import ast
import base64
import collections
import ctypes
import errno
import gc
import io
import json
import linecache
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time
import traceback
import types

FILENAME = "<cell>"
_HEADER = struct.Struct(">I")
_WORKER_FILE = os.path.abspath(__file__)
#: The environment the code sees (HOME and TMPDIR are its private working directory).
CODE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
WORKDIR = "/tmp"

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x40000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
#: Result kinds the code's process may report; everything else about a result is decided by the worker.
_RESULT_KINDS = ("ok", "error", "oom")
#: The worker's health check waits at most this long for the kernel to free a finished run's memory.
_SETTLE_S = 2.0

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data):
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _prctl(option, arg2=0, arg3=0):
    _check(_libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0), f"prctl {option}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _clear_capabilities():
    """Empty the effective, permitted, inheritable and ambient sets of this thread."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def _drop_bounding_set():
    """Empty the capability bounding set (needs CAP_SETPCAP); execve can then never grant a capability."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)


# ---------------------------------------------------------------- framing


def read_frame(fd, limit):
    """Read one frame from ``fd``; return the decoded object, or None at EOF. Raises ValueError if malformed."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > limit:
        raise ValueError(f"frame of {size} bytes exceeds the limit of {limit}")
    body = _read_exact(fd, size)
    if body is None:
        raise ValueError("frame truncated")
    return json.loads(body.decode("utf-8"))


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            if got:
                raise ValueError("frame truncated")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_frame(fd, obj):
    _write_body(fd, json.dumps(obj).encode("utf-8"))


def _write_body(fd, body):
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def write_result(fd, result):
    """Send an execution result. The common case (no display, error or files) skips json, whose first use
    after a fork costs a fifth of a millisecond: body ``S<exit code> <kind>``; otherwise a JSON object."""
    if result["display"] is None and result["error"] is None and not result["files"]:
        _write_body(fd, b"S%d %s" % (result["exit_code"], result["kind"].encode()))
    else:
        write_frame(fd, result)


def parse_result(body, fetch, cap):
    """Decode and validate a result frame written by the code's process (so: untrusted, maybe forged).

    Returns a dict with exactly {exit_code, kind, display, error, files}: ``exit_code`` in 0..255, ``kind`` one of
    :data:`_RESULT_KINDS`, ``display`` a str of at most ``cap`` characters or None, ``error`` None or {ename,
    evalue} (str), ``files`` only paths that were asked for (``fetch``), each a str of base64 or None, within
    the fetch budget. Raises ValueError for anything else.
    """
    if body[:1] == b"S":
        code, _, kind = body[1:].decode("ascii").partition(" ")
        if not code.isdigit() or len(code) > 3:
            raise ValueError("malformed result")
        raw = {"exit_code": int(code), "kind": kind, "display": None, "error": None, "files": {}}
    else:
        raw = json.loads(body.decode("utf-8"))
    if not isinstance(raw, dict) or set(raw) != {"exit_code", "kind", "display", "error", "files"}:
        raise ValueError("malformed result")
    exit_code, kind, display, error, files = (
        raw[k] for k in ("exit_code", "kind", "display", "error", "files")
    )
    if type(exit_code) is not int or not 0 <= exit_code <= 255 or kind not in _RESULT_KINDS:
        raise ValueError("malformed result")
    if display is not None and (type(display) is not str or len(display) > cap):
        raise ValueError("malformed result")
    if error is not None and not (
        type(error) is dict
        and set(error) == {"ename", "evalue"}
        and all(type(v) is str and len(v) <= cap for v in error.values())
    ):
        raise ValueError("malformed result")
    if type(files) is not dict or not set(files) <= set(fetch):
        raise ValueError("malformed result")
    budget = 4 * cap * 4 // 3 + 4 * len(files)
    for value in files.values():
        if value is not None:
            if type(value) is not str or len(value) > budget:
                raise ValueError("malformed result")
            budget -= len(value)
    return {"exit_code": exit_code, "kind": kind, "display": display, "error": error, "files": files}


# ---------------------------------------------------------------- code side (runs in the forked child)


def execute(code, namespace, want_display, cap, files=None, fetch=(), compiled=None):
    """Run ``code`` in ``namespace`` and return {exit_code, kind, display, error, files}; output goes to fds 1/2.

    ``files`` (path -> base64) are written first and ``fetch`` paths read back afterwards (base64, None if
    missing or too big), both with the code's own privileges. ``compiled``: ``code`` already compiled (by the
    worker, before the fork, where compiling is cheap), for stateless runs.
    """
    display = error = None
    try:
        for path, b64 in (files or {}).items():
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(b64 or ""))
        if want_display:
            tree = ast.parse(code, FILENAME, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, FILENAME, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, FILENAME, "eval"), namespace)
                if value is not None:
                    display = repr(value)[:cap]
        else:
            exec(compiled or compile(code, FILENAME, "exec"), namespace)
        exit_code, kind = 0, "ok"
    except SystemExit as exc:
        exit_code = _system_exit_code(exc)
        kind = "ok" if exit_code == 0 else "error"
    except BaseException as exc:  # the code's failure is data, never the kernel's death
        kind = "oom" if isinstance(exc, MemoryError) else "error"
        exit_code = 1
        error = {"ename": type(exc).__name__[:cap], "evalue": _safe_str(exc)[:cap]}
        linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
        _print_user_traceback(exc)
    _flush_std()
    return {
        "exit_code": exit_code,
        "kind": kind,
        "display": display,
        "error": error,
        "files": _fetch_files(fetch, 4 * cap),
    }


def _fetch_files(paths, budget):
    out = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read(budget + 1)
        except OSError:
            data = None
        if data is None or len(data) > budget:
            out[path] = None
        else:
            budget -= len(data)
            out[path] = base64.b64encode(data).decode("ascii")
    return out


def fresh_main():
    """A new ``__main__`` module, registered in sys.modules, whose dict is the code's global namespace (so that
    pickle finds the code's functions, e.g. for multiprocessing)."""
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    return main.__dict__


#: Code up to this size is compiled by the worker before it forks (a cold child pays ~10x for compiling).
_PRECOMPILE_MAX = 64 * 1024


def _precompile(code):
    """``code`` compiled, or None: then the child compiles it and reports any error as the code's own."""
    if len(code) > _PRECOMPILE_MAX:
        return None
    try:
        return compile(code, FILENAME, "exec")
    except Exception:
        return None


def _system_exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(_safe_str(exc.code) + "\n")
    return 1


def _safe_str(obj):
    try:
        return str(obj)
    except BaseException:
        return f"<unprintable {type(obj).__name__}>"


def _print_user_traceback(exc):
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != _WORKER_FILE])
        sys.stderr.write("".join(te.format()))
    except BaseException:
        sys.stderr.write(f"{type(exc).__name__} (traceback unavailable)\n")


def _flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _fresh_std_streams():
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def kernel_main(cap):
    """A stateful kernel: fd 3 receives code frames, fd 4 returns result frames; globals persist."""
    namespace = fresh_main()
    while True:
        try:
            req = read_frame(3, 1 << 30)
        except ValueError:
            os._exit(70)
        if req is None:
            os._exit(0)
        sys.stdin = io.StringIO(req["stdin"])
        if sys.stdout.closed or sys.stderr.closed:
            _fresh_std_streams()
        result = execute(req["code"], namespace, True, cap, req.get("files"), req.get("fetch_files", ()))
        if sys.stdout.closed or sys.stderr.closed:
            _fresh_std_streams()
        write_result(4, result)


# ---------------------------------------------------------------- worker side


class Kernel:
    """A session's long-lived kernel process and the worker's ends of its pipes."""

    def __init__(self, pid, uid, ctl_w, res_r, out_r, err_r, cgroup):
        self.pid, self.uid, self.ctl_w, self.res_r, self.out_r, self.err_r = (
            pid,
            uid,
            ctl_w,
            res_r,
            out_r,
            err_r,
        )
        self.cgroup = cgroup
        self.pidfd = os.pidfd_open(pid)

    def close_fds(self):
        for fd in (self.ctl_w, self.res_r, self.out_r, self.err_r, self.pidfd):
            _close(fd)


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


class Cgroups:
    """The worker's view of its memory cgroup (a directory fd from the host): ``run`` (created by the host) holds
    the stateless runs, ``s<uid>`` (created here) one session each. All paths are relative to that fd, so no
    cgroup filesystem is mounted in the sandbox."""

    def __init__(self, cfg):
        self.dir_fd = cfg["fd"]
        self.version = cfg["version"]
        self.limit_file = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        # Opened while the worker is still root on the host (these files stay root's); written through later.
        self.run_procs = os.open("run/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        self.run_limit_fd = os.open("run/" + self.limit_file, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        self.run_limit = None

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

    def create_session(self, uid, limit):
        """A fresh cgroup for one session; returns (name, an fd of its cgroup.procs to join it)."""
        name = f"s{uid}"
        try:
            os.mkdir(name, dir_fd=self.dir_fd)
        except FileExistsError:
            pass
        self.set_limit(name, limit)
        return name, os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def remove(self, name):
        """Remove a session's cgroup once its processes are gone; False if it cannot be removed."""
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
        try:
            fd = os.open(f"{name}/memory.stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:
            return 0
        try:
            text = os.read(fd, 65536).decode()
        finally:
            os.close(fd)
        keys = ("total_rss", "total_shmem") if self.version == 1 else ("anon", "shmem")
        total = 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key in keys:
                total += int(value)
        return total

    def oom_kills(self, name):
        """How many processes the OOM killer has ended in ``name`` so far."""
        path = "{}/{}".format(name, "memory.oom_control" if self.version == 1 else "memory.events")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:
            return 0
        try:
            text = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


class Worker:
    def __init__(self, cfg, child_filter, cgroups):
        self.cfg = cfg
        self.cap = cfg["output_cap"]
        self.mode = cfg["mode"]
        self.child_filter = child_filter
        self.kernels = {}  # session key -> Kernel
        self.me = os.getpid()
        self.cgroups = cgroups
        # Code uids, least recently used first; a uid is here only while no process of it exists.
        if self.mode == "root":
            self.free_uids = collections.deque(
                range(cfg["uid_base"] + 1, cfg["uid_base"] + cfg["n_uids"] + 1)
            )
        else:
            self.free_uids = collections.deque([os.getuid()])
        self.refusal = None  # why this worker takes no new work (its health check failed)
        self.baseline_fds = None
        self.pending_uid = self.pending_cgroup = self.pending_dir = None  # left by the last request
        self.strays_killed = False  # the last request already killed every stray process
        self.oom_seen = {}  # cgroup -> OOM kills counted so far

    # -- the child's confinement
    def confine(self, uid, fds, cgroup_procs, cpu_s, memory_bytes, own_net, name):
        """In a freshly forked child, before the code runs: own session, fds 0..N, private namespaces and
        tmpfs, its cgroup, rlimits, no privileges, the seccomp filter. Order matters: mounts and the cgroup
        move need the worker's privileges, which the uid change then drops."""
        os.setsid()
        isolated = self.mode != "none"
        if isolated:
            _unshare(CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if own_net else 0))
            opts = f"size={self.cfg['tmpfs_bytes']},nr_inodes={self.cfg['tmpfs_inodes']}"
            _mount(
                "tmpfs",
                WORKDIR,
                "tmpfs",
                MS_NOSUID | MS_NODEV,
                f"{opts},mode=0700,uid={uid},gid={uid}",
            )
            _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts + ",mode=1777")
            if (
                own_net
            ):  # a session lists its own POSIX queues in /dev/mqueue (a stateless run skips the cost)
                _mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        if cgroup_procs is not None:
            os.write(cgroup_procs, b"0")
        try:  # the code, never the worker, is the OOM killer's choice
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(len(fds), 65536)
        lim = self.cfg["limits"]
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"],) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"],) * 2)
        if memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        if cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        if self.mode == "root":
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root of the worker's namespace: clears every capability
        if isolated:
            _clear_capabilities()
            _prctl(PR_SET_DUMPABLE, 1)  # so that the code sees its own processes under hidepid
            if self.child_filter is not None:
                _check(
                    _libc.prctl(
                        PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.child_filter[0]), 0, 0
                    ),
                    "seccomp",
                )
            workdir = WORKDIR
        else:
            workdir = self.unsafe_workdir(name)
        os.chdir(workdir)
        os.environ["HOME"] = os.environ["TMPDIR"] = workdir

    def unsafe_workdir(self, name):
        """Mode "none": the host directory that serves as an execution's working directory."""
        return os.path.join(self.cfg["tmp_root"], name)

    def make_unsafe_workdir(self, name):
        path = self.unsafe_workdir(name)
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, 0o700)

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
            self.close_kernel(req["session"])
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def take_uid(self):
        if not self.free_uids:
            raise RuntimeError("no free uid left in this worker's block")
        return self.free_uids.popleft() if self.mode == "root" else self.free_uids[0]

    def run_stateless(self, req):
        start = time.monotonic()
        uid = self.take_uid()
        self.pending_uid = uid
        memory = self.cfg["limits"]["as_bytes"]
        if req.get("memory_bytes"):  # a per-run limit may only lower the pool's
            memory = min(int(req["memory_bytes"]), memory)
        if self.cgroups is not None:
            self.cgroups.set_run_limit(memory)
            self.pending_cgroup = "run"
        if self.mode == "none":
            self.make_unsafe_workdir("run")
        self.pending_dir = "run"
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        stdin_fd = _stdin_fd(req["stdin"])
        cpu_s = int(req["timeout"]) + 1
        compiled = _precompile(req["code"])
        fetch = req.get("fetch_files", ())
        pid = os.fork()
        if pid == 0:
            try:
                procs = self.cgroups.run_procs if self.cgroups is not None else None
                as_limit = memory if memory != self.cfg["limits"]["as_bytes"] else None
                self.confine(uid, (stdin_fd, out_w, err_w, res_w), procs, cpu_s, as_limit, False, "run")
                namespace = fresh_main()
                result = execute(req["code"], namespace, False, self.cap, req.get("files"), fetch, compiled)
                write_result(3, result)
                os._exit(result["exit_code"])
            except BaseException:
                os._exit(71)
        for fd in (out_w, err_w, res_w, stdin_fd):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        try:
            col = self.collect(pid, pidfd, out_r, err_r, res_r, start + req["timeout"], True, fetch)
        finally:
            for fd in (out_r, err_r, res_r, pidfd):
                _close(fd)
        col["oom_killed"] = self.oom_killed("run", col["wait_status"])
        return self.finish(col, start, req["timeout"], memory, session=False)

    def start_kernel(self, key):
        uid = self.take_uid()
        cgroup = procs = None
        if self.cgroups is not None:
            cgroup, procs = self.cgroups.create_session(uid, self.cfg["limits"]["as_bytes"])
        ctl_r, ctl_w = os.pipe()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open("/dev/null", os.O_RDONLY)
        if self.mode == "none":
            self.make_unsafe_workdir("s" + key)
        pid = os.fork()
        if pid == 0:
            try:
                self.confine(uid, (devnull, out_w, err_w, ctl_r, res_w), procs, None, None, True, "s" + key)
                kernel_main(self.cap)
            except BaseException:
                os._exit(71)
        for fd in (ctl_r, res_w, out_w, err_w, devnull):
            os.close(fd)
        if procs is not None:
            os.close(procs)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        kernel = Kernel(pid, uid, ctl_w, res_r, out_r, err_r, cgroup)
        self.kernels[key] = kernel
        return kernel

    def end_kernel(self, key):
        """Kill a session's kernel (its namespaces and tmpfs die with it); its uid is verified by the check."""
        kernel = self.kernels.pop(key, None)
        if kernel is None:
            return
        try:
            os.killpg(kernel.pid, signal.SIGKILL)
        except OSError:
            pass
        _kill(kernel.pid)
        _reap(kernel.pid)
        kernel.close_fds()
        self.pending_uid = kernel.uid
        self.pending_cgroup = kernel.cgroup
        self.pending_dir = "s" + key

    def close_kernel(self, key):
        self.end_kernel(key)

    def run_in_kernel(self, req):
        start = time.monotonic()
        key = req["session"]
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.start_kernel(key)
        else:
            _signal(kernel.pid, signal.SIGCONT)  # frozen since its last call, background threads included
        _drain_nonblocking(kernel.out_r)
        _drain_nonblocking(kernel.err_r)
        fetch = req.get("fetch_files", ())
        try:
            msg = {
                "code": req["code"],
                "stdin": req["stdin"],
                "files": req.get("files"),
                "fetch_files": fetch,
            }
            write_frame(kernel.ctl_w, msg)
        except OSError:
            pass  # the kernel died between calls; collect() sees it exit
        col = self.collect(
            kernel.pid,
            kernel.pidfd,
            kernel.out_r,
            kernel.err_r,
            kernel.res_r,
            start + req["timeout"],
            False,
            fetch,
        )
        col["oom_killed"] = self.oom_killed(kernel.cgroup, col["wait_status"])
        if col["reset"]:
            if col["wait_status"] is None:  # it answered, but with a corrupt frame: end it
                try:
                    os.killpg(kernel.pid, signal.SIGKILL)
                except OSError:
                    pass
                _kill(kernel.pid)
                col["wait_status"] = _reap(kernel.pid)
            self.kernels.pop(key, None)
            kernel.close_fds()
            self.pending_uid = kernel.uid
            self.pending_cgroup = kernel.cgroup
            self.pending_dir = "s" + key
        else:
            # Between calls the kernel must not run: a thread it left behind would otherwise burn CPU or
            # print into later calls, outside any time limit.
            _signal(kernel.pid, signal.SIGSTOP)
        return self.finish(col, start, req["timeout"], self.cfg["limits"]["as_bytes"], session=True)

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

    def collect(self, pid, pidfd, out_r, err_r, res_r, deadline, one_shot, fetch):
        """Gather output until the run finishes (a one-shot child exits, a kernel answers) or the deadline.

        When the process is finished (one-shot, died, timed out or corrupted its channel) it is killed with
        its process group and reaped; in every case all other processes of the call are killed after it.
        """
        bufs = {out_r: bytearray(), err_r: bytearray()}
        dropped = {out_r: 0, err_r: 0}
        res_buf = bytearray()
        col = {"result": None, "timed_out": False, "wait_status": None, "bad_frame": False, "reset": False}
        poller = select.poll()
        for fd in (out_r, err_r, res_r, pidfd):
            poller.register(fd, select.POLLIN)
        exited = False
        while not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                col["timed_out"] = True
                break
            for fd, _ in poller.poll(remaining * 1000.0):
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
            if len(res_buf) > 10 * self.cap + 65536:
                col["bad_frame"] = True
                break
            if not one_shot and _frame_complete(res_buf):
                break
        finished = one_shot or exited or col["timed_out"] or col["bad_frame"]
        if finished:
            try:
                os.killpg(pid, signal.SIGKILL)  # its process group (the process itself may have left it)
            except OSError:
                pass
            if not exited:
                _kill(pid)
            col["wait_status"] = _reap(pid)
        self.strays_killed = self.kill_strays()
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
                col["result"] = parse_result(bytes(res_buf[4:]), fetch, self.cap)
            except (ValueError, RecursionError, UnicodeDecodeError):
                col["result"], col["bad_frame"] = None, True
        col["reset"] = not one_shot and (finished or col["result"] is None)
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

    def finish(self, col, start, timeout, memory, session):
        """The answer to a run: output, status, and an ``event`` (what happened, for the host to word)."""
        duration = time.monotonic() - start
        result = col["result"] or {}
        status = result.get("kind")
        exit_code = result.get("exit_code")
        event = None
        ws = col["wait_status"]
        if col["timed_out"]:
            status, exit_code = "timeout", None
            event = {"kind": "timeout", "timeout_s": timeout}
        elif col["bad_frame"]:
            status, exit_code = "error", None
            event = {"kind": "corrupted"}
        elif ws is not None and os.WIFSIGNALED(ws) and (col["result"] is None or not session):
            sig = os.WTERMSIG(ws)
            if col["result"] is None or sig != signal.SIGKILL:
                exit_code = -sig
                if sig == signal.SIGXCPU:
                    status, event = "timeout", {"kind": "cpu_limit"}
                elif sig == signal.SIGKILL and col.get("oom_killed"):
                    status, event = "oom", {"kind": "memory", "memory_mb": memory >> 20}
                else:
                    status, event = "killed", {"kind": "signal", "signal": _signame(sig)}
        elif col["result"] is None:
            code = os.WEXITSTATUS(ws) if ws is not None and os.WIFEXITED(ws) else None
            exit_code = code
            status = "ok" if code == 0 else "error"
            if code in (70, 71):
                status = "sandbox_error"
                event = {"kind": "internal", "detail": f"the sandbox's child process failed (exit {code})"}
        if status != "oom" and col.get("oom_killed"):
            event = event or {"kind": "memory", "memory_mb": memory >> 20}
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
        }

    # -- cleanup and the health check (after the answer is sent: charged to no run)
    def kill_strays(self):
        """SIGKILL every process in the sandbox except pid 1, this worker and live kernels; False if some
        survive. Without a private pid namespace (unisolated mode) /proc shows the host: nothing is scanned."""
        if self.mode == "none":
            return True
        protect = {1, self.me}
        protect.update(k.pid for k in self.kernels.values())
        for _ in range(400):
            victims = []
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) not in protect and not _is_zombie(name):
                    victims.append(int(name))
            if not victims:
                return True
            for pid in victims:
                _kill(pid)
            time.sleep(0.0005)
        return False

    def cleanup_and_check(self):
        """Remove what the last request left and check the sandbox against a fresh one. Returns the health frame.

        Checks what the next run would meet: no process but the worker's and live kernels'; the finished run's uid
        holds nothing (then it is reused, last); the finished run's memory (anonymous and shared) released;
        nothing in the sandbox's own /tmp, /dev/shm, SysV IPC tables, POSIX message queues or unix sockets (code
        never runs there: anything found is an escape from the per-run namespaces); no leaked worker fds.
        """
        t0 = time.monotonic()
        problems = []
        strays_killed, self.strays_killed = self.strays_killed, False
        if not (strays_killed or self.kill_strays()):  # a run's collect() already did it
            problems.append("processes of the last run survived SIGKILL")
        uid, self.pending_uid = self.pending_uid, None
        if uid is not None and self.mode == "root":
            # Only pid 1, the worker and live kernels remain (the worker sees every process), and no kernel has
            # this uid: nothing of its holder is left, so it may serve again, after all the others.
            if problems or any(k.uid == uid for k in self.kernels.values()):
                problems.append(f"uid {uid} may still have processes")
            else:
                self.free_uids.append(uid)
        cgroup, self.pending_cgroup = self.pending_cgroup, None
        if self.cgroups is not None and cgroup is not None:  # a finished run, or an ended session
            for name in [cgroup]:
                held = self._settle(name)
                if held > 1 << 20:
                    problems.append(f"{held} bytes of memory still held by the finished {name}")
                elif name != "run":
                    self.oom_seen.pop(name, None)
                    if not self.cgroups.remove(name):
                        problems.append(f"could not remove cgroup {name}")
        name, self.pending_dir = self.pending_dir, None
        if self.mode == "none":
            if name:
                shutil.rmtree(self.unsafe_workdir(name), ignore_errors=True)
        else:
            problems.extend(_sandbox_leftovers())
        fds = len(os.listdir("/proc/self/fd"))
        if self.baseline_fds is None:
            self.baseline_fds = fds
        elif fds > self.baseline_fds + 5 * len(self.kernels):
            problems.append(f"the worker holds {fds} fds (baseline {self.baseline_fds})")
        if problems and not self.refusal:
            self.refusal = "; ".join(problems)
        return {"health": not problems, "problems": problems, "cleanup_s": time.monotonic() - t0}

    def _settle(self, name):
        """Bytes still held by cgroup ``name``, waiting up to _SETTLE_S for the kernel to free a dead run's
        namespaces (an IPC namespace is freed asynchronously, after an RCU grace period)."""
        deadline = time.monotonic() + _SETTLE_S
        delay = 0.0005
        while True:
            held = self.cgroups.held(name)
            if held <= 1 << 20 or time.monotonic() > deadline:
                return held
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _internal_reply(detail):
    """A run reply for a failure of the sandbox itself."""
    return {
        "stdout": "",
        "stderr": "",
        "exit_code": None,
        "status": "sandbox_error",
        "duration_s": 0.0,
        "truncated": False,
        "display": None,
        "event": {"kind": "internal", "detail": detail},
        "error": None,
        "files": {},
        "reset": False,
    }


def _sandbox_leftovers():
    """What code left in the sandbox's shared places (empty by construction; a finding means an escape)."""
    found = []
    for path in ("/tmp", "/dev/shm", "/dev/mqueue"):
        try:
            if os.listdir(path):
                found.append(f"files in the sandbox's {path}")
        except OSError:
            pass
    for table in ("shm", "msg", "sem"):
        try:
            with open("/proc/sysvipc/" + table) as f:
                if len(f.read().splitlines()) > 1:
                    found.append(f"SysV {table} objects in the sandbox's IPC namespace")
        except OSError:
            pass
    deadline = time.monotonic() + 1.0
    while True:  # sockets sent over sockets linger until the kernel's unix garbage collector runs
        try:
            with open("/proc/self/net/unix") as f:
                sockets = len(f.read().splitlines()) - 1
        except OSError:
            sockets = 0
        if sockets <= 0 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    if sockets > 0:
        found.append(f"{sockets} unix sockets in the sandbox's network namespace")
    return found


def _decode(data, dropped, name):
    text = data.decode("utf-8", errors="replace")
    if dropped:
        if text and not text.endswith("\n"):
            text += "\n"
        text += f"[... {dropped} more bytes of {name} truncated]\n"
        return text, True
    return text, False


def _signame(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _frame_complete(buf):
    if len(buf) < 4:
        return False
    (size,) = _HEADER.unpack(bytes(buf[:4]))
    return len(buf) >= 4 + size


def _read_some(fd):
    try:
        return os.read(fd, 1 << 20)
    except OSError:
        return b""


def _read_rest(fd):
    os.set_blocking(fd, False)
    out = bytearray()
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _drain_nonblocking(fd):
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:
            return


def _is_zombie(pid_name):
    try:
        with open(f"/proc/{pid_name}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True  # already gone


def _kill(pid):
    _signal(pid, signal.SIGKILL)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _reap(pid):
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _stdin_fd(text):
    """A readable fd holding ``text`` (then EOF); the caller closes it."""
    if not text:
        return os.open("/dev/null", os.O_RDONLY)
    data = text.encode("utf-8")
    fd = os.memfd_create("stdin", 0)
    while data:
        data = data[os.write(fd, data) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# ---------------------------------------------------------------- seccomp

_DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "syslog",
    "fanotify_init",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
)
#: What the worker itself needs (per-run namespaces and tmpfs mounts); its children are denied these too.
_WORKER_NEEDS = ("mount", "unshare")
# CLONE_NEWUSER, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWNS, NEWCGROUP
_CLONE_NS_FLAGS = (0x10000000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x00020000, 0x02000000)


def _build_filter(worker):
    """The seccomp filter: for the worker itself (``worker``) or, stricter, for the code's processes."""
    import seccomp  # libseccomp's Python binding (Debian: python3-seccomp)

    flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in _DENIED:
        if worker and name in _WORKER_NEEDS:
            continue
        try:
            flt.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            pass  # syscall unknown to this libseccomp/kernel
    flt.add_rule(eperm, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    # clone3 passes flags in memory, which seccomp cannot inspect: make libc fall back to clone().
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        flt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        if worker and flag not in (CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET):
            flt.add_rule(eperm, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    return flt


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp():
    """Load the worker's filter and compile the code's (stricter) one, which each child loads itself.

    Returns the code's filter as (sock_fprog, buffer) for ``prctl(PR_SET_SECCOMP)`` (the buffer must live on)."""
    child = _build_filter(worker=False)
    fd = os.memfd_create("seccomp", 0)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            child.export_bpf(f)
        os.lseek(fd, 0, os.SEEK_SET)
        program = _read_rest(fd)
    finally:
        os.close(fd)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _build_filter(worker=True).load()  # also sets no_new_privs, inherited by every child
    return prog, buf


# ---------------------------------------------------------------- startup


def _mount_private_proc(gid):
    """Replace bubblewrap's /proc with one that hides other uids' processes (the worker's gid sees all), and
    cover the writable parts of /proc read-only, as bubblewrap does."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"hidepid=invisible,gid={gid}")
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        path = "/proc/" + sub
        if os.path.exists(path):
            _mount(path, path, None, MS_BIND | MS_REC, None)
            _mount(
                "none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None
            )


def _enter_own_user_namespace(host_uid, code_uids):
    """Become root of a new user namespace that maps to the unprivileged ``host_uid`` (and ``code_uids`` to
    themselves). A helper still in the parent namespace writes the maps, which needs CAP_SETUID/SETGID there."""
    ready_r, ready_w = os.pipe()
    me = os.getpid()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(ready_w)
            os.read(ready_r, 1)
            lines = f"0 {host_uid} 1\n{code_uids[0]} {code_uids[0]} {len(code_uids)}\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{me}/{name}", "w") as f:
                    f.write(lines)
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(ready_r)
    try:
        _unshare(CLONE_NEWUSER)
    finally:
        os.write(ready_w, b"x")
        os.close(ready_w)
        status = os.waitpid(helper, 0)[1]
    if status != 0:
        raise RuntimeError("could not write the worker's uid/gid maps")
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)


def setup_worker(cfg):
    """Once, before any code: namespaces and privileges (per ``mode``), environment, inherited limits."""
    mode = cfg["mode"]
    if mode == "root":
        _mount_private_proc(cfg["uid_base"])
        _enter_own_user_namespace(
            cfg["uid_base"], range(cfg["uid_base"] + 1, cfg["uid_base"] + cfg["n_uids"] + 1)
        )
    if mode != "none":
        _drop_bounding_set()
    os.environ.clear()
    os.environ.update(CODE_ENV)
    lim = cfg["limits"]
    for res, value in (
        (resource.RLIMIT_AS, lim["as_bytes"]),
        (resource.RLIMIT_FSIZE, lim["fsize_bytes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    _fresh_std_streams()


def main():
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    ready = {"ready": True, "pid": os.getpid(), "seccomp": False, "error": None}
    child_filter = None
    try:
        cfg = read_frame(ctl_in, 1 << 20)
        cgroups = Cgroups(cfg["cgroup"]) if cfg.get("cgroup") else None  # opened while still root on the host
        setup_worker(cfg)
        if cfg["seccomp"]:
            child_filter = load_seccomp()
            ready["seccomp"] = True
        worker = Worker(cfg, child_filter, cgroups)
    except ImportError as exc:
        ready["error"] = f"seccomp: {exc}"
    except Exception as exc:
        ready["error"] = f"setup: {type(exc).__name__}: {exc}"
    ready["uid"] = os.getuid()
    write_frame(ctl_out, ready)
    if ready["error"]:
        return 2
    gc.freeze()  # keep the collector from touching (and so copying) the worker's pages in every child
    write_frame(ctl_out, worker.cleanup_and_check())
    while True:
        req = read_frame(ctl_in, 1 << 30)
        if req is None:
            return 0
        try:
            resp = worker.handle(req)
        except Exception as exc:
            resp = _internal_reply(f"worker error: {type(exc).__name__}: {exc}")
        write_frame(ctl_out, resp)
        write_frame(ctl_out, worker.cleanup_and_check())


if __name__ == "__main__":
    sys.exit(main())
