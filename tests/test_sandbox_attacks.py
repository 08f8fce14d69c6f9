"""Attacks on the local sandbox pool, one section per class of what the pool promises:

1. no process outlives its run: nothing of a run's uid exists afterwards, in any state, counted per thread;
   session code runs under a CPU limit; only a session's own kernel answers on its result channel;
2. availability: no sequence of runs and sessions takes the pool down (the random sequences are in
   ``test_sandbox_pool_states.py``);
3. fairness between sessions: reserved memory shares, admission control, a worker-level OOM reported as such,
   per-uid quotas that an idle session cannot hog;
4. kernel state shared between executions closed as a channel: pid namespaces, inotify, page-cache probing,
   file locks, global /proc files;
5. result integrity: the code cannot make its own failure look like the sandbox's, and a large legitimate
   request is not mistaken for a corrupted one.

Each attack runs as the code would, inside the sandbox; the checks look from the host where the code cannot.
After every test an autouse fixture checks that no task of any code uid is left on the host and that every
worker still answers.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.envs.sandbox import SandboxError, SyncSandbox

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

AS_ROOT = os.geteuid() == 0
if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install bubblewrap (apt-get install bubblewrap python3-seccomp)")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

WORKERS = 2
MEMORY_MB = 128  # so a worker holds 512 MiB and guarantees each session 64 MiB


@pytest.fixture(scope="module")
def sb():
    box = SyncSandbox(
        "local", workers=WORKERS, memory_mb=MEMORY_MB, max_processes=32, tmpfs_mb=200, output_limit_bytes=8192
    )
    yield box
    box.close()


def pool(sb):
    return sb._backend


def code_tasks(sb) -> list[str]:
    """Every task (thread) on the host, in any state, running as a uid the pool gives to code."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:  # by the owner of its /proc directory: its status file starts with a name the code chooses
                if os.stat(f"/proc/{pid}/task/{tid}").st_uid not in pool(sb).code_uids:
                    continue
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_bytes()
            except OSError:
                continue
            found.append(f"{pid}/{tid} {stat[stat.rindex(b')') + 2 :][:1].decode()}")
    return found


