"""Isolation BETWEEN executions of the local sandbox pool: nothing one run or session writes may be
seen by any later run or session, on the same worker or another; resource accounting covers everything a run
can hold; health checks see what users see.

Every channel is tested as "write in run A, read in run B", for B on the same worker and on another, and for
live sessions against each other. After every test, an autouse fixture runs a probe in a fresh run that looks
at every channel the way code does, and reads each worker's own health check; both must be clean. The last
tests fake an escape from the host side (something left in a worker's shared namespaces) and check that the
health check notices it and replaces the worker without losing its live sessions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.envs.sandbox import SyncSandbox
from agentrl.envs.sandbox.cgroups import command_name, descendants

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

REPO = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0

if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install bubblewrap (apt-get install bubblewrap python3-seccomp)")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

MEMORY_MB = 256

#: What code can observe of every channel, printed as JSON: the probe of the autouse fixture.
PROBE = textwrap.dedent(
    """
    import ctypes, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    buf = ctypes.create_string_buffer(512)
    # SysV objects of this IPC namespace, by table index (*_STAT_ANY; /proc/sysvipc is not shown to code)
    stat_any = {"shm": (libc.shmctl, 15), "msg": (libc.msgctl, 13), "sem": (lambda i, c, b: libc.semctl(i, 0, c, b), 20)}
    out = {
        "sysv": {t: [i for i in range(64) if f(i, cmd, buf) >= 0] for t, (f, cmd) in stat_any.items()},
        "sysv_keys": [libc.shmget(0x5EC1, 0, 0), libc.msgget(0x5EC2, 0), libc.semget(0x5EC3, 0, 0)],
        "mq": libc.mq_open(b"/leakq", os.O_RDONLY),
        "sem": libc.sem_open(b"/leaksem", 0),
        "dev_shm": os.listdir("/dev/shm"),
        "tmp": os.listdir("/tmp"),
        "cwd": os.listdir("."),
        "unix": [l.split()[-1] for l in open("/proc/self/net/unix").read().splitlines()[1:] if len(l.split()) > 7],
        "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()),
    }
    print(json.dumps(out))
    """
)
CLEAN = {
    "sysv": {"shm": [], "msg": [], "sem": []},
    "sysv_keys": [-1, -1, -1],
    "mq": -1,
    "sem": None,
    "dev_shm": [],
    "tmp": [],
    "cwd": [],
    "unix": [],
    "procs": [],
}


@pytest.fixture(scope="module")
def sb():
    box = SyncSandbox(
        "local",
        workers=2,
        memory_mb=MEMORY_MB,
        max_processes=32,
        tmpfs_mb=64,
        tmpfs_files=4096,
        output_limit_bytes=16384,
    )
    yield box
    box.close()


def pool(sb):
    return sb._backend


def on_worker(sb, index: int, code: str, **kw):
    """A stateless run on worker ``index`` of the pool (the others look busy for a moment)."""
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
    others = [w for w in pool(sb)._workers if w is not pool(sb)._workers[index]]
    for w in others:
        w.sessions.update(f"dummy{i}" for i in range(10_000))
    try:
        sid = sb.create_session()
    finally:
        for w in others:
            w.sessions.difference_update(f"dummy{i}" for i in range(10_000))
    assert pool(sb)._sessions[sid].worker is pool(sb)._workers[index]
    return sid


def probe(sb, index: int) -> dict:
    r = on_worker(sb, index, PROBE, timeout_s=10)
    assert r.ok, r
    return json.loads(r.stdout)


def health(sb) -> list[dict]:
    return sb._loop.run_until_complete(pool(sb).health())


@pytest.fixture(autouse=True)
def clean_after(request):
    """After each attack on the shared pool: a fresh run on every worker sees nothing, and every worker's own
    check passed."""
    yield
    if "sb" not in request.fixturenames:
        return
    sb = request.getfixturevalue("sb")
    for index in range(pool(sb).num_workers):
        assert probe(sb, index) == CLEAN
    states = health(sb)
    assert all(s["last"].get("health") and not s["retired"] for s in states), states


def run(sb, code: str, **kw):
    kw.setdefault("timeout_s", 5.0)
    return sb.run(code, **kw)


# ------------------------------------------------------------------ writers, one per channel

WRITERS = {
    "sysv_shm": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        shmid = libc.shmget(0x5EC1, 4096, 0o1000 | 0o666)
        assert shmid >= 0, ctypes.get_errno()
        ctypes.memmove(libc.shmat(shmid, None, 0), b"SECRET-SHM", 10)
        """,
    "sysv_msg": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        q = libc.msgget(0x5EC2, 0o1000 | 0o666)
        assert q >= 0, ctypes.get_errno()
        msg = ctypes.create_string_buffer(b"\\x01\\0\\0\\0\\0\\0\\0\\0SECRET-MSG", 18)
        assert libc.msgsnd(q, msg, 10, 0) == 0, ctypes.get_errno()
        """,
    "sysv_sem": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.semget(0x5EC3, 1, 0o1000 | 0o666) >= 0, ctypes.get_errno()
        """,
    "posix_mq": """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        q = libc.mq_open(b"/leakq", os.O_CREAT | os.O_RDWR, 0o666, None)
        assert q >= 0, ctypes.get_errno()
        assert libc.mq_send(q, b"SECRET-MQ", 9, 0) == 0, ctypes.get_errno()
        """,
    "posix_sem": """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_open.restype = ctypes.c_void_p
        assert libc.sem_open(b"/leaksem", os.O_CREAT, 0o666, 7), ctypes.get_errno()
        """,
    "dev_shm_file": "open('/dev/shm/leak', 'w').write('SECRET-DEVSHM')",
    "tmp_file": "open('/tmp/leak', 'w').write('SECRET-TMP'); open('leak2', 'w').write('SECRET-CWD')",
    "abstract_socket_in_flight": """
        import array, socket
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(b"\\0leak-abstract")
        listener.listen(8)
        a, b = socket.socketpair()
        # send the listener (and the pair) over the pair, then drop every fd: only the kernel holds them now
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [listener.fileno(), a.fileno(), b.fileno()]))])
        listener.close(); a.close(); b.close()
        """,
    "detached_process": """
        import os, time
        if os.fork() == 0:
            os.setpgid(0, 0)
            if os.fork() == 0:
                open('/dev/shm/late', 'w').write('x')
                time.sleep(30)
            os._exit(0)
        time.sleep(0.05)
        """,
}

