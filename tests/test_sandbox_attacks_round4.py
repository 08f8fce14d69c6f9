"""Attacks on the local sandbox pool, round 4: CPU shares per execution in a CPU cgroup of its own, the userns
mode, the worker's own CPU kill, and an independent re-audit built for the classes of earlier findings (fields
the code controls, waits counted as work, shared kernel counters, covert channels, resource exhaustion of the
host-side pool).

Each attack runs as the code would, inside the sandbox; the checks look from the host where the code cannot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.envs.sandbox.cgroups import _own_cpu_cgroup

pytestmark = pytest.mark.sandbox_attacks

AS_ROOT = os.geteuid() == 0
if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install bubblewrap (apt-get install bubblewrap python3-seccomp)")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, timeout: float = 120.0) -> dict:
    """Run ``script`` in a fresh interpreter of this venv, from this tree's root (``-c`` puts the working directory
    first on the path, before PYTHONPATH); return its last line, JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ 1. CPU shares in a CPU cgroup of its own

#: In a CPU cgroup of its own (``argv[1]``, as in a container), on one CPU, two sessions on two workers run at once over the
#: same wall-clock window: one forks 8 busy processes (no new session: setsid is refused), the other busy-loops
#: alone. Prints the CPU seconds each execution got in the window.
CONTAINER_CPU = """
import asyncio, json, os, sys, time
from pathlib import Path
from agentrl.envs.sandbox.local import LocalSandbox

container = Path(sys.argv[1])
(container / "cgroup.procs").write_text(str(os.getpid()))
# One CPU for all (inherited): a single run queue, where the scheduler splits the group's time exactly by
# weight whatever else loads the machine.
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
MANY = '''
import os, time
start, end = {start!r}, {end!r}
early = time.time() < start
pids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        while time.time() < start:
            time.sleep(0.005)
        while time.time() < end:
            pass
        os._exit(0)
    pids.append(pid)
cpu = 0.0
for pid in pids:
    usage = os.wait4(pid, 0)[2]
    cpu += usage.ru_utime + usage.ru_stime
print(early, cpu)
'''
ONE = '''
import time
start, end = {start!r}, {end!r}
early = time.time() < start
while time.time() < start:
    time.sleep(0.005)
t0 = time.process_time()
while time.time() < end:
    pass
print(early, time.process_time() - t0)
'''

async def main():
    async with LocalSandbox(workers=2, memory_mb=128, max_processes=32) as sb:
        s1, s2 = await sb.create_session(), await sb.create_session()
        assert sb._sessions[s1].worker is not sb._sessions[s2].worker
        for s in (s1, s2):  # start both kernels first
            assert (await sb.run("1", session=s, timeout_s=10)).ok
        start = time.time() + 1.0
        end = start + 4.0
        many, one = await asyncio.gather(
            sb.run(MANY.format(start=start, end=end), session=s1, timeout_s=20),
            sb.run(ONE.format(start=start, end=end), session=s2, timeout_s=20),
        )
    assert many.ok and one.ok, (many, one)
    (m_early, m_cpu), (o_early, o_cpu) = many.stdout.split(), one.stdout.split()
    return {"concurrent": m_early == o_early == "True", "many_cpu_s": float(m_cpu), "one_cpu_s": float(o_cpu)}

try:
    print(json.dumps(asyncio.run(main())))
finally:
    (container.parent / "cgroup.procs").write_text(str(os.getpid()))
"""


def test_an_execution_with_many_processes_gets_one_cpu_share_in_a_cpu_cgroup_of_its_own(tmp_path):
    """MEDIUM (issue 35): CPU shares must follow the execution, not the process. Scheduler autogroups group an
    execution's processes only in the root CPU cgroup; in a container with a CPU cgroup of its own every process
    had a share, so 8 busy processes of one execution got 8/9 of the CPU against a single-process execution
    (ratio about 0.12). Each worker now runs in a CPU cgroup of its own, one share per running execution."""
    own = _own_cpu_cgroup()
    if not AS_ROOT or own is None:
        pytest.skip("needs root and a writable CPU cgroup (to stand in for a container's)")
    container = own / f"agentrl-test-container-{os.getpid()}"
    container.mkdir()
    try:
        r = run_script(CONTAINER_CPU, str(container))
    finally:
        for _ in range(200):  # the pool's own cgroups inside are removed as its workers exit
            try:
                container.rmdir()
                break
            except OSError:
                time.sleep(0.02)
    assert r["concurrent"], r
    assert r["one_cpu_s"] >= 0.5 * r["many_cpu_s"], r


