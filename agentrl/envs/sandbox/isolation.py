"""How a pool worker is started: the bubblewrap command line (or none), its config, and the checks that explain
failures.

Two isolated modes, chosen from the host user (see :mod:`._worker` for what happens inside):

- **root** (CI, servers): bubblewrap runs privileged without a user namespace and grants the worker only
  CAP_SETUID/SETGID/SYS_ADMIN (and SYS_RESOURCE where the host has it), which it needs once at startup: to mount
  a ``/proc`` of its own, size the per-uid quotas and move into a user namespace of its own, owned by and mapped
  to the unprivileged host uid ``uid_base``, where the code's uids (``uid_base + 1 ...``) map to themselves.
  Every run and session gets its own uid, pid, mount, IPC (and for sessions network) namespace, tmpfs and memory
  cgroup.
- **userns** (the pool runs as an ordinary user; needs unprivileged user namespaces): bubblewrap's user
  namespace maps one uid, so the code shares the worker's uid; the per-run namespaces and tmpfs still apply.

Both: new network (only ``lo``), pid, ipc, uts and cgroup namespaces; read-only ``/usr`` (plus the merged-usr
links); fresh ``/proc`` and minimal ``/dev``; the worker's source is copied in (no host path shows in
``/proc/self/mountinfo``); its config arrives on stdin (none on the command line, which other processes can
read); empty environment; the worker dies with the pool.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from agentrl.envs.sandbox.base import SandboxUnavailable

#: The worker's package (it runs inside the sandbox, see WORKER_BOOTSTRAP).
WORKER_PACKAGE = Path(__file__).with_name("_worker")
WORKER_PATH_INSIDE = "/opt/agentrl/sandbox_worker.zip"
#: Capabilities the worker starts with, by mode (it drops them for good before any code runs).
_WORKER_CAPS = {
    # CAP_SYS_RESOURCE: to size the per-uid quotas of the worker's user namespace (a host may not grant it)
    "root": ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE"),
    "userns": ("CAP_SYS_ADMIN", "CAP_SETPCAP"),
}
#: Size of the sandbox's own /tmp and /dev/shm, which no code ever sees (each execution mounts its own).
_SHARED_TMPFS_BYTES = 1 << 20
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: What of /etc the interpreter and its libraries need: the loader cache, the time zone, and Debian's alternatives
#: (numpy finds its BLAS through /etc/alternatives).
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")

#: What the sandbox's interpreter runs (``python -I -c BOOTSTRAP <worker source>``), where the source is the worker
#: package (:mod:`._worker`) as a zipapp (:func:`worker_zipapp`) or as a directory: compile its modules in a
#: short-lived child and run the compiled code here, each module served to the import system by a finder of the
#: compiled code, as the package ``sandbox_worker``. Compiling 80 kB of source leaves megabytes of fragmented heap
#: behind in the process that compiled it, and the worker forks a child per execution: every fork copies the page
#: tables of that heap, and every child unmaps it again. (Stdlib only; Python 3.8+.)
WORKER_BOOTSTRAP = """
import marshal, os, sys
path = sys.argv[1]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.close(r)
        if os.path.isdir(path):
            sources = {}
            for name in os.listdir(path):
                with open(os.path.join(path, name), "rb") as f:
                    sources[name] = f.read()
        else:
            import zipfile
            with zipfile.ZipFile(path) as z:
                sources = {name: z.read(name) for name in z.namelist()}
        data = marshal.dumps({
            name[:-3]: compile(source, path + "/" + name, "exec")
            for name, source in sources.items() if name.endswith(".py")
        })
        while data:
            data = data[os.write(w, data):]
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
os.close(w)
chunks = []
while True:
    chunk = os.read(r, 1 << 16)
    if not chunk:
        break
    chunks.append(chunk)
os.close(r)
if os.waitpid(pid, 0)[1] != 0:
    sys.exit("setup: could not compile the sandbox worker " + path)
codes = marshal.loads(b"".join(chunks))
del chunks, r, w, pid
from importlib.machinery import ModuleSpec


