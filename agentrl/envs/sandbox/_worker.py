"""The fork server that runs INSIDE a sandbox (stdlib only; run by the sandbox's own interpreter).

It is started once per pool worker (``python3 -I -c <isolation.WORKER_BOOTSTRAP> _worker.py``), reads its config
as the first frame on stdin, then answers requests from the host on stdin/stdout (frames: 4-byte big-endian length
+ UTF-8 JSON). It forks a child per stateless run, so a run costs a fork instead of an interpreter start, and keeps
one long-lived kernel process per stateful session. It must stay importable by old Pythons (3.8+): no third-party
imports except libseccomp's binding, loaded only in a short-lived child that builds the seccomp programs.

Requests (``op``):

- ``run`` {code, stdin, timeout, session, files, fetch_files, memory_bytes}: ``session`` None is stateless (a
  fresh child per run; ``memory_bytes`` may lower its memory limits); otherwise the key of a stateful kernel (a
  long-lived child keeping globals, started on first use). Answer: {stdout, stderr, exit_code, status,
  duration_s, truncated, display, event, error, files, reset, evicted}.
- ``close`` {session}: end that session's kernel. Answer: {ok}.

Every answer is followed by a health frame {health: bool, problems: [str], cleanup_s}: after answering, the
worker removes what the request left behind and checks that the sandbox is as clean as a fresh one. A worker
whose check fails refuses new stateless runs and sessions ({refused: reason}) and keeps serving its live
sessions, so that the host can replace it without losing them.

Isolation of one execution from every other (``mode`` "root" or "userns"):

- its own pid namespace (a stateless run is its pid 1, so the kernel ends every process of the run with it; a
  session's kernel is pid 2 under an init, the worker's child, that reaps orphans and reports the kernel's exit)
  and a ``/proc`` of it that lists its own processes only (``subset=pid``: no system-wide files);
- its own mount namespace with a private, size- and inode-capped tmpfs ``/tmp`` (the working directory) and
  ``/dev/shm``, and its own IPC namespace (SysV objects, POSIX message queues and semaphores); a session's
  kernel also gets its own network namespace, and stateless runs share one apart from the worker's (replaced
  when a run leaves unix sockets in flight). Everything dies with the execution's last process;
- its own memory cgroup (one for the stateless runs of this worker, one per session), so that memory, shared
  memory and tmpfs files count against the execution's limit and an OOM kill stays inside it; the worker's
  capacity is shared out so that every live session and the stateless runs keep a reserved share
  (:meth:`Worker.memory_for`);
- in "root" mode, its own uid, with its own part of the per-uid kernel quotas (POSIX queues, queued signals,
  locked memory): stateless runs take uids round-robin from the worker's block and a uid goes back only after
  the check verified that no task of it remains;
- no capabilities at all (effective, permitted, inheritable, ambient and bounding sets are empty), a seccomp
  filter (no sockets but AF_UNIX, no ptrace, namespaces, mounts, keyrings, kernel-module or BPF calls, and
  nothing that turns state the kernel shares between executions into a channel, see ``_add_channel_rules``),
  rlimits on address space, processes, file size, open files and CPU time (a session's kernel: per call);
- a wall-clock deadline: then every process of the call is SIGKILLed; after every call any process left
  (double-forked, setsid'd, or a process whose main thread exited while others run) is killed; a session's
  kernel is SIGSTOPped between calls, and checked to stay so (one that resumes itself is stopped again, what
  it started killed, and it is killed after half a CPU-second);
- stdout/stderr are capped per stream; the result frame the code's process writes is untrusted and validated
  (a session's carries the nonce of its request); the sandbox's own failures before any code runs travel on a
  status channel the code never holds.

"root" mode: the worker starts as root with CAP_SETUID/SETGID/SYS_ADMIN(/SYS_RESOURCE) inside bubblewrap, mounts
a plain ``/proc``, sizes the per-uid quotas, then moves into a user namespace of its own, owned by and mapped to an
unprivileged host uid (``uid_base``), with the code's uids mapped one-to-one; it continues as pid 1 of a pid
namespace that user namespace owns (so that it can give every execution one of its own) and from then on holds
no capability on the host. "userns" mode (the pool runs as an ordinary user): bubblewrap's user namespace maps
one uid, so code runs as the worker's uid. "none": no isolation at all (trusted code only).
"""

