"""Thin wrappers of the libc calls the worker makes (namespaces, mounts, prctl, capabilities) and their constants."""

import ctypes
import os

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x40000000, 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 22, 2, 38
PR_SET_KEEPCAPS, CAP_SYS_ADMIN, MNT_DETACH = 8, 21, 2


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