class Compiled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        package, _, module = name.partition(".")
        if package != "sandbox_worker" or (module or "__init__") not in codes:
            return None
        return ModuleSpec(name, Compiled, is_package=not module)

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        code = codes.pop(module.__name__.partition(".")[2] or "__init__")
        module.__file__ = code.co_filename
        exec(code, module.__dict__)


sys.meta_path.insert(0, Compiled)
sys.argv = [path]
from sandbox_worker.main import main
sys.exit(main())
"""

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap python3-seccomp`), or, for trusted code "
    "only, opt out of isolation explicitly with make_backend('unsafe_local')"
)


@functools.cache
def worker_zipapp() -> bytes:
    """The worker package's modules as one zip (stored, with fixed timestamps), which the sandbox gets as one file
    (bubblewrap copies it in from an fd, so no host path shows inside)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for path in sorted(WORKER_PACKAGE.glob("*.py")):
            z.writestr(zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0)), path.read_bytes())
    return buf.getvalue()


def worker_source_fd() -> int:
    """A new fd (a memfd, at offset 0) that holds :func:`worker_zipapp`, for ``bwrap_command(source_fd=)``."""
    fd = os.memfd_create("agentrl-sandbox-worker")
    try:
        data = memoryview(worker_zipapp())
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def bwrap_path() -> str:
    """Path of the ``bwrap`` binary. Raises SandboxUnavailable naming the fix if it is missing."""
    found = shutil.which("bwrap")
    if not found:
        raise SandboxUnavailable(
            f"bubblewrap (`bwrap`) is not on PATH, so code cannot be isolated; {INSTALL_HINT}"
        )
    return found


