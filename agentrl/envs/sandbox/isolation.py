"""How a pool worker is started: the bubblewrap command line (or none), and the checks that explain failures.

Two isolated modes, chosen from the host user:

- **root** (CI, servers): bubblewrap runs privileged without a user namespace. The worker keeps only
  CAP_SETUID/SETGID/KILL/CHOWN/FOWNER/DAC_OVERRIDE; every run drops to a non-root uid of its own
  (``uid_base + slot``), so RLIMIT_NPROC is enforced and the code cannot signal the worker.
- **non-root**: bubblewrap creates a user namespace (needs unprivileged user namespaces); the code runs as
  the invoking user, so it shares the worker's uid (a killed worker is restarted by the pool) and
  RLIMIT_NPROC counts all of that user's processes.

Both: new network (only ``lo``), pid, ipc, uts and cgroup namespaces; read-only ``/usr`` (plus the
merged-usr links); a size-capped tmpfs ``/tmp`` and ``/dev/shm``; fresh ``/proc`` and minimal ``/dev``;
empty environment; the worker dies with the pool.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from agentrl.envs.sandbox.base import SandboxUnavailable

WORKER_SOURCE = Path(__file__).with_name("_worker.py")
WORKER_PATH_INSIDE = "/opt/agentrl/sandbox_worker.py"
_ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap python3-seccomp`), or, for trusted code "
    "only, opt out of isolation explicitly with make_backend('unsafe_local')"
)


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
    drop_uid: bool,
    uid_base: int,
    limits: dict[str, int],
    output_cap: int,
    seccomp: bool,
    tmp_root: str,
    own_pid_namespace: bool,
) -> dict[str, Any]:
    """The JSON config the in-sandbox worker reads from argv (see ``_worker.py``)."""
    return {
        "drop_uid": drop_uid,
        "uid_base": uid_base,
        "limits": limits,
        "output_cap": output_cap,
        "seccomp": seccomp,
        "tmp_root": tmp_root,
        "own_pid_namespace": own_pid_namespace,
    }


def bwrap_command(
    python: str, config: dict[str, Any], *, as_root: bool, tmpfs_bytes: int, ro_binds: tuple[str, ...]
) -> list[str]:
    """The argv that starts one worker inside a fresh bubblewrap sandbox."""
    cmd = [bwrap_path(), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not as_root:
        cmd += ["--unshare-user", "--disable-userns"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_LINKS:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        cmd += ["--ro-bind-try", path, path]
    for path in ro_binds:
        cmd += ["--ro-bind", path, path]
    cmd += ["--dev", "/dev", "--proc", "/proc"]
    cmd += ["--perms", "0711", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp"]
    cmd += ["--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", "/dev/shm"]
    cmd += ["--ro-bind", str(WORKER_SOURCE), WORKER_PATH_INSIDE]
    cmd += ["--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"]
    cmd += ["--cap-drop", "ALL"]
    if as_root:
        for cap in _ROOT_CAPS:
            cmd += ["--cap-add", cap]
    cmd += [python, "-I", WORKER_PATH_INSIDE, json.dumps(config)]
    return cmd


def unisolated_command(python: str, config: dict[str, Any]) -> list[str]:
    """The argv that starts one worker directly on the host (no isolation at all)."""
    return [python, "-I", str(WORKER_SOURCE), json.dumps(config)]


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