# ------------------------------------------------------------------ 2. the worker's own CPU kill

#: A session kernel's code that dodges the kernel's CPU limit: it ignores SIGXCPU (``ignore``), or keeps raising
#: its own soft limit to the hard one (``raise``), and burns CPU forever.
DODGE_CPU_LIMIT = {
    "ignore": "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
    "raise": (
        "import resource\nR = resource.RLIMIT_CPU\n"
        "while True:\n    resource.setrlimit(R, (resource.getrlimit(R)[1],) * 2)\n"
    ),
}


@pytest.mark.parametrize("dodge", sorted(DODGE_CPU_LIMIT))
def test_the_worker_kills_a_kernel_that_dodges_its_cpu_limit_once_past_soft_plus_one(dodge):
    """Issue 35 (untested until now): only the soft RLIMIT_CPU of a session's kernel is set (a lowered hard limit
    could never be raised for a later call), so code that ignores SIGXCPU or raises its own soft limit is killed
    by the worker itself once it passes the soft limit by a second. Here the worker's own code runs in this
    process (the same ``set_cpu_limit`` and ``collect`` as ``run_in_kernel``) against a real process with a wall
    deadline far beyond its CPU limit, so reaching the kill does not depend on the machine's load (through the
    pool it needs more CPU-seconds than the call's wall time, which 2 busy cores rarely give); without the kill
    the call would end at the wall deadline, 600 s later."""
    import types

    from agentrl.envs.sandbox._worker.procs import SETUP_DONE
    from agentrl.envs.sandbox._worker.worker import Worker

    limits = {"nofile": 256, "nproc": 64, "as_bytes": 1 << 30}
    cfg = {"output_cap": 4096, "mode": "none", "limits": limits, "tmpfs_bytes": 1 << 20, "tmpfs_inodes": 64}
    worker = Worker({**cfg, "worker_bytes": 1 << 30, "reserved_bytes": 1 << 27}, None, None)
    # The worker first looks at the kernel's CPU time when it could have used it all with every CPU busy; told
    # of many CPUs, it looks every _CPU_CHECK_MIN_S from the start, as it would near the end of a real call.
    worker.cpus = 10_000
    proc = subprocess.Popen(
        [sys.executable, "-c", DODGE_CPU_LIMIT[dodge]], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    res_r, res_w = os.pipe()  # the kernel's result channel: it never answers
    pidfd = os.pidfd_open(proc.pid)
    try:
        kernel = types.SimpleNamespace(pid=proc.pid, cpu_limit=None)
        worker.set_cpu_limit(kernel, timeout=1)  # soft: what it used so far + 1 + 2 CPU-s

        def stop(col, _exited):
            proc.kill()
            return os.waitpid(proc.pid, 0)[1]

        procs = (proc.pid, pidfd, proc.stdout.fileno(), proc.stderr.fileno(), res_r)
        col = worker.collect(
            procs, time.monotonic() + 600, (), stop, one_shot=False, cpu_cap=kernel.cpu_limit + 1
        )
    finally:
        proc.kill()
        proc.wait()
        for fd in (res_r, res_w, pidfd):
            os.close(fd)
    assert col["over_cpu"] and not col["timed_out"], col
    assert col["cpu_s"] >= kernel.cpu_limit + 1, col
    reply = worker.finish(
        {**col, "setup": SETUP_DONE, "cpu_limit_s": kernel.cpu_limit}, 0.0, 1, 1 << 30, None, True
    )
    assert reply["status"] == "timeout" and reply["event"] == {"kind": "cpu_limit"}, reply


# ------------------------------------------------------------------ 3. the userns mode

#: The pool as an ordinary user (``argv[1]``: the uid to drop to, or -1 to stay; modules are imported first, as
#: the interpreter's own files may not be readable by that uid). Prints what runs and a session saw.
USERNS_POOL = """
import asyncio, json, os, shutil, subprocess, sys
import asyncio.subprocess, base64, logging, secrets, tempfile, uuid, zipfile  # noqa: F401 (before the uid drop)
from agentrl.envs.sandbox.local import LocalSandbox

uid = int(sys.argv[1])
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
os.chdir("/")
probe = subprocess.run([shutil.which("bwrap"), "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True)
if probe.returncode:
    print(json.dumps({"skip": probe.stderr.decode(errors="replace").strip()}))
    sys.exit(0)
RUN = '''
import json, os, socket
out = {"uid": os.getuid(), "pid": os.getpid(), "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
for name, call in [("inet", lambda: socket.socket(socket.AF_INET)), ("setsid", os.setsid), ("pty", os.openpty),
                   ("usr", lambda: open("/usr/agentrl-probe", "w")), ("root", lambda: open("/probe", "w"))]:
    try:
        call()
        out[name] = "allowed"
    except OSError as exc:
        out[name] = type(exc).__name__
out["tmp_before"] = sorted(os.listdir("/tmp"))
open("/tmp/mark", "w").write("x")
out["source_visible"] = os.path.exists("/opt/agentrl/sandbox_worker.zip")
print(json.dumps(out))
'''
STRAY = '''
import os, time
x = 41
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.write(w, b"up")
    while True:
        time.sleep(0.01)
os.read(r, 2)
'''
LATER = '''
def state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
print(x + 1, state(child) in ("Z", "gone"))
'''

async def main():
    async with LocalSandbox(workers=1, memory_mb=128) as sb:
        runs = [await sb.run(RUN, timeout_s=10) for _ in range(2)]
        sid = await sb.create_session()
        await sb.run(STRAY, session=sid, timeout_s=5)
        later = await sb.run(LATER, session=sid, timeout_s=5)
        return {
            "mode": sb._settings.mode,
            "runs": [json.loads(r.stdout) if r.ok else repr(r) for r in runs],
            "session": later.stdout if later.ok else repr(later),
        }

print(json.dumps(asyncio.run(main())))
"""


def test_the_userns_mode_isolates_as_the_root_mode_does_where_it_can():
    """Issue 35: the userns mode (a pool run by an ordinary user) had never run here: it failed at startup on this
    kernel (bubblewrap's --disable-userns leaves the worker in a user namespace that does not own its mount
    namespace: every mount failed with EPERM, then unmounting bubblewrap's locked mounts with EINVAL). Run as an
    unprivileged uid: each run is pid 1 of its own pid namespace, sees only its own processes and its own /tmp,
    cannot write the system, make a session, a pty or a network socket, and a session keeps its state while its
    stray processes are killed after each call."""
    r = run_script(USERNS_POOL, str(65534 if AS_ROOT else -1))
    if "skip" in r:
        pytest.skip(f"unprivileged user namespaces are not available here: {r['skip']}")
    assert r["mode"] == "userns", r
    expected_uid = 65534 if AS_ROOT else os.geteuid()
    for run in r["runs"]:
        assert isinstance(run, dict), r
        assert run["uid"] == expected_uid and run["pid"] == 1 and run["procs"] == [1], run
        assert run["tmp_before"] == [] and not run["source_visible"], run
        for call in ("inet", "setsid", "pty", "usr", "root"):
            assert run[call] != "allowed", (call, run)
    assert r["session"] == "42 True\n", r


# ------------------------------------------------------------------ 4. re-audit: shared counters, fields the code controls

WORKERS = 2


@pytest.fixture(scope="module")
def sb():
    from agentrl.envs.sandbox import SyncSandbox

    box = SyncSandbox("local", workers=WORKERS, memory_mb=128, max_processes=32, tmpfs_mb=64)
    yield box
    box.close()


@pytest.fixture(autouse=True)
def pool_serves(request):
    yield
    if "sb" not in request.fixturenames:
        return
    sb = request.getfixturevalue("sb")
    for i in range(2 * WORKERS):
        r = sb.run(f"print({i} * 3)", timeout_s=5)
        assert r.ok and r.stdout == f"{i * 3}\n", r


#: Asks for ``{n}`` socket cookies and prints the first and last (or why it could not).
SOCKET_COOKIES = """
import socket, struct
def cookie(option):
    s = socket.socket(socket.AF_UNIX)
    try:
        return struct.unpack("Q", s.getsockopt(socket.SOL_SOCKET, option, 8))[0]
    except OSError as exc:
        return exc.strerror
    finally:
        s.close()
cookies = [cookie(57) for _ in range({n})]  # SO_COOKIE
print(cookies[0], cookies[-1], cookie(71))  # SO_NETNS_COOKIE
"""


@pytest.mark.parametrize("where", ["stateless", "session"])
def test_socket_cookies_are_no_counter_shared_between_executions(sb, where):
    """NEW (round 4): SO_COOKIE numbers each socket that asks from one host-wide counter. One run asking for 3000
    cookies moved the next run's first cookie by 3000 (run 1: 3 -> 3004, run 2 began at 3005): an exact channel
    between any two executions, successive or concurrent, far quieter than pipe inode numbers (the host rarely
    asks for cookies). SO_NETNS_COOKIE likewise counts the network namespaces made on the host. Both are now
    refused (ENOPROTOOPT, as a kernel without them)."""
    sid = sb.create_session() if where == "session" else None
    try:
        for _ in range(2):
            r = sb.run(textwrap.dedent(SOCKET_COOKIES.format(n=3000)), session=sid, timeout_s=10)
            assert r.ok, r
            assert r.stdout == "Protocol not available Protocol not available Protocol not available\n", r
    finally:
        if sid is not None:
            sb.release_session(sid)


#: Prints the execution's memory cgroup as /proc/self/cgroup shows it.
OWN_CGROUP = (
    "print([l for l in open('/proc/self/cgroup').read().split() if ':memory:' in l][0].split(':', 2)[2])"
)


def test_cgroup_names_count_nothing(sb):
    """NEW (round 4): /proc/self/cgroup shows an execution its memory cgroup's name. It was ``s<uid>-<n>`` with n
    the worker's count of sessions made (how many sessions other tenants opened), and ``run<n>`` with n how often
    earlier stateless runs left memory behind (a run may choose to: one bit from one run to a later one). Names
    are now random."""
    if not AS_ROOT:
        pytest.skip("memory cgroups need root")
    names = []
    for _ in range(3):
        sid = sb.create_session()
        try:
            names.append(sb.run(OWN_CGROUP, session=sid, timeout_s=5).stdout.strip())
        finally:
            sb.release_session(sid)
    run = sb.run(OWN_CGROUP, timeout_s=5).stdout.strip()
    assert all(re.fullmatch(r"/\.\./s\d+-[0-9a-f]{12}", n) for n in names), names
    assert run == "/../run" or re.fullmatch(r"/\.\./run-[0-9a-f]{12}", run), run  # (the first one is "run")


#: A stray whose main thread exits while its other thread runs on, every thread named like the fields of
#: /proc/<pid>/stat that follow the name (a state, then numbers): a parser that splits at the first ")" reads
#: the state "Z" (dead) for a live thread.
FORGED_STAT_NAMES = """
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
name = b"x) Z 1 1 1 (y"
if os.fork() == 0:
    os.setpgid(0, 0)
    def loop():
        libc.prctl(15, name, 0, 0, 0)
        while True:
            open("/tmp/alive", "w").write(str(time.time()))
            time.sleep(0.01)
    threading.Thread(target=loop).start()
    libc.prctl(15, name, 0, 0, 0)
    libc.syscall(60, 0)  # SYS_exit: only the main thread ends
time.sleep(0.2)
print("started")
"""

#: In the same session, later: whether /tmp/alive still changes, and every other process's thread states.
STILL_ALIVE = """
import os, time
before = open("/tmp/alive").read()
time.sleep(0.3)
states = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
print(open("/tmp/alive").read() != before, sorted(set(states)))
"""


def test_a_stray_whose_threads_are_named_like_stat_fields_dies_after_its_call(sb):
    """NEW (round 4), the class "fields the code controls": every thread's name appears in /proc/<pid>/stat
    before its state, and the name may hold ") Z 1 1 1 (". A stray whose main thread exited (its process shows
    Z) and whose live thread carries such a name must still be found alive and killed after the call."""
    sid = sb.create_session()
    try:
        r = sb.run(textwrap.dedent(FORGED_STAT_NAMES), session=sid, timeout_s=5)
        assert r.ok and r.stdout == "started\n", r
        r = sb.run(textwrap.dedent(STILL_ALIVE), session=sid, timeout_s=5)
        assert r.ok and r.stdout in ("False []\n", "False ['Z']\n"), r
    finally:
        sb.release_session(sid)
