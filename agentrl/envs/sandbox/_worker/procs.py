"""Helpers of the worker for processes, pipes and /proc, and the sandbox's own failures."""

import ctypes
import fcntl
import os
import select
import signal
import struct
import time

from .frames import _HEADER
from .libc import _sys_socketpair

#: The byte an execution's process writes on its status channel once its setup is done (before any code runs).
SETUP_DONE = b"\x01"


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


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
