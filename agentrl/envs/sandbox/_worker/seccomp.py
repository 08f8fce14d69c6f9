"""The seccomp filters: the worker's own, and the code's addition to it."""

import ctypes
import errno
import marshal
import os

from .libc import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_SECCOMP,
    SECCOMP_MODE_FILTER,
    _check,
    _prctl,
    _sys_prctl,
)

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
SO_COOKIE, SO_NETNS_COOKIE = 57, 71
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
    merging (madvise MERGEABLE), reads that fail instead of waiting when a page is not cached (RWF_NOWAIT), and
    socket cookies (SO_COOKIE numbers every socket asked for one from a host-wide counter, exact enough that one
    execution asking for thousands moves what another's next cookie is; SO_NETNS_COOKIE counts network
    namespaces made on the host): ENOPROTOOPT, as a kernel without them."""
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
    for option in (SO_COOKIE, SO_NETNS_COOKIE):
        flt.add_rule(
            seccomp.ERRNO(errno.ENOPROTOOPT),
            "getsockopt",
            seccomp.Arg(1, seccomp.EQ, SOL_SOCKET),
            seccomp.Arg(2, seccomp.EQ, option),
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
