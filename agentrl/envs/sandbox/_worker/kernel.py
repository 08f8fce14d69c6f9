"""A session's stateful kernel: the loop the code's long-lived process runs, and the worker's handle on it."""

import io
import os
import sys

from .execute import _fresh_std_streams, execute, fresh_main
from .frames import read_frame, write_result
from .procs import _close


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
