"""The fork server that runs INSIDE a sandbox (stdlib only; run by the sandbox's own interpreter).

It is started once per pool slot (``python3 -I _worker.py CONFIG_JSON``), answers requests from the host on
its stdin/stdout (frames: 4-byte big-endian length + UTF-8 JSON) and forks a child per execution, so a run
costs a fork instead of an interpreter start. It must stay importable by old Pythons (3.8+): no third-party
imports except libseccomp's binding, loaded only when asked for.

Requests (``op``): ``run`` {code, stdin, timeout, slot, files, fetch_files, memory_bytes}: slot 0 is
stateless (a fresh child per run; ``memory_bytes`` may lower its address-space limit); slot k >= 1 is a stateful kernel (a long-lived child keeping globals, started on first use);
``close`` {slot}. Each run answers {stdout, stderr, exit_code, status, duration_s, truncated, display,
message, error, files, reset}.

Containment done here (the host adds the namespaces, read-only filesystem and the worker's capabilities):
- a session's kernel is SIGSTOPped between calls, so nothing it left running (threads) runs unbounded;
- code runs as a non-root uid (``uid_base + slot``) with no capabilities, in its own session/process group,
  with rlimits on address space, processes, file size, open files and CPU time;
- a seccomp filter (loaded once here, inherited by every child) denies non-AF_UNIX sockets, ptrace, and
  namespace, mount, kernel-module and keyring syscalls;
- a wall-clock deadline: then the whole process group and every other process of the call is SIGKILLed;
- after every call, any process left running (double-forked, setsid'd) is killed and zombies are reaped;
- stdout/stderr are capped per stream, the rest is drained and dropped.
"""

import ast
import base64
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
import stat
import struct
import sys
import time
import traceback
import types

FILENAME = "<cell>"
_HEADER = struct.Struct(">I")
_WORKER_FILE = os.path.abspath(__file__)
#: The environment the code sees (HOME and TMPDIR are set per run to its private directory).
CODE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


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


_RESULT_KINDS = ("ok", "error", "oom")


def write_result(fd, result):
    """Send an execution result. The common case (no display, error or files) skips json, whose first use
    after a fork costs a fifth of a millisecond: body ``S<exit code> <kind>``; otherwise a JSON object."""
    if result["display"] is None and result["error"] is None and not result["files"]:
        _write_body(fd, b"S%d %s" % (result["exit_code"], result["kind"].encode()))
    else:
        write_frame(fd, result)


def parse_result(body):
    """Decode and validate a result frame body written by the code's process (so: untrusted)."""
    if body[:1] == b"S":
        code, _, kind = body[1:].decode("ascii").partition(" ")
        result = {"exit_code": int(code), "kind": kind, "display": None, "error": None, "files": {}}
    else:
        result = json.loads(body.decode("utf-8"))
    if not (
        isinstance(result, dict)
        and type(result.get("exit_code")) is int
        and result.get("kind") in _RESULT_KINDS
        and isinstance(result.get("display"), (str, type(None)))
        and isinstance(result.get("error"), (dict, type(None)))
        and isinstance(result.get("files"), dict)
    ):
        raise ValueError("malformed result")
    return result


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
        error = {"ename": type(exc).__name__, "evalue": _safe_str(exc)}
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