#: Code that looks for what each writer left, printing "" if nothing is there.
READERS = {
    "sysv_shm": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        found = [i for i in range(64) if libc.shmat(i, None, 0) not in (None, 2**64 - 1)]
        print(found or "", end="")
        """,
    "sysv_msg": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(64)
        found = [i for i in range(64) if libc.msgrcv(i, buf, 32, 0, 0o4000) >= 0]
        print(found or "", end="")
        """,
    "sysv_sem": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print([k for k in (0x5EC3,) if libc.semget(k, 0, 0) >= 0] or "", end="")
        """,
    "posix_mq": """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print("found" if libc.mq_open(b"/leakq", os.O_RDONLY) >= 0 else "", end="")
        """,
    "posix_sem": """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_open.restype = ctypes.c_void_p
        print("found" if libc.sem_open(b"/leaksem", 0) else "", end="")
        """,
    "dev_shm_file": "import os; print(os.listdir('/dev/shm') or '', end='')",
    "tmp_file": "import os; print((os.listdir('/tmp') + os.listdir('.')) or '', end='')",
    "abstract_socket_in_flight": """
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(b"\\0leak-abstract"); print("connected", end="")
        except OSError:
            names = [l.split()[-1] for l in open("/proc/self/net/unix").read().splitlines()[1:] if "leak" in l]
            print(names or "", end="")
        """,
    "detached_process": """
        import os, time
        time.sleep(0.1)
        print([p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()] or os.listdir('/dev/shm') or '', end='')
        """,
}


@pytest.mark.parametrize("channel", sorted(WRITERS))
@pytest.mark.parametrize("where", ["same_worker", "other_worker"])
def test_stateless_run_leaves_nothing_for_the_next(sb, channel, where):
    a = on_worker(sb, 0, textwrap.dedent(WRITERS[channel]))
    assert a.ok, a
    b = on_worker(sb, 0 if where == "same_worker" else 1, textwrap.dedent(READERS[channel]))
    assert b.ok and b.stdout == "", b


@pytest.mark.parametrize("channel", sorted(WRITERS))
def test_released_session_leaves_nothing_for_later_sessions_or_runs(sb, channel):
    a = session_on(sb, 0)
    try:
        r = sb.run(textwrap.dedent(WRITERS[channel]), session=a, timeout_s=5)
        assert r.ok, r
    finally:
        sb.release_session(a)
    b = session_on(sb, 0)
    try:
        r = sb.run(textwrap.dedent(READERS[channel]), session=b, timeout_s=5)
        assert r.ok and r.stdout == "", r
    finally:
        sb.release_session(b)
    r = on_worker(sb, 0, textwrap.dedent(READERS[channel]))
    assert r.ok and r.stdout == "", r


@pytest.mark.parametrize("channel", sorted(set(WRITERS) - {"detached_process"}))
def test_live_sessions_cannot_see_each_other(sb, channel):
    """A live session's objects are invisible to another live session and to stateless runs, on its worker."""
    a, b = session_on(sb, 0), session_on(sb, 0)
    try:
        r = sb.run(textwrap.dedent(WRITERS[channel]), session=a, timeout_s=5)
        assert r.ok, r
        for reader in (
            lambda code: sb.run(code, session=b, timeout_s=5),
            lambda code: on_worker(sb, 0, code),
        ):
            r = reader(textwrap.dedent(READERS[channel]))
            assert r.ok and r.stdout == "", r
    finally:
        sb.release_session(a)
        sb.release_session(b)


def test_live_session_abstract_listener_cannot_be_reached(sb):
    """A session listening on an abstract socket: no other execution can connect and hand it data or fds."""
    a, b = session_on(sb, 0), session_on(sb, 0)
    try:
        r = sb.run(
            "import socket\nL = socket.socket(socket.AF_UNIX)\nL.bind(b'\\0mailbox')\nL.listen(8)\nL.setblocking(False)",
            session=a,
        )
        assert r.ok, r
        connect = "import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(b'\\0mailbox'); s.send(b'from-outside'); print('CONNECTED')\nexcept OSError as e:\n    print('refused', e.errno)"
        assert sb.run(connect, session=b).stdout.startswith("refused")
        assert on_worker(sb, 0, connect).stdout.startswith("refused")
        assert on_worker(sb, 1, connect).stdout.startswith("refused")
        r = sb.run(
            "try:\n    L.accept(); print('GOT')\nexcept BlockingIOError:\n    print('nothing')", session=a
        )
        assert r.stdout == "nothing\n", r
    finally:
        sb.release_session(a)
        sb.release_session(b)


@pytest.mark.skipif(not AS_ROOT, reason="hiding processes between executions needs per-execution uids (root)")
def test_sessions_cannot_read_each_others_processes_cmdline_or_config(sb):
    a, b = session_on(sb, 0), session_on(sb, 0)
    try:
        code = "import ctypes, os\nctypes.CDLL(None).prctl(15, b'SECRETNAME', 0, 0, 0)\nopen('/proc/self/comm').read().strip(), os.getpid()"
        name, pid = eval(sb.run(code, session=a).display)
        assert name == "SECRETNAME"
        spy = textwrap.dedent(
            f"""
            import os
            seen = {{}}
            for p in os.listdir('/proc'):
                if p.isdigit():
                    for f in ('cmdline', 'comm', 'status', 'environ'):
                        try:
                            seen[p + f] = open(f'/proc/{{p}}/{{f}}', 'rb').read()
                        except OSError:
                            pass
            blob = b''.join(seen.values())
            print(sorted({{k[:-len(f)] for k in seen for f in ('cmdline',) if k.endswith(f)}}) == [str(os.getpid())],
                  b'SECRETNAME' in blob, b'uid_base' in blob, b'limits' in blob, os.getpid() in (1, {pid}))
            """
        )
        # every execution has a pid namespace of its own: the same pid numbers, none of the other's processes
        r = sb.run(spy, session=b)
        assert r.stdout == "True False False False True\n", r
        r = on_worker(sb, 0, spy)
        assert r.stdout == "True False False False True\n", r
    finally:
        sb.release_session(a)
        sb.release_session(b)


@pytest.mark.skipif(not AS_ROOT, reason="per-execution uids need root")
def test_every_run_gets_a_fresh_uid_and_a_uid_returns_only_when_clean(sb):
    uids = [int(on_worker(sb, 0, "import os; print(os.getuid())").stdout) for _ in range(6)]
    assert len(set(uids)) == 6, uids
    sid = session_on(sb, 0)
    try:
        suid = int(sb.run("import os; os.getuid()", session=sid).display)
        assert suid not in uids
    finally:
        sb.release_session(sid)
    worker = pool(sb)._workers[0]
    assert all(u in pool(sb).code_uids and u - worker.uid_base in range(1, 4096) for u in uids)


def test_capabilities_seccomp_and_no_host_paths(sb):
    code = textwrap.dedent(
        """
        status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
        print({k: status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')})
        print(open('/proc/self/mountinfo').read())
        print(open('/proc/1/cmdline', 'rb').read() if __import__('os').path.exists('/proc/1') else b'')
        """
    )
    for r in (run(sb, code), sb.run(code, session=(sid := sb.create_session()))):
        caps, mounts = r.stdout.split("\n", 1)
        assert eval(caps) == {
            "CapInh": "0000000000000000",
            "CapPrm": "0000000000000000",
            "CapEff": "0000000000000000",
            "CapBnd": "0000000000000000",
            "CapAmb": "0000000000000000",
            "NoNewPrivs": "1",
            "Seccomp": "2",
        }, r
        for host_path in (
            str(REPO),
            "/work/",
            "site-packages",
            "envs/sandbox/_worker",
            str(Path(sys.executable).parent),
        ):
            assert host_path not in mounts, (host_path, mounts)
    sb.release_session(sid)


def test_nothing_that_runs_share_is_writable(sb):
    """The sandbox's root, /dev and /dev/mqueue are shared by every stateless run of a worker: all read-only (a
    file in /dev/mqueue would also be a queue in the sandbox's IPC namespace, forcing its worker's replacement).
    A session's /dev/mqueue is its own and writable."""
    code = textwrap.dedent(
        """
        import errno
        for d in ("/", "/dev", "/dev/mqueue"):
            try:
                open(d.rstrip("/") + "/leak", "w"); print("created", d)
            except OSError as e:
                print(errno.errorcode[e.errno], d)
        """
    )
    for _ in range(2):  # both workers
        assert run(sb, code).stdout == "EROFS /\nEROFS /dev\nEROFS /dev/mqueue\n"
    sid = sb.create_session()
    try:
        r = sb.run(code + "import os; print(os.listdir('/dev/mqueue'))", session=sid)
        assert r.stdout.endswith("created /dev/mqueue\n['leak']\n"), r
    finally:
        sb.release_session(sid)


def test_code_is_the_oom_killers_first_choice(sb):
    """The worker is protected from the OOM killer (or at least not preferred); the code's processes, in runs and
    sessions alike, carry the highest score, so a host-wide OOM picks them, never the sandbox."""
    code = "print(open('/proc/self/oom_score_adj').read().strip())"
    sid = sb.create_session()
    try:
        for r in (run(sb, code), sb.run(code, session=sid)):
            assert r.stdout == "1000\n", r
    finally:
        sb.release_session(sid)


# ------------------------------------------------------------------ resource accounting


def needs_cgroup(sb):
    if not any(w.cgroup is not None for w in pool(sb)._workers):
        pytest.skip("no writable memory cgroup here (needs root and the cgroup memory controller)")


SHM_HOG = """
    import ctypes, mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    for key in range({n}):
        shmid = libc.shmget(0x7000 + key, {mb} << 20, 0o1000 | 0o600)
        assert shmid >= 0, ctypes.get_errno()
        addr = libc.shmat(shmid, None, 0)
        ctypes.memset(addr, 1, {mb} << 20)  # resident now
        libc.shmdt(ctypes.c_void_p(addr))  # detached, never removed: it outlives the process
    open('/dev/shm/hog', 'wb').write(b'x' * ({mb} << 19))
    print('held')
"""
FULL_MEMORY = "x = bytearray(200 << 20)\nx[::4096] = b'y' * len(x[::4096])\nprint(len(x) >> 20)"


def test_after_a_shared_memory_hog_the_next_run_gets_its_full_memory(sb):
    """Shared memory left by a run is freed with it; the next run on that worker can use its whole limit."""
    r = on_worker(sb, 0, textwrap.dedent(SHM_HOG.format(n=1, mb=100)), timeout_s=20)
    assert r.ok and r.stdout == "held\n", r
    for _ in range(2):
        r = on_worker(sb, 0, FULL_MEMORY, timeout_s=20)
        assert r.ok and r.stdout == "200\n", r


def test_shared_memory_counts_against_the_run_and_stays_inside_it(sb):
    """A run holding more shared memory than its limit is OOM-killed alone: a live session on the same worker
    keeps its state, and the next run gets its full memory."""
    needs_cgroup(sb)
    sid = session_on(sb, 0)
    try:
        assert sb.run("kept = 'state'", session=sid).ok
        r = on_worker(sb, 0, textwrap.dedent(SHM_HOG.format(n=4, mb=100)), timeout_s=20)
        assert r.status == "oom" and "memory limit" in r.message and "held" not in r.stdout, r
        assert sb.run("kept", session=sid).display == "'state'"
        r = on_worker(sb, 0, FULL_MEMORY, timeout_s=20)
        assert r.ok, r
    finally:
        sb.release_session(sid)


def test_session_filling_its_tmp_affects_only_itself(sb):
    a, b = session_on(sb, 0), session_on(sb, 0)
    try:
        fill = "import os\ni = 0\ntry:\n    while True:\n        open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20)); i += 1\nexcept OSError as e:\n    print('full', e.errno)"
        assert sb.run(fill, session=a, timeout_s=20).stdout == "full 28\n"  # ENOSPC
        write = "open('/tmp/mine', 'wb').write(b'y' * (8 << 20))\nprint('ok')"
        assert sb.run(write, session=b).stdout == "ok\n"
        assert on_worker(sb, 0, write).stdout == "ok\n"
        assert sb.run("len(os.listdir('/tmp')) > 10", session=a).display == "True"  # a still has its files
    finally:
        sb.release_session(a)
        sb.release_session(b)


INODE_FLOOD = """
    import os
    open('seed', 'w').close()
    n = 0
    try:
        while True:
            os.link('seed', f'l{n}'); n += 1
    except OSError as e:
        print('links', n, e.errno)
    m = 0
    try:
        while True:
            os.mkdir(f'/dev/shm/d{m}'); m += 1
    except OSError as e:
        print('dirs', m, e.errno)
"""


def test_inode_flood_is_bounded_and_the_next_run_meets_its_budget(sb):
    """Hard links and directories are capped per execution; removing them is charged to nobody's run; a live
    session on the same worker keeps its state."""
    sid = session_on(sb, 0)
    try:
        assert sb.run("kept = 41", session=sid).ok
        r = on_worker(sb, 0, textwrap.dedent(INODE_FLOOD), timeout_s=30)
        lines = r.stdout.split("\n")
        assert r.ok and lines[0].startswith("links") and lines[0].endswith(" 28"), r  # ENOSPC: out of inodes
        assert int(lines[0].split()[1]) < 4096 and int(lines[1].split()[1]) < 4096, r
        for _ in range(3):
            quick = on_worker(sb, 0, "print('quick')", timeout_s=1.0)
            assert quick.ok and quick.duration_s < 0.5, quick
        assert sb.run("kept + 1", session=sid).display == "42"
    finally:
        sb.release_session(sid)


@pytest.mark.slow
def test_inode_flood_at_default_limits_in_a_session_and_runs():
    """The same at the pool's default tmpfs limits, flooding from a session and from runs, many times."""
    with SyncSandbox("local", workers=1) as box:
        keeper = box.create_session()
        assert box.run("kept = 1", session=keeper).ok
        for _ in range(5):
            flooder = box.create_session()
            r = box.run(textwrap.dedent(INODE_FLOOD), session=flooder, timeout_s=60)
            assert r.ok and "links" in r.stdout, r
            box.release_session(flooder)
            r = box.run(textwrap.dedent(INODE_FLOOD), timeout_s=60)
            assert r.ok, r
            quick = box.run("print(1)", timeout_s=1.0)
            assert quick.ok and quick.duration_s < 0.5, quick
            assert box.run("kept", session=keeper).display == "1"
        assert all(s["last"]["health"] for s in box._loop.run_until_complete(box._backend.health()))


# ------------------------------------------------------------------ health checks notice escapes (faked from the host)


def _worker_pid(worker) -> int:
    """The host pid of the worker process itself: pid 1 of the worker's own pid namespace, which the process that
    bubblewrap started (its parent) made."""
    for pid in descendants(worker.proc.pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = status.split("NSpid:")[1].split("\n")[0].split()
        if command_name(pid) == "python3" and len(nspid) == 3 and nspid[-1] == "1":
            return pid
    raise AssertionError("no worker process found")


def _fake_escape_files(worker) -> None:
    """An escape that made the sandbox's own /dev/shm (an empty, read-only directory) writable and left a file."""
    script = "mount -t tmpfs none /dev/shm && echo x > /dev/shm/escaped"
    subprocess.run(
        ["nsenter", f"--mount=/proc/{_worker_pid(worker)}/ns/mnt", "/bin/sh", "-c", script], check=True
    )


def _fake_escape_sysv(worker) -> None:
    code = "import ctypes; assert ctypes.CDLL(None).shmget(0x4242, 4096, 0o1000 | 0o600) >= 0"
    subprocess.run(
        ["nsenter", f"--ipc=/proc/{_worker_pid(worker)}/ns/ipc", sys.executable, "-c", code], check=True
    )


def _fake_escape_mqueue(worker) -> None:
    """A POSIX message queue left in the sandbox's own IPC namespace (code only ever gets one of its own)."""
    code = "import ctypes, os; assert ctypes.CDLL(None).mq_open(b'/escaped', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0"
    subprocess.run(
        ["nsenter", f"--ipc=/proc/{_worker_pid(worker)}/ns/ipc", sys.executable, "-c", code], check=True
    )


def _holder(argv: list[str]) -> subprocess.Popen:
    """Start ``argv`` (a Python script that prints 'held' once it holds its object, then waits) and wait for it."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def _fake_escape_unix_socket(worker) -> subprocess.Popen:
    """A unix socket in the sandbox's network namespace, held by a process outside the sandbox (one the worker
    can neither see nor kill), as a listener that a stateless run could reach."""
    code = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(b'\\0escaped'); s.listen(1); print('held', flush=True); sys.stdin.readline()"
    return _holder(["nsenter", f"--net=/proc/{_worker_pid(worker)}/ns/net", sys.executable, "-c", code])


def _fake_escape_process(worker) -> subprocess.Popen:
    """A process in the sandbox's pid namespace that the worker cannot kill (it belongs to the host's root)."""
    code = "import sys; print('held', flush=True); sys.stdin.readline()"
    return _holder(["nsenter", f"--target={_worker_pid(worker)}", "--pid", sys.executable, "-c", code])


def _fake_escape_memory(worker):
    """A process outside the sandbox charging 160 MiB to the worker's run cgroup (memory a run never gave back),
    more than one reserved share (an eighth of the worker's 1 GiB): a little would only be set aside."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.stdin.readline(); x = bytearray(160 << 20); x[::4096] = b'1' * len(x[::4096]); print('held', flush=True); time.sleep(60)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    (worker.cgroup.path / "run" / "cgroup.procs").write_text(str(holder.pid))
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.stdout.readline() == "held\n"
    return holder


@pytest.mark.skipif(
    not AS_ROOT or shutil.which("nsenter") is None, reason="faking an escape needs root and nsenter"
)
@pytest.mark.parametrize("escape", ["files", "sysv", "mqueue", "unix_socket", "process", "memory"])
def test_health_check_notices_leftovers_and_replaces_the_worker_keeping_its_sessions(escape):
    with SyncSandbox("local", workers=1, memory_mb=MEMORY_MB) as box:
        backend = box._backend
        sid = box.create_session()  # starts the pool
        worker = backend._workers[0]
        if escape == "memory" and worker.cgroup is None:
            pytest.skip("no memory cgroup here")
        assert box.run("kept = 'alive'", session=sid).ok
        holder = {
            "files": _fake_escape_files,
            "sysv": _fake_escape_sysv,
            "mqueue": _fake_escape_mqueue,
            "unix_socket": _fake_escape_unix_socket,
            "process": _fake_escape_process,
            "memory": _fake_escape_memory,
        }[escape](worker)
        try:
            assert box.run("print(1)").ok  # the request after which the worker checks itself
            states = box._loop.run_until_complete(backend.health())
            old = next(s for s in states if s["index"] == worker.index)
            assert old["retired"] and not old["last"]["health"] and old["sessions"] == 1, states
            assert backend._workers[0] is not worker  # a fresh worker took its place
            assert box.run("kept", session=sid).display == "'alive'"  # the live session was not lost
            r = box.run(PROBE, timeout_s=10)
            assert r.ok and json.loads(r.stdout) == CLEAN, r
            box.release_session(sid)
            deadline = time.monotonic() + 10
            while worker.alive and time.monotonic() < deadline:
                box._loop.run_until_complete(__import__("asyncio").sleep(0.05))
            assert not worker.alive  # retired and stopped once its last session was released
        finally:
            if holder is not None:
                holder.stdin.close()  # a holder that waits on stdin ends (with its child under nsenter)
                holder.kill()
                holder.wait()
