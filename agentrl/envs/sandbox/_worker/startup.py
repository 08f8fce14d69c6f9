"""The worker's setup, once before any code runs: namespaces, privileges, quotas, environment, limits."""

import os
import resource

from .execute import CODE_ENV, SOURCE, WORKDIR, _fresh_std_streams
from .libc import (
    CAP_SYS_ADMIN,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    PR_SET_KEEPCAPS,
    _check,
    _drop_bounding_set,
    _libc,
    _mount,
    _prctl,
    _set_capabilities,
    _unshare,
)
from .procs import _open_sysvipc


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
        if mode == "userns":
            # bubblewrap's --disable-userns leaves us in a nested user namespace that does not own the mount
            # namespace bubblewrap built (every mount call failed with EPERM): a copy of it that ours owns.
            _unshare(CLONE_NEWNS)
        for path in ("/", "/dev"):
            _mount("none", path, None, flags, None)
        _mount("none", "/dev/mqueue", None, flags | MS_NOEXEC, None)
        # Mounts no execution needs (every execution mounts its own /tmp and /dev/shm over these empty, read-only
        # directories; the worker's source is loaded): each one is copied into, and torn down with, every
        # execution's mount namespace. /dev/pts too: its ptys would be one pool for all executions, whose
        # numbers (the lowest free one is handed out) show what the others hold, so the code gets no pty.
        for path in ("/tmp", "/dev/shm", "/dev/pts", SOURCE):
            if mode == "root":
                _check(_libc.umount2(path.encode(), 0), f"umount {path}")
            else:  # userns: bubblewrap's mounts are locked in our copy (the kernel refuses to uncover what lies
                # under them), so each is covered by an empty read-only tmpfs instead (the source: its directory)
                cover = os.path.dirname(path) if path == SOURCE else path
                _mount("tmpfs", cover, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755")
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