def setup_child(cfg, slot, fds, cpu_s, workdir):
    """In a freshly forked child: own session, fds 0..N from ``fds``, rlimits, drop to the code uid."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(len(fds), 65536)
    # RLIMIT_AS, FSIZE and CORE, and oom_score_adj, are set once on the worker and inherited.
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["limits"]["nofile"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["limits"]["nproc"],) * 2)
    if cpu_s is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    if cfg["drop_uid"]:
        uid = cfg["uid_base"] + slot
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.chdir(workdir)
    if os.environ["HOME"] != workdir:
        os.environ["HOME"] = os.environ["TMPDIR"] = workdir


def setup_worker(cfg):
    """Once, in the worker: what every child inherits (environment, limits, OOM preference, std streams)."""
    os.environ.clear()
    os.environ.update(CODE_ENV)
    os.environ["HOME"] = os.environ["TMPDIR"] = os.path.join(cfg["tmp_root"], "slot0")
    lim = cfg["limits"]
    for res, value in (
        (resource.RLIMIT_AS, lim["as_bytes"]),
        (resource.RLIMIT_FSIZE, lim["fsize_bytes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    try:  # OOM inside the sandbox should take the code (the sandbox's init is protected by the host)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    _fresh_std_streams()


def kernel_main(cfg, cap):
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
    def __init__(self, pid, ctl_w, res_r, out_r, err_r):
        self.pid, self.ctl_w, self.res_r, self.out_r, self.err_r = pid, ctl_w, res_r, out_r, err_r
        self.pidfd = os.pidfd_open(pid)

    def close_fds(self):
        for fd in (self.ctl_w, self.res_r, self.out_r, self.err_r, self.pidfd):
            _close(fd)


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


class Worker:
    def __init__(self, cfg):
        self.cfg = cfg
        self.cap = cfg["output_cap"]
        self.kernels = {}
        self.me = os.getpid()

    # -- work directories: one private dir per slot, owned by that slot's uid
    def workdir(self, slot):
        """An empty private directory for ``slot``, owned by its uid, mode 0700."""
        path = os.path.join(self.cfg["tmp_root"], f"slot{slot}")
        uid = self.cfg["uid_base"] + slot if self.cfg["drop_uid"] else os.getuid()
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISDIR(st.st_mode) or os.listdir(path)):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            st = None
        if st is None:
            os.mkdir(path, 0o700)
            st = os.lstat(path)
        if st.st_uid != uid:
            os.chown(path, uid, uid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
        return path

    def clean_shm(self, slot):
        """Delete what ``slot``'s uid left in /dev/shm (shared by the whole sandbox)."""
        if not self.cfg["drop_uid"] or not os.path.isdir("/dev/shm"):
            return
        uid = self.cfg["uid_base"] + slot
        for name in os.listdir("/dev/shm"):
            path = os.path.join("/dev/shm", name)
            try:
                if os.lstat(path).st_uid != uid:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                pass

    # -- process hygiene
    def kill_strays(self):
        """SIGKILL every process in the sandbox except pid 1, this worker and live kernels.

        Without a private pid namespace (unisolated mode) /proc shows the host, so nothing is scanned: only
        each run's process group is killed.
        """
        if not self.cfg["own_pid_namespace"]:
            return
        protect = {1, self.me}
        protect.update(k.pid for k in self.kernels.values())
        for _ in range(200):
            victims = []
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) not in protect and not _is_zombie(name):
                    victims.append(int(name))
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.0005)

    # -- requests
    def handle(self, req):
        op = req.get("op")
        if op == "run":
            if req["slot"] == 0:
                return self.run_stateless(req)
            return self.run_in_kernel(req)
        if op == "close":
            self.close_kernel(req["slot"])
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def run_stateless(self, req):
        start = time.monotonic()
        workdir = self.workdir(0)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        stdin_fd = _stdin_fd(req["stdin"])
        cpu_s = int(req["timeout"]) + 1
        compiled = _precompile(req["code"])
        pid = os.fork()
        if pid == 0:
            try:
                setup_child(self.cfg, 0, (stdin_fd, out_w, err_w, res_w), cpu_s, workdir)
                if req.get("memory_bytes"):  # a per-run limit may only lower the pool's
                    limit = min(req["memory_bytes"], self.cfg["limits"]["as_bytes"])
                    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                namespace = fresh_main()
                fetch = req.get("fetch_files", ())
                result = execute(req["code"], namespace, False, self.cap, req.get("files"), fetch, compiled)
                write_result(3, result)
                os._exit(result["exit_code"])
            except BaseException:
                os._exit(71)
        for fd in (out_w, err_w, res_w, stdin_fd):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        try:
            col = self.collect(pid, pidfd, out_r, err_r, res_r, start + req["timeout"], one_shot=True)
        finally:
            for fd in (out_r, err_r, res_r, pidfd):
                _close(fd)
        self.clean_shm(0)
        return self.finish(col, start, req["timeout"], session=False)

    def start_kernel(self, slot):
        workdir = self.workdir(slot)
        ctl_r, ctl_w = os.pipe()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open("/dev/null", os.O_RDONLY)
        pid = os.fork()
        if pid == 0:
            try:
                setup_child(self.cfg, slot, (devnull, out_w, err_w, ctl_r, res_w), None, workdir)
                kernel_main(self.cfg, self.cap)
            except BaseException:
                os._exit(71)
        for fd in (ctl_r, res_w, out_w, err_w, devnull):
            os.close(fd)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        kernel = Kernel(pid, ctl_w, res_r, out_r, err_r)
        self.kernels[slot] = kernel
        return kernel

    def close_kernel(self, slot):
        kernel = self.kernels.pop(slot, None)
        if kernel is not None:
            try:
                os.killpg(kernel.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill(kernel.pid)
            _reap(kernel.pid)
            kernel.close_fds()
            self.kill_strays()
        self.clean_shm(slot)
        path = os.path.join(self.cfg["tmp_root"], f"slot{slot}")
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)

    def run_in_kernel(self, req):
        start = time.monotonic()
        slot = req["slot"]
        kernel = self.kernels.get(slot)
        if kernel is None:
            kernel = self.start_kernel(slot)
        else:
            _signal(kernel.pid, signal.SIGCONT)  # frozen since its last call, background threads included
        _drain_nonblocking(kernel.out_r)
        _drain_nonblocking(kernel.err_r)
        try:
            msg = {
                "code": req["code"],
                "stdin": req["stdin"],
                "files": req.get("files"),
                "fetch_files": req.get("fetch_files", ()),
            }
            write_frame(kernel.ctl_w, msg)
        except OSError:
            pass  # the kernel died between calls; collect() sees it exit
        col = self.collect(
            kernel.pid, kernel.pidfd, kernel.out_r, kernel.err_r, kernel.res_r, start + req["timeout"], False
        )
        if col["reset"]:
            self.kernels.pop(slot, None)
            if col["wait_status"] is None:  # it answered, but with a corrupt frame: end it
                try:
                    os.killpg(kernel.pid, signal.SIGKILL)
                except OSError:
                    pass
                _kill(kernel.pid)
                col["wait_status"] = _reap(kernel.pid)
                self.kill_strays()
            kernel.close_fds()
        else:
            # Between calls the kernel must not run: a thread it left behind would otherwise burn CPU or
            # print into later calls, outside any time limit.
            _signal(kernel.pid, signal.SIGSTOP)
        return self.finish(col, start, req["timeout"], session=True)

    def collect(self, pid, pidfd, out_r, err_r, res_r, deadline, one_shot):
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
        self.kill_strays()
        # Every writer is dead now; for a live kernel, all it wrote before answering is already in the pipe.
        drain_deadline = time.monotonic() + 2.0
        for fd in (out_r, err_r):
            self._drain(fd, bufs, dropped, drain_deadline if finished else None)
        if one_shot:
            res_buf += _read_rest(res_r)
        if res_buf and not col["bad_frame"]:
            try:
                if not _frame_complete(res_buf):
                    raise ValueError("incomplete result frame")
                (size,) = _HEADER.unpack(bytes(res_buf[:4]))
                col["result"] = parse_result(bytes(res_buf[4 : 4 + size]))
            except (ValueError, RecursionError):
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

    def finish(self, col, start, timeout, session):
        duration = time.monotonic() - start
        result = col["result"] or {}
        status = result.get("kind")
        exit_code = result.get("exit_code")
        message = ""
        ws = col["wait_status"]
        if col["timed_out"]:
            status, exit_code = "timeout", None
            message = f"wall-clock limit of {timeout:g} s exceeded; all of the code's processes were killed"
        elif col["bad_frame"]:
            status, exit_code = "error", None
            message = "the code corrupted the sandbox's result channel; its processes were killed"
        elif ws is not None and os.WIFSIGNALED(ws) and (col["result"] is None or not session):
            sig = os.WTERMSIG(ws)
            if col["result"] is None or sig != signal.SIGKILL:
                exit_code = -sig
                status = "timeout" if sig == signal.SIGXCPU else "killed"
                message = f"killed by signal {_signame(sig)}"
                if sig == signal.SIGXCPU:
                    message = "CPU-time limit exceeded"
        elif col["result"] is None:
            code = os.WEXITSTATUS(ws) if ws is not None and os.WIFEXITED(ws) else None
            exit_code = code
            status = "ok" if code == 0 else "error"
            if code in (70, 71):
                status, message = (
                    "sandbox_error",
                    f"the sandbox's child process failed internally (exit {code})",
                )
        if col["reset"] and session:
            note = "the session's kernel exited; its state was lost and the next run starts fresh"
            message = (message + "; " + note) if message else note
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
            "message": message,
            "error": result.get("error"),
            "files": result.get("files") or {},
            "reset": col["reset"],
        }


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
# CLONE_NEWUSER, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWNS, NEWCGROUP
_CLONE_NS_FLAGS = (0x10000000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x00020000, 0x02000000)


