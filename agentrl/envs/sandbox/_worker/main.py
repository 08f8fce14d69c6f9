"""The worker's entry point: read the config, set up, answer requests until the host closes stdin."""

import gc
import os
import select

from .cgroups import Cgroups
from .frames import read_frame, write_frame
from .procs import _internal_reply
from .seccomp import load_seccomp
from .startup import setup_worker
from .worker import _IDLE_CHECK_S, Worker


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