def check_interpreter(python: str, ro_binds: tuple[str, ...]) -> None:
    """The sandbox's interpreter must exist and be visible inside (under /usr or an extra read-only bind)."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise SandboxUnavailable(
            f"the sandbox interpreter {python!r} does not exist or is not executable; install it "
            "(Debian/Ubuntu: `apt-get install python3`) or pass python=<path to a system python3>"
        )
    real = os.path.realpath(python)
    visible = ("/usr/",) + tuple(b.rstrip("/") + "/" for b in ro_binds)
    if not real.startswith(visible):
        raise SandboxUnavailable(
            f"the sandbox interpreter {python!r} (resolving to {real!r}) lives outside /usr and the extra "
            "read-only binds, so the sandbox cannot see it; use a system python (/usr/bin/python3) or pass "
            "ro_binds=(<its prefix>,). It must also be readable by a non-root uid (not under /root)."
        )


def worker_config(
    *,
    mode: str,
    uid_base: int,
    n_uids: int,
    limits: dict[str, int],
    output_cap: int,
    seccomp: bool,
    tmpfs_bytes: int,
    tmpfs_inodes: int,
    cgroup: dict[str, int] | None,
    worker_bytes: int,
    reserved_bytes: int,
    max_sessions: int,
    quotas: dict[str, int],
    tmp_root: str = "",
) -> dict[str, Any]:
    """The config the in-sandbox worker reads as its first frame (see :mod:`._worker`).

    Args:
        mode: ``"root"``, ``"userns"`` or ``"none"`` (no isolation).
        uid_base: root mode: the host uid the worker maps to; code uses ``uid_base + 1 ... uid_base + n_uids``.
        limits: ``as_bytes`` (address space and the memory cgroup limit of one execution), ``nproc``,
            ``fsize_bytes``, ``nofile``.
        tmpfs_bytes, tmpfs_inodes: size and inode cap of each execution's ``/tmp`` and ``/dev/shm``.
        cgroup: ``{"fd": <fd of the worker's memory cgroup directory>, "version": 1 or 2}``, or None.
        worker_bytes: memory all of the worker's executions may hold together (its capacity).
        reserved_bytes: the share of it each live session, and the stateless runs, are guaranteed.
        max_sessions: live sessions the host may place on this worker.
        quotas: per-uid kernel quotas of one execution: ``msgqueue_bytes`` (POSIX queues), ``sigpending``
            (queued signals), ``memlock_bytes`` (locked memory).
        tmp_root: mode "none" only: the host directory under which executions get working directories.
    """
    return {
        "mode": mode,
        "uid_base": uid_base,
        "n_uids": n_uids,
        "limits": limits,
        "output_cap": output_cap,
        "seccomp": seccomp,
        "tmpfs_bytes": tmpfs_bytes,
        "tmpfs_inodes": tmpfs_inodes,
        "cgroup": cgroup,
        "worker_bytes": worker_bytes,
        "reserved_bytes": reserved_bytes,
        "max_sessions": max_sessions,
        "quotas": quotas,
        "tmp_root": tmp_root,
    }


def bwrap_command(python: str, *, mode: str, source_fd: int, ro_binds: tuple[str, ...]) -> list[str]:
    """The argv that starts one worker inside a fresh bubblewrap sandbox.

    ``source_fd``: an fd (inherited by bwrap) from which the worker's source is copied into the sandbox.
    """
    cmd = [bwrap_path(), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if mode == "userns":
        cmd += ["--unshare-user", "--disable-userns"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_LINKS:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    # /etc traversable by the code's uids (bubblewrap would make the parent of a bind 0700)
    cmd += ["--perms", "0755", "--dir", "/etc"]
    for path in _ETC_FILES:
        cmd += ["--ro-bind-try", path, path]
    for path in ro_binds:
        cmd += ["--ro-bind", path, path]
    cmd += ["--dev", "/dev", "--proc", "/proc"]
    cmd += ["--perms", "0755", "--size", str(_SHARED_TMPFS_BYTES), "--tmpfs", "/tmp"]
    cmd += ["--perms", "0755", "--size", str(_SHARED_TMPFS_BYTES), "--tmpfs", "/dev/shm"]
    cmd += ["--mqueue", "/dev/mqueue"]
    cmd += ["--ro-bind-data", str(source_fd), WORKER_PATH_INSIDE]
    # bubblewrap would otherwise start in the host's working directory where it exists inside (e.g. /tmp), which
    # then pins that mount: the worker could not unmount it.
    cmd += ["--chdir", "/"]
    cmd += ["--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"]
    # The dynamic linker resolves every symbol at startup, so no child of the worker resolves one lazily (a lookup
    # and a copy-on-write page for each; the worker clears its environment before any code runs).
    cmd += ["--setenv", "LD_BIND_NOW", "1"]
    cmd += ["--cap-drop", "ALL"]
    for cap in _WORKER_CAPS[mode]:
        cmd += ["--cap-add", cap]
    cmd += [python, "-I", "-c", WORKER_BOOTSTRAP, WORKER_PATH_INSIDE]
    return cmd


def unisolated_command(python: str) -> list[str]:
    """The argv that starts one worker directly on the host (no isolation at all)."""
    return [python, "-I", "-c", WORKER_BOOTSTRAP, str(WORKER_PACKAGE)]


def explain_start_failure(stderr: str, *, as_root: bool) -> str:
    """Turn a failed worker start (bwrap's or the worker's stderr) into a message with the cause and the fix."""
    text = stderr.strip() or "(no error output)"
    if "seccomp" in text and ("No module named" in text or "ModuleNotFound" in text):
        return (
            f"the sandbox interpreter cannot import libseccomp's Python binding ({text}); install it "
            "(Debian/Ubuntu: `apt-get install python3-seccomp`) or pass seccomp=False"
        )
    if "namespace" in text.lower() or "Operation not permitted" in text or "setting up uid map" in text:
        fix = (
            "run as root, or enable unprivileged user namespaces (`sysctl -w kernel.unprivileged_userns_clone=1`; "
            "on Ubuntu 24.04+ also `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`)"
            if not as_root
            else "in a container, grant it CAP_SYS_ADMIN (e.g. `docker run --privileged` or "
            "`--security-opt seccomp=unconfined --cap-add SYS_ADMIN`)"
        )
        return f"bubblewrap could not create the sandbox's namespaces: {text}. Fix: {fix}; {INSTALL_HINT}"
    return f"the sandbox worker failed to start: {text}"