import ast
import base64
import collections
import ctypes
import errno
import fcntl
import gc
import io
import json
import linecache
import marshal
import os
import resource
import select
import signal
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
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 22, 2, 38
PR_SET_KEEPCAPS, CAP_SYS_ADMIN, MNT_DETACH = 8, 21, 2
#: Result kinds the code's process may report; everything else about a result is decided by the worker.
_RESULT_KINDS = ("ok", "error", "oom")
#: How long the worker sleeps on a stateless run's exit alone before it also reads the run's pipes, seconds.
_QUIET_WAIT_S = 0.01
#: The worker's health check waits at most this long for the kernel to free a finished run's memory.
_SETTLE_S = 2.0
#: How often an idle worker checks that its sessions' kernels stay stopped, and the CPU time one may use between
#: two calls before it is killed (seconds). See Worker.watch_idle.
_IDLE_CHECK_S, _IDLE_CPU_S = 0.1, 0.5
#: How long a session's kernel may take to be set up, seconds.
_SETUP_TIMEOUT_S = 10.0
#: The byte an execution's process writes on its status channel once its setup is done (before any code runs).
SETUP_DONE = b"\x01"
#: Options of each execution's /proc: its own pid namespace (so only its own processes), processes only (no
#: system-wide files such as /proc/locks, /proc/stat or /proc/cmdline, which would be channels or leak the host),
#: and only those of its own uid (not its session's init).
_PROC_OPTIONS = b"hidepid=invisible,subset=pid"

_libc = ctypes.CDLL(None, use_errno=True)