def load_seccomp():
    """Deny network sockets, ptrace and kernel-surface syscalls for this process and all its descendants."""
    import seccomp  # libseccomp's Python binding (Debian: python3-seccomp)

    flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in _DENIED:
        try:
            flt.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            pass  # syscall unknown to this libseccomp/kernel
    flt.add_rule(eperm, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    # clone3 passes flags in memory, which seccomp cannot inspect: make libc fall back to clone().
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        flt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    flt.load()


def main():
    cfg = json.loads(sys.argv[1])
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    setup_worker(cfg)
    ready = {"ready": True, "pid": os.getpid(), "uid": os.getuid(), "seccomp": False, "error": None}
    try:
        if cfg["drop_uid"]:
            os.chmod(cfg["tmp_root"], 0o711)
        if cfg["seccomp"]:
            load_seccomp()
            ready["seccomp"] = True
    except ImportError as exc:
        ready["error"] = f"seccomp: {exc}"
    except Exception as exc:
        ready["error"] = f"setup: {type(exc).__name__}: {exc}"
    write_frame(ctl_out, ready)
    if ready["error"]:
        return 2
    worker = Worker(cfg)
    gc.freeze()  # keep the collector from touching (and so copying) the worker's pages in every child
    while True:
        req = read_frame(ctl_in, 1 << 30)
        if req is None:
            return 0
        try:
            resp = worker.handle(req)
        except Exception as exc:
            resp = {"status": "sandbox_error", "message": f"worker error: {type(exc).__name__}: {exc}"}
        write_frame(ctl_out, resp)


if __name__ == "__main__":
    sys.exit(main())