def wait_no_code_tasks(sb, within_s: float = 3.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := code_tasks(sb)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture(autouse=True)
def nothing_left_and_pool_serves(request):
    yield
    if "sb" not in request.fixturenames:
        return
    sb = request.getfixturevalue("sb")
    live = {s.worker for s in pool(sb)._sessions.values()}
    if AS_ROOT and not live:
        assert wait_no_code_tasks(sb) == []
    for i in range(2 * WORKERS):
        r = sb.run(f"print({i} * 3)", timeout_s=5)
        assert r.ok and r.stdout == f"{i * 3}\n", r


def on_worker(sb, index: int, code: str, **kw):
    """A stateless run on worker ``index`` (the others look busy for a moment)."""
    others = [w for w in pool(sb)._workers if w is not pool(sb)._workers[index]]
    for w in others:
        w.load += 1000
    try:
        return sb.run(code, **kw)
    finally:
        for w in others:
            w.load -= 1000


def session_on(sb, index: int) -> str:
    """A new session whose kernel lives on worker ``index``."""
    target = pool(sb)._workers[index]
    others = [w for w in pool(sb)._workers if w is not target]
    saved = {w: set(w.sessions) for w in others}
    for w in others:
        w.sessions.update(f"dummy{i}" for i in range(pool(sb).max_sessions_per_worker))
    try:
        sid = sb.create_session()
    finally:
        for w in others:
            w.sessions.intersection_update(
                saved[w] | {sid for sid in w.sessions if not sid.startswith("dummy")}
            )
    assert pool(sb)._sessions[sid].worker is target
    return sid


# ------------------------------------------------------------------ 1. no process outlives its run

#: A process whose main thread exits (SYS_exit, not exit_group) while another thread runs on: its /proc/<pid>
#: shows a zombie, yet it computes. ``{action}`` runs in that thread, forever.
ZOMBIE_LEADER = """
import ctypes, os, threading, time
if os.fork() == 0:
    os.setpgid(0, 0)  # a group of its own (the code may not make a session: setsid is refused)
    def loop():
        while True:
            {action}
    threading.Thread(target=loop).start()
    ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: only the main thread ends
time.sleep(0.2)
print("started")
"""


@pytest.mark.parametrize(
    "action", ["pass", "open('/tmp/alive', 'w').write(str(time.time())); time.sleep(0.01)"]
)
def test_zombie_leader_with_live_thread_dies_with_its_run(sb, action):
    r = on_worker(sb, 0, textwrap.dedent(ZOMBIE_LEADER.format(action=action)), timeout_s=5)
    assert r.ok and r.stdout == "started\n", r
    if AS_ROOT:
        assert wait_no_code_tasks(sb, 1.0) == []
    for _ in range(3):  # whatever uid the worker hands out next, its /tmp is fresh and no CPU is burned
        r = on_worker(
            sb, 0, "import os, time\nt = time.process_time(); time.sleep(0.05)\nprint(os.listdir('/tmp'))"
        )
        assert r.stdout == "[]\n", r
    assert pool(sb)._workers[0].last_health["health"]


def test_zombie_leader_in_a_session_dies_after_the_call_and_cannot_forge_later_answers(sb):
    """The thread keeps reading the session's request channel (fd 3) and answering on its result channel (fd 4)
    with a forged "all passed", echoing each request's nonce; it is killed when its call ends, so later calls
    get their own true answers."""
    forger = textwrap.indent(
        textwrap.dedent(
            """
            try:
                data = os.read(3, 1 << 16)
                nonce = __import__("json").loads(data[4:])["nonce"]
                body = ("S0 ok " + nonce).encode()
                os.write(4, __import__("struct").pack(">I", len(body)) + body)
            except Exception:
                time.sleep(0.001)
            """
        ),
        " " * 12,
    ).strip()
    sid = session_on(sb, 0)
    try:
        r = sb.run(textwrap.dedent(ZOMBIE_LEADER.format(action=forger)), session=sid, timeout_s=5)
        assert r.stdout == "started\n", r
        for i in range(5):
            r = sb.run(f"print('real {i}')\n{i} * 7", session=sid, timeout_s=5)
            assert (r.status, r.stdout, r.display) == ("ok", f"real {i}\n", str(i * 7)), r
    finally:
        sb.release_session(sid)


def test_session_leftovers_are_gone_when_it_is_released(sb):
    sid = session_on(sb, 1)
    try:
        assert sb.run(textwrap.dedent(ZOMBIE_LEADER.format(action="pass")), session=sid).ok
        assert sb.run("import subprocess\np = subprocess.Popen(['sleep', '1000'])", session=sid).ok
    finally:
        sb.release_session(sid)
    if AS_ROOT:
        assert wait_no_code_tasks(sb, 2.0) == []


def test_session_code_runs_under_a_cpu_limit(sb):
    """Each call of a session's kernel is bounded in CPU time (what it used so far plus the call's timeout), so
    threads left running in the kernel cannot burn CPU without end."""
    sid = session_on(sb, 0)
    try:
        code = "import resource, time\nused = time.process_time()\nsoft, hard = resource.getrlimit(resource.RLIMIT_CPU)\n(soft != resource.RLIM_INFINITY, soft - used <= 5 + 3, hard == resource.RLIM_INFINITY or hard >= soft)"
        for _ in range(2):
            r = sb.run(code, session=sid, timeout_s=5)
            assert r.display == "(True, True, True)", r
        burn = "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n    threading.Thread(target=spin, daemon=True).start()\nwhile True:\n    pass"
        r = sb.run(burn, session=sid, timeout_s=1)
        assert r.status == "timeout", r  # CPU or wall clock, whichever the box lets come first
        assert sb.run("1 + 1", session=sid).display == "2"  # a fresh kernel
    finally:
        sb.release_session(sid)


# ------------------------------------------------------------------ 2. availability (see also test_sandbox_pool_states.py)

SOCKET_CYCLE = """
import array, os, socket
# A ring of unix socket pairs, each holding the next pair (and 16 MiB of a memfd) in flight, with every fd
# closed: only the kernel's garbage collector frees them, in its own time (seconds on a busy machine).
fd = os.memfd_create("held")
os.write(fd, b"x" * (16 << 20))
pairs = [socket.socketpair() for _ in range(40)]
for i, (a, b) in enumerate(pairs):
    nxt = pairs[(i + 1) % len(pairs)]
    fds = [nxt[0].fileno(), nxt[1].fileno(), a.fileno(), b.fileno(), fd]
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
for a, b in pairs:
    a.close(); b.close()
os.close(fd)
print("left")
"""


def test_stateless_garbage_cannot_fail_the_health_of_a_worker_holding_a_session(sb):
    sid = session_on(sb, 0)
    try:
        assert sb.run("kept = 'state'", session=sid).ok
        worker = pool(sb)._workers[0]
        for _ in range(3):
            r = on_worker(sb, 0, textwrap.dedent(SOCKET_CYCLE))
            assert r.ok and r.stdout == "left\n", r
        states = sb._loop.run_until_complete(pool(sb).health())
        assert not worker.retired and worker.last_health["health"], states
        assert sb.run("kept", session=sid).display == "'state'"
    finally:
        sb.release_session(sid)


def test_retiring_never_depends_on_a_free_uid_block(sb):
    """Even with no uid block free, a retired worker leaves rotation at once and nothing raises; the pool is
    back to full strength as soon as a block is."""
    backend = pool(sb)
    worker = backend._workers[1]
    blocks, backend._free_blocks = backend._free_blocks, []
    try:
        backend._retire(worker, "forced by the test")
        assert worker not in backend._workers and worker.retired
        assert sb.run("print('served')").stdout == "served\n"
    finally:
        backend._free_blocks = blocks
    assert sb.run("print('again')").ok
    deadline = time.monotonic() + 10
    while (len(backend._workers) < WORKERS or backend._retiring) and time.monotonic() < deadline:
        sb._loop.run_until_complete(__import__("asyncio").sleep(0.05))
    assert len(backend._workers) == WORKERS and not backend._retiring


# ------------------------------------------------------------------ 3. fairness between sessions


@pytest.fixture
def fresh_sb():
    """A pool of its own, so that memory other tests left to the collector does not change the arithmetic."""
    box = SyncSandbox("local", workers=1, memory_mb=MEMORY_MB, max_processes=32, tmpfs_mb=200)
    yield box
    box.close()


PARK = "for i in range({mb}):\n    open(f'/dev/shm/p{{i}}', 'wb').write(b'p' * (1 << 20))\nprint('parked')"


def test_idle_sessions_parking_memory_cannot_starve_an_active_one(fresh_sb):
    """Idle sessions park files in their tmpfs until the worker is nearly full; an active session still gets at
    least its reserved share, by ending the idle session holding the most, which is told why."""
    sb = fresh_sb
    sb.run("pass")  # starts the pool (and its cgroups)
    backend = pool(sb)
    if not any(w.cgroup is not None for w in backend._workers):
        pytest.skip("no writable memory cgroup here (needs root and the cgroup memory controller)")
    parkers = [session_on(sb, 0) for _ in range(4)]
    active = session_on(sb, 0)
    try:
        for i, sid in enumerate(parkers):
            r = sb.run(PARK.format(mb=112 - i), session=sid, timeout_s=10)  # 4 x ~115 MiB of the worker's 512
            assert r.stdout == "parked\n", r
        r = sb.run(
            "x = bytearray(100 << 20)\nx[::4096] = b'1' * len(x[::4096])\nlen(x) >> 20", session=active
        )
        assert r.ok and r.display == "100", r
        r = sb.run("1", session=parkers[0])  # the largest idle one made room
        assert r.ok and "more than its guaranteed 64 MiB" in r.message, r
    finally:
        for sid in parkers + [active]:
            sb.release_session(sid)


def test_out_of_memory_because_of_other_sessions_is_reported_as_the_workers(fresh_sb):
    """Idle sessions hold most of the worker (each above its share, but leaving the active one more than its own),
    so the active one gets less than its 128 MiB: running out there is the worker's doing, and said so."""
    sb = fresh_sb
    sb.run("pass")  # starts the pool (and its cgroups)
    backend = pool(sb)
    if not any(w.cgroup is not None for w in backend._workers):
        pytest.skip("no writable memory cgroup here (needs root and the cgroup memory controller)")
    parkers = [session_on(sb, 0) for _ in range(4)]
    active = session_on(sb, 0)
    try:
        for sid in parkers:
            assert sb.run(PARK.format(mb=100), session=sid, timeout_s=10).ok
        hog = "x = bytearray(70 << 20)\nx[::4096] = b'1' * len(x[::4096])\ntime.sleep(2)\nos._exit(0)"
        r = sb.run(
            f"import os, time\npids = []\nfor _ in range(2):\n    pid = os.fork()\n    if pid == 0:\n{textwrap.indent(hog, '        ')}\n    pids.append(pid)\n[os.waitpid(p, 0)[1] for p in pids]",
            session=active,
            timeout_s=10,
        )
        assert "9" in r.display and "other executions held the rest" in r.message, r
        assert "memory limit of" not in r.message, r
    finally:
        for sid in parkers + [active]:
            sb.release_session(sid)


def test_sessions_beyond_the_pools_capacity_wait_then_are_refused_with_the_fix(sb):
    backend = pool(sb)
    sids = [sb.create_session() for _ in range(backend.max_sessions)]
    saved, backend.session_wait_s = backend.session_wait_s, 0.2
    try:
        with pytest.raises(SandboxError, match="pool is full.*within session_wait_s=0.2 s.*release_session"):
            sb.create_session()
    finally:
        backend.session_wait_s = saved
        for sid in sids:
            sb.release_session(sid)
    sb.release_session(sb.create_session())


MQ_HOG = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
made = 0
while True:
    q = libc.mq_open(f"/hog{made}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    if q < 0:
        break
    made += 1
print(made, ctypes.get_errno())
"""
MQ_ONE = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nq = libc.mq_open(b'/mine', os.O_CREAT | os.O_RDWR, 0o600, None)\nprint(q >= 0, ctypes.get_errno())"


@pytest.mark.skipif(not AS_ROOT, reason="per-execution quotas need per-execution uids (root)")
def test_an_idle_session_cannot_hog_the_posix_queue_quota(sb):
    hogs = [session_on(sb, 0) for _ in range(3)]
    other = session_on(sb, 0)
    try:
        for sid in hogs:
            r = sb.run(textwrap.dedent(MQ_HOG), session=sid)
            assert r.ok and int(r.stdout.split()[0]) >= 1, r  # each got its own share
        assert sb.run(MQ_ONE, session=other).stdout.startswith("True"), "another session was starved"
        assert on_worker(sb, 0, MQ_ONE).stdout.startswith("True"), "a stateless run was starved"
    finally:
        for sid in hogs + [other]:
            sb.release_session(sid)


# ------------------------------------------------------------------ 4. kernel state shared between executions


def test_every_execution_has_its_own_pid_namespace(sb):
    fork_many = "import os\nfor _ in range(40):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\nprint(os.getpid(), pid)"
    first = on_worker(sb, 0, fork_many)
    assert first.stdout == "1 41\n", first  # the pid counter starts afresh: nothing of earlier runs shows
    sid = session_on(sb, 0)
    try:
        assert sb.run(fork_many, session=sid).stdout == "2 42\n"  # pid 1 is the session's (hidden) init
        assert on_worker(sb, 0, fork_many).stdout == "1 41\n"
    finally:
        sb.release_session(sid)


def test_no_execution_can_address_another_sessions_processes(sb):
    """With hidden /proc entries alone, a pid still answers kill(pid, 0), sched_getparam and getpriority."""
    a = session_on(sb, 0)
    try:
        assert sb.run(
            "import os\nos.setpriority(os.PRIO_PROCESS, 0, 19)\nos.getpriority(os.PRIO_PROCESS, 0)", session=a
        ).ok
        probe = (
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(64)\n"
            "seen = [p for p in range(1, 4096) if p != os.getpid() and libc.sched_getparam(p, buf) == 0]\nprint(seen)"
        )
        assert on_worker(sb, 0, probe).stdout == "[]\n"
        b = session_on(sb, 0)
        try:
            r = sb.run(probe, session=b)
            assert r.stdout in ("[]\n", "[1]\n"), r  # at most its own init
        finally:
            sb.release_session(b)
    finally:
        sb.release_session(a)


SHARED_FILE = "/usr/lib/python3/dist-packages/README.txt"


def test_file_locks_on_shared_files_are_no_ops(sb):
    """A session holding an exclusive flock and a POSIX read lock on a shared read-only file: neither another
    execution nor the host sees any lock."""
    import fcntl

    target = next(p for p in ("/usr/lib/os-release", "/usr/bin/python3", SHARED_FILE) if os.path.exists(p))
    holder = session_on(sb, 0)
    try:
        code = f"import fcntl, struct\nf = open({target!r}, 'rb')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nfcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)\n'held'"
        assert sb.run(code, session=holder).display == "'held'"
        probe = f"import fcntl\nf = open({target!r}, 'rb')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('free')"
        assert on_worker(sb, 0, probe).stdout == "free\n"
        assert on_worker(sb, 1, probe).stdout == "free\n"
        with open(target, "rb") as f:  # the host
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        assert target not in Path("/proc/locks").read_text()
    finally:
        sb.release_session(holder)


CHANNEL_CALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
out["inotify"] = libc.inotify_init1(0) >= 0
fd = os.open("/usr/bin/python3", os.O_RDONLY)
out["dnotify"] = libc.fcntl(os.open("/usr/bin", os.O_RDONLY), 1026, 0x80000001) >= 0
try:
    os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
    out["rwf_nowait"] = True
except OSError as e:
    out["rwf_nowait"] = e.errno != errno.EOPNOTSUPP
libc.mmap.restype = ctypes.c_void_p
addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
out["mincore"] = libc.mincore(ctypes.c_void_p(addr), 4096, ctypes.create_string_buffer(1)) == 0
out["cachestat"] = libc.syscall(451, fd, None, None, 0) == 0 or ctypes.get_errno() != errno.EPERM
out["aio"] = libc.syscall(206, 1, ctypes.byref(ctypes.c_ulong(0))) == 0  # io_setup
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # accepted, and does nothing
out["proc"] = sorted(p for p in ("locks", "cmdline", "stat", "meminfo", "loadavg", "sysvipc") if os.path.exists("/proc/" + p))
print(out)
"""


def test_channels_through_shared_kernel_state_are_closed(sb):
    expected = {
        "inotify": False,
        "dnotify": False,
        "rwf_nowait": False,
        "mincore": False,
        "cachestat": False,
        "aio": False,
        "proc": [],
    }
    sid = session_on(sb, 1)
    try:
        for r in (
            on_worker(sb, 0, textwrap.dedent(CHANNEL_CALLS)),
            sb.run(textwrap.dedent(CHANNEL_CALLS), session=sid),
        ):
            assert r.ok and eval(r.stdout) == expected, r
    finally:
        sb.release_session(sid)


# ------------------------------------------------------------------ 5. result integrity


@pytest.mark.parametrize(
    "code, exit_code",
    [("import os\nos._exit(70)", 70), ("import os\nos._exit(71)", 71), ("import os\nos.close(3)", 0)],
)
def test_the_code_cannot_fake_a_sandbox_failure(sb, code, exit_code):
    r = sb.run(code)
    assert r.status != "sandbox_error" and r.exit_code == exit_code and "internally" not in r.message, r
    sid = sb.create_session()
    try:
        for cell in (code, "import os\nos.close(4)\n1"):
            r = sb.run(cell, session=sid)
            assert r.status != "sandbox_error" and "internally" not in r.message, r
    finally:
        sb.release_session(sid)


def test_a_request_fetching_many_paths_is_not_a_corrupted_channel(sb):
    paths = [f"some/long/directory/name/file-{i:05d}.txt" for i in range(60000)]  # the audit's 60k
    r = sb.run("open('some_file', 'w').write('x')", fetch_files=paths + ["some_file"], timeout_s=20)
    assert r.ok and r.files["some_file"] == "eA==" and r.files[paths[0]] is None, r.message


def test_lone_surrogates_leave_the_worker_as_valid_text(sb):
    sid = sb.create_session()
    try:
        r = sb.run(
            "class X:\n    def __repr__(self):\n        return '\\ud800'\nraise ValueError('bad \\udfff')",
            session=sid,
        )
        r.error["evalue"].encode("utf-8")
        r = sb.run("class X:\n    def __repr__(self):\n        return 'a\\ud800b'\nX()", session=sid)
        assert r.display == "a\\ud800b", r
    finally:
        sb.release_session(sid)