def _libc_function(name, *argtypes):
    """A libc function, resolved once here in the worker (a child that resolved it would pay for the lookup and
    for the pages it writes)."""
    fn = getattr(_libc, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_sys_unshare = _libc_function("unshare", ctypes.c_int)
_sys_mount = _libc_function(
    "mount", ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p
)
_sys_prctl = _libc_function(
    "prctl", ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong
)
_sys_capset = _libc_function("capset", ctypes.c_void_p, ctypes.c_void_p)
_sys_setns = _libc_function("setns", ctypes.c_int, ctypes.c_int)
_sys_socketpair = _libc_function("socketpair", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_sys_unshare(flags), "unshare")


def _mount(source, target, fstype, flags, data):
    _check(
        _sys_mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _prctl(option, arg2=0, arg3=0):
    _check(_sys_prctl(option, arg2, arg3, 0, 0), f"prctl {option}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


#: capset(2) arguments that empty this thread's sets (version 3: two data structs), built once in the worker.
_CAP_HEADER = _CapHeader(0x20080522, 0)
_CAP_NONE = (_CapData * 2)()


def _clear_capabilities():
    """Empty the effective, permitted, inheritable and ambient sets of this thread."""
    _check(_sys_capset(ctypes.addressof(_CAP_HEADER), ctypes.addressof(_CAP_NONE)), "capset")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def _set_capabilities(mask):
    """Make ``mask`` (capabilities 0..31) this thread's effective and permitted sets (startup only)."""
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = mask
    header = _CapHeader(0x20080522, 0)
    _check(_sys_capset(ctypes.addressof(header), ctypes.addressof(data)), "capset")


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


def write_result(fd, result, nonce=""):
    """Send an execution result. The common case (no display, error or files) skips json, whose first use
    after a fork costs a fifth of a millisecond: body ``S<exit code> <kind>[ <nonce>]``; otherwise a JSON object.
    ``nonce``: a session kernel echoes the one its request carried."""
    if result["display"] is None and result["error"] is None and not result["files"]:
        body = b"S%d %s" % (result["exit_code"], result["kind"].encode())
        _write_body(fd, body + b" " + nonce.encode() if nonce else body)
    else:
        write_frame(fd, {**result, "nonce": nonce} if nonce else result)


_RESULT_FIELDS = {"exit_code", "kind", "display", "error", "files"}


def parse_result(body, fetch, cap, nonce=""):
    """Decode and validate a result frame written by the code's process (so: untrusted, maybe forged).

    Returns a dict with exactly {exit_code, kind, display, error, files}: ``exit_code`` in 0..255, ``kind`` one of
    :data:`_RESULT_KINDS`, ``display`` a str of at most ``cap`` characters or None, ``error`` None or {ename,
    evalue} (str), ``files`` only paths that were asked for (``fetch``), each a str of base64 or None, within
    the fetch budget. Strings come back as valid Unicode (lone surrogates escaped, see :func:`clean_text`). A
    frame must carry ``nonce`` if one is given (a session's request carries a fresh one). Raises ValueError for
    anything else.
    """
    if body[:1] == b"S":
        code, kind, got = (body[1:].decode("ascii").split(" ") + [""])[:3]
        if not code.isdigit() or len(code) > 3 or body.count(b" ") != (2 if nonce else 1):
            raise ValueError("malformed result")
        raw = {"exit_code": int(code), "kind": kind, "display": None, "error": None, "files": {}}
    else:
        raw = json.loads(body.decode("utf-8"))
        got = raw.pop("nonce", "") if isinstance(raw, dict) else ""
    if got != nonce or not isinstance(raw, dict) or set(raw) != _RESULT_FIELDS:
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
    return {
        "exit_code": exit_code,
        "kind": kind,
        "display": None if display is None else clean_text(display),
        "error": None if error is None else {k: clean_text(v) for k, v in error.items()},
        "files": {clean_text(k): v for k, v in files.items()},
    }


def result_frame_limit(cap, fetch):
    """The largest result frame a run asked to fetch ``fetch`` can legitimately produce, bytes: display and
    error (JSON may spell each character as a 12-byte surrogate pair escape), the fetch budget in base64 and
    every requested path with its JSON overhead."""
    paths = sum(12 * len(p) + 16 for p in fetch)
    return 65536 + 36 * cap + 4 * cap * 4 // 3 + paths


def clean_text(text):
    """``text`` as valid Unicode: lone surrogates (which no UTF-8 encoder accepts) become ``\\udXXX`` escapes."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        except (OSError, ValueError):  # missing, unreadable, or not a valid path (NUL, lone surrogate)
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
    """A stateful kernel: fd 3 receives code frames, fd 4 returns result frames (each echoing its request's
    nonce); globals persist. A frame it cannot read (the code closed or wrote into fd 3) ends it."""
    namespace = fresh_main()
    while True:
        try:
            req = read_frame(3, 1 << 30)
        except (ValueError, OSError):
            os._exit(1)
        if req is None:
            os._exit(0)
        sys.stdin = io.StringIO(req["stdin"])
        if sys.stdout.closed or sys.stderr.closed:
            _fresh_std_streams()
        result = execute(req["code"], namespace, True, cap, req.get("files"), req.get("fetch_files", ()))
        if sys.stdout.closed or sys.stderr.closed:
            _fresh_std_streams()
        try:
            write_result(4, result, req["nonce"])
        except OSError:  # the code closed its result channel: the worker sees the kernel answer nothing
            os._exit(1)


# ---------------------------------------------------------------- worker side


class Kernel:
    """A session's kernel and the worker's ends of its pipes.

    ``pid``: the code's long-lived process. In isolated modes it is pid 2 of the session's own pid namespace,
    whose pid 1, ``init`` (the worker's child, not the code's uid), reaps orphans and reports the kernel's exit
    status on ``status_r``; ending ``init`` ends every process of the session. Mode "none": ``init`` is None and
    the kernel is the worker's child.
    """

    def __init__(self, pid, init, uid, ctl_w, res_r, out_r, err_r, status_r, cgroup):
        self.pid, self.init, self.uid, self.cgroup = pid, init, uid, cgroup
        self.ctl_w, self.res_r, self.out_r, self.err_r, self.status_r = ctl_w, res_r, out_r, err_r, status_r
        self.pidfd = os.pidfd_open(pid)
        self.held = 0  # bytes of memory it held after its last call
        self.limit = None  # its memory cgroup's current limit, bytes
        self.cpu_limit = None  # the RLIMIT_CPU soft limit of its current call, seconds
        self.frozen_cpu = 0.0  # the CPU time it had used when its last call ended, seconds

    def close_fds(self):
        for fd in (self.ctl_w, self.res_r, self.out_r, self.err_r, self.status_r, self.pidfd):
            _close(fd)


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


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
        self.sessions_made = 0
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

    def replace_run(self, generation):
        """Give the stateless runs a fresh cgroup ``run<generation>``; returns the old one's name (the caller
        removes it once its memory is freed)."""
        name = f"run{generation}"
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
        """A fresh cgroup for one session; returns (name, an fd of its cgroup.procs to join it)."""
        self.sessions_made += 1
        name = f"s{uid}-{self.sessions_made}"
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


class Worker:
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
        self.run_generation = 0
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
        """RLIMIT_CPU of a session's kernel for its next call: the CPU time it used so far plus the call's
        timeout (a process's CPU limit counts all its life; the kernel dies by SIGXCPU when it is reached)."""
        soft = int(_cpu_seconds(kernel.pid)) + int(timeout) + 2
        try:
            resource.prlimit(kernel.pid, resource.RLIMIT_CPU, (soft, soft + 1))
            kernel.cpu_limit = soft
        except OSError:  # it died between calls; collect() sees it
            pass

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

    def collect(self, procs, deadline, fetch, stop, exited=False, one_shot=True, nonce=""):
        """Gather output until the run finishes (a one-shot child exits, a kernel answers) or the deadline.

        ``procs``: (pid, pidfd, stdout, stderr and result pipes). ``exited``: the process has already exited (its
        output is still in the pipes). When the process is finished (one-shot, died, timed out or corrupted its
        channel) ``stop(col, exited)`` ends it and returns its wait status; in every case all other processes of
        the sandbox are killed after it. The result frame may be at most as large as the request allows
        (:func:`result_frame_limit`) and must carry ``nonce``.
        """
        pid, pidfd, out_r, err_r, res_r = procs
        bufs = {out_r: bytearray(), err_r: bytearray()}
        dropped = {out_r: 0, err_r: 0}
        res_buf = bytearray()
        limit = result_frame_limit(self.cap, fetch)
        col = {"result": None, "timed_out": False, "wait_status": None, "bad_frame": False, "reset": False}
        poller = select.poll()
        for fd in (out_r, err_r, res_r, pidfd):
            poller.register(fd, select.POLLIN)
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
            if len(res_buf) > limit:
                col["bad_frame"] = True
                break
            if not one_shot and _frame_complete(res_buf):
                break
        finished = one_shot or exited or col["timed_out"] or col["bad_frame"]
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
                    self.run_generation += 1
                    self.cgroups.replace_run(self.run_generation)
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


def _kick_unix_gc():
    """Make the kernel collect unix sockets that only the fds in flight in each other's (or their own) queues
    keep alive, with what those fds hold (a memfd's pages, say). Releasing any unix socket starts that
    collection; a run whose last socket references itself releases none, and without this its memory would wait
    for some other socket on the host to close."""
    fds = (ctypes.c_int * 2)()
    if _sys_socketpair(1, 1, 0, fds) == 0:  # AF_UNIX, SOCK_STREAM
        os.close(fds[0])
        os.close(fds[1])


def _rmtree(path):
    """shutil.rmtree, ignoring errors (mode "none" only). Imported here: shutil loads bz2 and lzma, whose libraries
    would add mappings to the worker that every fork copies and every child unmaps."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


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
        "evicted": None,
    }


class Leftovers:
    """What code left in the sandbox's shared places: its /tmp, /dev/shm and /dev/mqueue, its SysV IPC tables and
    its unix sockets. Empty by construction (every execution has its own namespaces there), so a finding means an
    escape. The /proc files are opened once and re-read from the start for every check."""

    _DIRS = ("/tmp", "/dev/shm", "/dev/mqueue")

    def __init__(self, tables):
        self.tables = tables  # SysV table name -> an fd of its /proc/sysvipc file (see _open_sysvipc)
        try:
            self.unix = os.open("/proc/self/net/unix", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.unix = None

    def find(self):
        found = []
        for path in self._DIRS:
            try:
                if os.listdir(path):
                    found.append(f"files in the sandbox's {path}")
            except OSError:
                pass
        for table, fd in self.tables.items():
            if _lines(fd) > 1:  # a header line, then one per object
                found.append(f"SysV {table} objects in the sandbox's IPC namespace")
        deadline = time.monotonic() + 1.0
        while True:  # sockets sent over sockets linger until the kernel's unix garbage collector runs
            sockets = _lines(self.unix) - 1 if self.unix is not None else 0
            if sockets <= 0 or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if sockets > 0:
            found.append(f"{sockets} unix sockets in the sandbox's network namespace")
        return found


def _open_sysvipc():
    """Fds of /proc/sysvipc/{shm,msg,sem} (each shows the IPC namespace of its opener), by table name."""
    tables = {}
    for table in ("shm", "msg", "sem"):
        try:
            tables[table] = os.open("/proc/sysvipc/" + table, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass
    return tables


def _lines(fd):
    """Number of lines of the /proc file open at ``fd``, read from its start."""
    count, offset = 0, 0
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        count += chunk.count(b"\n")
        if len(chunk) < 1 << 15:  # records are short: a read much shorter than asked for stopped at the end
            return count
        offset += len(chunk)


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


def _status_pipe():
    """A pipe for the sandbox's own reports about one execution; its write end sits above every fd number a child
    moves its pipes to (so that moving them cannot overwrite it)."""
    r, w = os.pipe()
    high = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 64)
    os.close(w)
    return r, high


def _report_setup_failure(fd, exc):
    """In a child whose setup failed: say why on the status channel (best effort)."""
    try:
        os.write(fd, b"E" + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:1000])
    except BaseException:
        pass


def _await_setup(fd, timeout):
    """Wait for a child's setup report on ``fd``: None when setup is done, else what went wrong."""
    if not select.select((fd,), (), (), timeout)[0]:
        return "setup did not finish in time"
    first = os.read(fd, 1)
    if first == SETUP_DONE:
        return None
    if first == b"E":
        return os.read(fd, 4096).decode(errors="replace")
    return "the process died during setup"


def _await_exit_status(fd, timeout):
    """A session kernel's wait status, as its init reports it on ``fd`` (b"W" + 4 bytes), or None."""
    deadline = time.monotonic() + timeout
    data = b""
    while len(data) < 5:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select((fd,), (), (), left)[0]:
            return None
        chunk = os.read(fd, 5 - len(data))
        if not chunk:
            return None
        data += chunk
    return struct.unpack(">i", data[1:])[0] if data[:1] == b"W" else None


def _first_child(pid):
    """The pid (in this /proc) of ``pid``'s only child, or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _cpu_seconds(pid):
    """CPU seconds (user + system, all threads) ``pid`` has used, or 0.0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0.0
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _state(path):
    """The state letter of the task whose ``stat`` file is ``path`` (b"Z" zombie, b"X" dead), or b"X" if gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3]
    except (OSError, ValueError):
        return b"X"


def _running(pid):
    """Whether any thread of process ``pid`` is neither stopped nor dead (a zombie or gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_state(f"/proc/{pid}/task/{tid}/stat") not in (b"T", b"t", b"Z", b"X") for tid in tids)


def _alive(pid_name):
    """Whether any thread of process ``pid_name`` still runs (not a zombie or gone). A process whose main thread
    has exited shows state Z while its other threads run: those are counted one by one."""
    if _state(f"/proc/{pid_name}/stat") not in (b"Z", b"X"):
        return True
    try:
        tids = os.listdir(f"/proc/{pid_name}/task")
    except OSError:
        return False
    return any(_state(f"/proc/{pid_name}/task/{tid}/stat") not in (b"Z", b"X") for tid in tids)


def _uid_tasks(uid, pids):
    """Whether any of ``pids`` (processes in any state) runs as ``uid``.

    The uid is the owner of the process's /proc directory (the kernel sets it to the effective uid), which the
    code cannot write; its status file is never parsed, since its first line is the process name, the code's to
    choose (``Uid:x`` or ``Uid:<another uid>``). The code's effective uid is its real uid: it holds no
    capability and every mount it sees is nosuid."""
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                return True
        except OSError:
            continue
    return False


def _drain_stale(fd):
    """Discard bytes left in a session's result pipe (written after its last answer): they are never an answer."""
    os.set_blocking(fd, False)
    _drain_nonblocking(fd)
    os.set_blocking(fd, True)


def _stdin_fd(text):
    """A readable fd holding ``text`` as UTF-8 (then EOF; a lone surrogate becomes U+FFFD); the caller closes it."""
    if not text:
        return os.open("/dev/null", os.O_RDONLY)
    data = text.encode("utf-8", "replace")
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
    # Channels between executions through state the kernel shares: inotify watches on shared files see other
    # executions open and read them; the page cache of shared files can be probed (mincore, cachestat, and
    # aio with IOCB_NOWAIT); aio contexts also draw on a host-wide quota (fs.aio-max-nr).
    "inotify_init",
    "inotify_init1",
    "mincore",
    "cachestat",
    "process_madvise",
    "io_setup",
    "io_submit",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_cancel",
    # sysinfo reports host-wide counts (every thread of the host, free memory): an exact counter any execution
    # can move and any other read. (glibc's sysconf(_SC_PHYS_PAGES) uses it and then fails.)
    "sysinfo",
)
#: What the worker itself needs (per-run namespaces and tmpfs mounts); its children are denied these too, by a
#: second filter of their own.
_WORKER_NEEDS = ("mount", "unshare", "setns")
#: What the worker does for every execution but the code may not: a new session (setsid) is a new scheduler
#: autogroup, which the kernel gives as much CPU as all of another execution (one session, made by the worker),
#: so CPU shares follow the execution, not the number of sessions its processes make. Refused, as for a
#: process-group leader (EPERM).
_CODE_DENIED = ("setsid",)  # (and pidfds: _add_pidfd_rules)
#: fcntl commands that take or query record locks: locks on shared read-only files (/usr) are seen by every
#: execution and by the host, so they are no-ops (success, no lock taken; queries report nothing).
_LOCK_COMMANDS = (5, 6, 7, 36, 37, 38)  # F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
F_NOTIFY, RWF_NOWAIT = 1026, 0x8
POSIX_FADV_DONTNEED, POSIX_FADV_NOREUSE, MADV_MERGEABLE, MADV_COLD, MADV_PAGEOUT = 4, 5, 12, 20, 21
CLONE_PIDFD, SOL_SOCKET, SO_PASSPIDFD, SO_PEERPIDFD = 0x1000, 1, 76, 77
# CLONE_NEWUSER, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWNS, NEWCGROUP
_CLONE_NS_FLAGS = (0x10000000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x00020000, 0x02000000)


def _build_filter(worker):
    """The seccomp filter of the worker itself (``worker``) or the one the code's processes add to it.

    The code's processes inherit the worker's filter and stack theirs on top (for each call the kernel applies the
    strictest answer of all filters), so theirs only denies what the worker keeps for itself, ``_WORKER_NEEDS``
    and ``_CODE_DENIED``: together the two deny everything in ``_DENIED`` and everything the worker's filter
    denies by argument. It is
    kept that short because every child loads it, and loading costs time in proportion to the program's length.
    """
    import socket  # (not in the worker: its enums would add to the memory every fork copies)

    import seccomp  # libseccomp's Python binding (Debian: python3-seccomp)

    flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    try:  # a binary search over syscall numbers instead of a linear scan: every call of every process pays it
        flt.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    except (AttributeError, RuntimeError, ValueError, OSError):
        pass  # an older libseccomp
    eperm = seccomp.ERRNO(errno.EPERM)
    if not worker:
        for name in _WORKER_NEEDS + _CODE_DENIED:
            flt.add_rule(eperm, name)
        _add_pidfd_rules(flt, seccomp)
        return flt
    for name in _DENIED:
        if name in _WORKER_NEEDS:
            continue
        try:
            flt.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            pass  # syscall unknown to this libseccomp/kernel
    flt.add_rule(eperm, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    _add_channel_rules(flt, seccomp)
    # clone3 passes flags in memory, which seccomp cannot inspect: make libc fall back to clone().
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        flt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        if flag not in (CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID):
            flt.add_rule(eperm, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    return flt


def _add_pidfd_rules(flt, seccomp):
    """No pidfds for the code (the worker keeps them): a pidfd's inode number is its process's number in a
    counter the kernel bumps for every process started on the host, so one execution forking and another
    reading a fresh pidfd's inode would be a channel. Refused as a kernel without pidfds would: pidfd_open
    ENOSYS, clone's CLONE_PIDFD EINVAL, the SO_PEERPIDFD and SO_PASSPIDFD socket options ENOPROTOOPT."""
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "pidfd_open")
    flt.add_rule(
        seccomp.ERRNO(errno.EINVAL), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_PIDFD, CLONE_PIDFD)
    )
    for call, option in (("getsockopt", SO_PEERPIDFD), ("setsockopt", SO_PASSPIDFD)):
        flt.add_rule(
            seccomp.ERRNO(errno.ENOPROTOOPT),
            call,
            seccomp.Arg(1, seccomp.EQ, SOL_SOCKET),
            seccomp.Arg(2, seccomp.EQ, option),
        )


def _add_channel_rules(flt, seccomp):
    """Calls that would let one execution signal another through kernel state they share, made no-ops (success,
    nothing done) or refused: file locks (flock, fcntl record locks), directory change notification (dnotify),
    dropping pages of shared files from the page cache (fadvise DONTNEED/NOREUSE, madvise COLD/PAGEOUT), page
    merging (madvise MERGEABLE), and reads that fail instead of waiting when a page is not cached (RWF_NOWAIT)."""
    noop = seccomp.ERRNO(0)
    flt.add_rule(noop, "flock")
    for cmd in _LOCK_COMMANDS:
        flt.add_rule(noop, "fcntl", seccomp.Arg(1, seccomp.EQ, cmd))
    flt.add_rule(seccomp.ERRNO(errno.EPERM), "fcntl", seccomp.Arg(1, seccomp.EQ, F_NOTIFY))
    for advice in (POSIX_FADV_DONTNEED, POSIX_FADV_NOREUSE):
        flt.add_rule(noop, "fadvise64", seccomp.Arg(3, seccomp.EQ, advice))
    for advice in (MADV_MERGEABLE, MADV_COLD, MADV_PAGEOUT):  # (merging: a timing channel where KSM runs)
        flt.add_rule(noop, "madvise", seccomp.Arg(2, seccomp.EQ, advice))
    for name in ("preadv2", "pwritev2"):
        flt.add_rule(
            seccomp.ERRNO(errno.EOPNOTSUPP), name, seccomp.Arg(5, seccomp.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT)
        )


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _bpf(flt):
    """A libseccomp filter as a raw BPF program (an array of struct sock_filter)."""
    fd = os.memfd_create("seccomp", 0)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            flt.export_bpf(f)
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def compile_filters():
    """The worker's program and the code's, as raw BPF, built by libseccomp in a short-lived child: the binding
    and its library stay out of the worker, whose every mapping each fork copies and each child unmaps.
    Raises ImportError if the binding is missing."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                out = (None, _bpf(_build_filter(worker=True)), _bpf(_build_filter(worker=False)))
            except ImportError as exc:
                out = (str(exc), b"", b"")
            data = marshal.dumps(out)
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    if os.waitpid(pid, 0)[1] != 0 or not chunks:
        raise RuntimeError("could not build the seccomp filters")
    error, worker_program, code_program = marshal.loads(b"".join(chunks))
    if error is not None:
        raise ImportError(error)
    return worker_program, code_program


def _sock_fprog(program):
    """(struct sock_fprog, its buffer) for ``prctl(PR_SET_SECCOMP)``; the buffer must live as long as it is used."""
    buf = ctypes.create_string_buffer(program, len(program))
    return _SockFprog(len(program) // 8, ctypes.addressof(buf)), buf


def load_seccomp():
    """Load the worker's filter (after no_new_privs, which every child inherits) and return the code's addition to
    it, which each child loads itself, as (sock_fprog, buffer)."""
    worker_program, code_program = compile_filters()
    prog, _buf = _sock_fprog(worker_program)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_sys_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")
    return _sock_fprog(code_program)


# ---------------------------------------------------------------- startup


def _partition_quotas(cfg):
    """Size the per-uid kernel quotas (POSIX queue bytes, queued signals, locked memory) so that every execution a
    worker may hold at once (its sessions and one stateless run) gets its own share: the kernel caps the sum over
    all uids of the worker's user namespace at its creator's limits of the moment it is made (root mode, before
    that). Each execution gets the configured quota where the host lets the limits be raised that far, else an
    equal part of the host's limit. Returns the per-execution limits [(resource, bytes or count)]."""
    slots = cfg["max_sessions"] + 1
    q = cfg["quotas"]
    shares = []
    for res, want in (
        (resource.RLIMIT_MSGQUEUE, q["msgqueue_bytes"]),
        (resource.RLIMIT_SIGPENDING, q["sigpending"]),
        (resource.RLIMIT_MEMLOCK, q["memlock_bytes"]),
    ):
        hard = resource.getrlimit(res)[1]
        total = want * slots if hard == resource.RLIM_INFINITY else min(want * slots, hard)
        try:
            resource.setrlimit(res, (want * slots, want * slots))
            total = want * slots
        except (ValueError, OSError):  # raising needs CAP_SYS_RESOURCE: share what the host allows
            resource.setrlimit(res, (total, hard))
        shares.append((res, max(1, total // slots)))
    return shares


def _enter_own_user_namespace(host_uid, code_uids):
    """Become root of a new user namespace owned by, and mapped to, the unprivileged ``host_uid`` (``code_uids``
    map to themselves).

    Owned by ``host_uid`` rather than by the host's root, the namespace's per-user quotas (POSIX queue bytes,
    queued signals, locked memory, namespaces), which the kernel also sums at the owner's level, are this
    worker's alone, shared neither with the host's root nor with other workers. CAP_SYS_ADMIN is kept across the
    uid change (hosts may forbid unprivileged user namespaces). A helper still in the parent namespace writes
    the maps, which needs CAP_SETUID/SETGID there."""
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
        os.setgroups([])
        os.setresgid(host_uid, host_uid, host_uid)
        _prctl(PR_SET_KEEPCAPS, 1)
        os.setresuid(host_uid, host_uid, host_uid)
        _set_capabilities(1 << CAP_SYS_ADMIN)
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


def _become_pid_one():
    """Continue in a child that is pid 1 of a new pid namespace owned by the worker's user namespace (so that the
    worker may give every execution a pid namespace of its own, see :meth:`Worker.fork_execution`). This process
    stays behind as its parent, holding nothing, and exits with it."""
    _unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        return
    os.closerange(3, 1 << 16)
    status = os.waitpid(pid, 0)[1]
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def setup_worker(cfg):
    """Once, before any code: namespaces and privileges (per ``mode``), environment, inherited limits.

    Isolated modes end in a child of the starting process: pid 1 of its own pid namespace, with its own mount
    namespace and /proc, and its own network namespace, in which no code ever runs."""
    mode = cfg["mode"]
    if mode != "none":
        # Nothing shared by executions stays writable: the sandbox's root and /dev (bubblewrap's tmpfs; in "userns"
        # mode they belong to the code's uid) and its /dev/mqueue (a stateless run sees it, while its own queues
        # live in its own IPC namespace: a file there would be a queue in the sandbox's namespace).
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        for path in ("/", "/dev"):
            _mount("none", path, None, flags, None)
        _mount("none", "/dev/mqueue", None, flags | MS_NOEXEC, None)
        # Mounts no execution needs (every execution mounts its own /tmp and /dev/shm over these empty, read-only
        # directories; the worker's source is loaded): each one is copied into, and torn down with, every
        # execution's mount namespace. /dev/pts too: its ptys would be one pool for all executions, whose
        # numbers (the lowest free one is handed out) show what the others hold, so the code gets no pty.
        for path in ("/tmp", "/dev/shm", "/dev/pts", _WORKER_FILE):
            _check(_libc.umount2(path.encode(), 0), f"umount {path}")
    if mode == "root":
        # A plain /proc of this namespace, fully visible (no mounts inside it): the kernel lets a user namespace
        # mount a /proc of its own only if one is. No code ever sees it (every execution mounts its own). It
        # replaces bubblewrap's (with its read-only covers): every mount here is copied into, and torn down
        # with, every execution's mount namespace.
        _check(_libc.umount2(b"/proc", MNT_DETACH), "umount /proc")
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        shares = _partition_quotas(cfg)
        _enter_own_user_namespace(
            cfg["uid_base"], range(cfg["uid_base"] + 1, cfg["uid_base"] + cfg["n_uids"] + 1)
        )
    if mode != "none":
        _drop_bounding_set()
        _become_pid_one()
        _unshare(CLONE_NEWNS | CLONE_NEWNET)
        # The worker's /proc: its own pid namespace, pids only (its stray sweep lists it after every request).
        # The SysV tables of its IPC namespace, which the health check reads, are opened before it hides them.
        cfg["sysvipc_fds"] = _open_sysvipc()
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "subset=pid")
    if mode == "root":  # from now on, the quotas of one execution (each runs as a uid of its own)
        for res, value in shares:
            resource.setrlimit(res, (value, value))
    os.environ.clear()
    os.environ.update(CODE_ENV)
    if mode != "none":  # every execution's private working directory (mode "none": set per execution)
        os.environ["HOME"] = os.environ["TMPDIR"] = WORKDIR
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
    ready = {"ready": True, "seccomp": False, "error": None}
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
    ready["pid"] = os.getpid()
    ready["uid"] = os.getuid()
    write_frame(ctl_out, ready)
    if ready["error"]:
        return 2
    gc.freeze()  # keep the collector from touching (and so copying) the worker's pages in every child
    write_frame(ctl_out, _checked_health(worker))
    while True:
        while worker.kernels and not select.select([ctl_in], [], [], _IDLE_CHECK_S)[0]:
            try:
                worker.watch_idle()
            except Exception as exc:  # a bug of ours: no new work here, but the sessions on it go on
                worker.refusal = worker.refusal or f"idle check error: {type(exc).__name__}: {exc}"
        req = read_frame(ctl_in, 1 << 30)
        if req is None:
            return 0
        try:
            resp = worker.handle(req)
        except Exception as exc:
            resp = _internal_reply(f"worker error: {type(exc).__name__}: {exc}")
        write_frame(ctl_out, resp)
        write_frame(ctl_out, _checked_health(worker))


def _checked_health(worker):
    """:meth:`Worker.cleanup_and_check`, never raising: a cleanup that fails (a bug of ours, whatever the code
    did) fails the health check, so the worker takes no new work and is replaced once its sessions end, instead
    of dying with them. What the failed cleanup had not given back yet (uids, cgroups) is never reused."""
    try:
        return worker.cleanup_and_check()
    except Exception as exc:
        problem = f"cleanup error: {type(exc).__name__}: {exc}"
        worker.refusal = worker.refusal or problem
        return {"health": False, "problems": [problem], "cleanup_s": 0.0}


if __name__ == "__main__":
    sys.exit(main())
