"""Adversarial suite for the local sandbox pool: hostile code must be contained, and the pool must keep serving.

Every test sends one attack, asserts the contained outcome, then (autouse fixture) checks that the pool still
answers correctly and promptly on every worker and that no process of the code's uids is left on the host.
No test needs the network: the "public" addresses are never reached because the sandbox has no route.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from agentrl.envs.sandbox import SyncSandbox

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

REPO = Path(__file__).resolve().parents[1]
WORKERS = 2

if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install bubblewrap (apt-get install bubblewrap python3-seccomp)")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

AS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def sb():
    os.environ["AGENTRL_TEST_SECRET"] = "hunter2-secret-value"
    box = SyncSandbox(
        "local",
        workers=WORKERS,
        memory_mb=256,
        max_processes=32,
        max_file_mb=8,
        max_open_files=64,
        tmpfs_mb=16,
        output_limit_bytes=8192,
    )
    yield box
    box.close()
    os.environ.pop("AGENTRL_TEST_SECRET", None)


def code_uid_processes(uids: range) -> list[int]:
    """Host pids (zombies included: they must be reaped) running as one of ``uids`` (root mode only)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:  # the owner of its /proc directory: its status file starts with a name the code chooses
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        if uid in uids:
            found.append(int(name))
    return found


@pytest.fixture(autouse=True)
def pool_still_healthy(sb):
    yield
    if AS_ROOT:
        uids = sb._backend.code_uids
        deadline = time.monotonic() + 2.0
        while code_uid_processes(uids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = code_uid_processes(uids)
        assert left == [], [Path(f"/proc/{p}/status").read_bytes()[:400] for p in left]
    for i in range(2 * WORKERS):
        r = sb.run(f"print(sum(range({i + 10})))", timeout_s=5)
        assert r.status == "ok", r
        assert r.stdout == f"{sum(range(i + 10))}\n"
        assert r.duration_s < 2.0, f"pool slowed down after the attack: {r.duration_s:.3f}s"


def run(sb, code, **kw):
    kw.setdefault("timeout_s", 2.0)
    return sb.run(code, **kw)


# ------------------------------------------------------------------ resource exhaustion


def test_fork_bomb(sb):
    r = run(
        sb,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        timeout_s=1.0,
    )
    assert r.status == "timeout"


@pytest.mark.smoke
def test_fork_bomb_hits_process_limit(sb):
    code = "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(60)\n        n += 1\nexcept OSError as e:\n    print('limited', n, e.errno)"
    r = run(sb, code)
    assert r.status == "ok", r
    assert r.stdout.startswith("limited"), r
    assert int(r.stdout.split()[1]) < 32


def test_thread_bomb(sb):
    code = "import threading, time\nn = 0\ntry:\n    while True:\n        threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); n += 1\nexcept RuntimeError as e:\n    print('limited', n)"
    r = run(sb, code)
    assert r.stdout.startswith("limited"), r
    assert int(r.stdout.split()[1]) < 32


@pytest.mark.smoke
def test_memory_hog_single_allocation(sb):
    r = run(sb, "x = bytearray(4 * 1024**3)")
    assert r.status == "oom", r
    assert "MemoryError" in r.stderr


def test_memory_hog_gradual(sb):
    r = run(sb, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))", timeout_s=10)
    assert r.status == "oom", r


def test_memory_hog_across_processes_hits_the_worker_cap(sb):
    """RLIMIT_AS bounds one process; the worker's memory cgroup bounds them all together."""
    code = "import os, time\npids = []\nfor i in range(8):\n    pid = os.fork()\n    if pid == 0:\n        x = bytearray(200 * 1024**2)\n        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\nprint([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])"
    r = run(sb, code, timeout_s=10)
    groups = [w.cgroup for w in sb._backend._workers if w.cgroup is not None]
    if not groups:
        pytest.skip("no writable memory cgroup here (needs root and the cgroup memory controller)")
    assert r.status == "ok" and "-9" in r.stdout, r  # the OOM killer ended some children, inside the sandbox
    for group in groups:
        if group.version == 1:
            peak = int((group.path / "memory.max_usage_in_bytes").read_text())
            assert peak <= 1024 * 1024**2  # 4 x memory_mb


@pytest.mark.smoke
def test_cpu_loop(sb):
    r = run(sb, "while True:\n    pass", timeout_s=0.5)
    assert r.status == "timeout" and r.exit_code is None
    assert 0.5 <= r.duration_s < 1.5


def test_sleep_forever(sb):
    r = run(sb, "import time\ntime.sleep(10**6)", timeout_s=0.5)
    assert r.status == "timeout"


def test_deep_recursion(sb):
    r = run(sb, "def f(n):\n    return f(n + 1)\nf(0)")
    assert r.status == "error" and "RecursionError" in r.stderr, r


def test_c_stack_overflow(sb):
    code = "import sys\nsys.setrecursionlimit(10**8)\nx = []\nfor _ in range(10**6):\n    x = [x]\nrepr(x)"
    r = run(sb, code, timeout_s=5)
    assert r.status == "killed" and r.exit_code == -11, r


def test_segfault_via_ctypes(sb):
    r = run(sb, "import ctypes\nctypes.string_at(0)")
    assert r.status == "killed" and r.exit_code == -11, r


def test_fill_tmp_dir_then_next_run_starts_clean(sb):
    code = "import os\ni = 0\ntry:\n    while True:\n        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * 1024**2)\n        i += 1\nexcept OSError as e:\n    print('stopped', e.errno)"
    r = run(sb, code)
    assert r.stdout.startswith("stopped"), r
    for _ in range(WORKERS * 2):
        after = run(
            sb, "import os, shutil\nprint(os.listdir('.'), shutil.disk_usage('/tmp').used < 2 * 1024**2)"
        )
        assert after.stdout == "[] True\n", after


def test_huge_file_hits_file_size_limit(sb):
    r = run(sb, "open('big', 'wb').write(b'x' * 64 * 1024**2)")
    assert r.status == "error" and "File too large" in r.stderr, r  # EFBIG (Python ignores SIGXFSZ)


def test_fd_exhaustion(sb):
    r = run(
        sb,
        "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError as e:\n    print('limited', len(fs), e.errno)",
    )
    assert r.stdout.startswith("limited") and r.stdout.split()[2] == "24", r


# ------------------------------------------------------------------ network


def test_tcp_to_host_loopback_listener(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except (TimeoutError, OSError):
                continue

    t = threading.Thread(target=accept)
    t.start()
    code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', type(e).__name__)"
    r = run(sb, code)
    stop.set()
    t.join()
    server.close()
    assert "CONNECTED" not in r.stdout and r.stdout.startswith("blocked"), r
    assert accepted == []


@pytest.mark.smoke
def test_tcp_to_public_ip(sb):
    r = run(sb, "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)")
    assert r.status == "error" and "PermissionError" in r.stderr, r  # seccomp: no AF_INET sockets


def test_dns_lookup(sb):
    r = run(sb, "import socket\nprint(socket.getaddrinfo('example.com', 80))")
    assert r.status == "error" and "gaierror" in r.stderr, r


def test_udp_send(sb):
    r = run(
        sb,
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))",
    )
    assert r.status == "error" and "PermissionError" in r.stderr, r


def test_only_loopback_interface(sb):
    r = run(
        sb,
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/self/net/dev').read().splitlines()[2:]))",
    )
    assert r.stdout == "['lo']\n", r


def test_raw_and_netlink_sockets(sb):
    r = run(
        sb,
        "import socket\nfor fam, typ in ((socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_INET6, socket.SOCK_STREAM)):\n    try:\n        socket.socket(fam, typ); print('OPENED')\n    except OSError as e:\n        print('blocked', e.errno)",
    )
    assert "OPENED" not in r.stdout and r.stdout.count("blocked") == 3, r


# ------------------------------------------------------------------ filesystem and secrets


def test_writes_outside_workdir(sb):
    """The working directory (/tmp, the run's own tmpfs) and /dev/shm are the only writable places."""
    code = "for p in ['/usr/evil', '/etc/evil', '/evil', '/dev/evil', '/opt/agentrl/evil', '/proc/evil']:\n    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n    except OSError as e:\n        print('denied', p)"
    r = run(sb, code)
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == 6, r
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()


def test_host_home_directories_invisible(sb):
    r = run(sb, "import os\nfor p in ['/root', '/home', '/work']:\n    print(p, os.path.exists(p))")
    assert r.stdout == "/root False\n/home False\n/work False\n", r


def test_project_checkout_invisible(sb):
    r = run(
        sb,
        f"import os\nprint(os.path.exists({str(REPO)!r}), os.path.exists({str(REPO / 'pyproject.toml')!r}))",
    )
    assert r.stdout == "False False\n", r


@pytest.mark.smoke
def test_host_environment_and_secrets_invisible(sb):
    assert os.environ["AGENTRL_TEST_SECRET"]
    code = "import os\nout = repr(dict(os.environ))\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        for f in ('environ', 'cmdline'):\n            try:\n                out += open(f'/proc/{p}/{f}', 'rb').read().decode('latin1')\n            except OSError:\n                pass\nprint(out)"
    r = run(sb, code)
    assert r.status == "ok", r
    assert "hunter2" not in r.stdout and "AGENTRL_TEST_SECRET" not in r.stdout


@pytest.mark.smoke
def test_proc_shows_only_the_sandbox(sb):
    code = "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint(len(pids))\nfor p in pids:\n    try:\n        print(open(f'/proc/{p}/cmdline','rb').read().split(b'\\0')[0].decode())\n    except OSError:\n        pass"
    r = run(sb, code)
    lines = r.stdout.split("\n")
    assert int(lines[0]) <= 4, r  # bwrap's init, the worker, this run
    assert "pytest" not in r.stdout and str(os.getpid()) not in lines[1:], r


def test_cannot_read_worker_memory(sb):
    r = run(
        sb,
        "import os\ntry:\n    open(f'/proc/{os.getppid()}/mem', 'rb').read(1); print('READ')\nexcept OSError as e:\n    print('denied', e.errno)",
    )
    assert r.stdout.startswith("denied"), r


# ------------------------------------------------------------------ processes and signals


def test_kill_parent_worker(sb):
    """The run is pid 1 of a pid namespace of its own: no parent (the worker is in no namespace the code sees),
    pid 1 is itself (a signal to itself is ignored, as for any pid 1); the worker lives on."""
    r = run(
        sb,
        "import os, signal\nprint(os.getpid(), os.getppid())\nfor pid in (os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL); print('sent', pid)\n    except OSError as e:\n        print('denied', e.errno)\nprint('alive')",
    )
    assert r.status == "ok" and r.stdout.startswith("1 0\n") and r.stdout.endswith("alive\n"), r


def test_signal_everything(sb):
    code = "import os, signal, subprocess\np = subprocess.Popen(['sleep', '30'])\nos.kill(-1, signal.SIGKILL)\nprint(p.wait())"
    r = run(sb, code)
    assert r.status == "ok" and r.stdout == "-9\n", r  # only its own processes were reachable


@pytest.mark.smoke
def test_ptrace_denied(sb):
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nres = libc.ptrace(16, os.getppid(), 0, 0)\nprint(res, ctypes.get_errno())\nres = libc.ptrace(0, 0, 0, 0)\nprint(res, ctypes.get_errno())"
    r = run(sb, code)
    assert r.stdout == "-1 1\n-1 1\n", r  # EPERM for attach and for PTRACE_TRACEME


def test_namespace_and_mount_syscalls_denied(sb):
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\nimport os\ntry:\n    os.setuid(0); print('ROOT')\nexcept OSError:\n    print('no root')"
    r = run(sb, code)
    assert r.stdout == "-1 -1\nno root\n", r


def test_code_loads_its_own_filter_on_top_of_the_workers(sb):
    """The worker's filter allows mount and unshare (it needs them); the code's own filter must deny them. Without
    it, unshare(0) would succeed and mount with bad pointers would fail with EFAULT, not EPERM."""
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0), ctypes.get_errno())\n"
        "print(libc.mount(None, None, None, 0, None), ctypes.get_errno())\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp_filters')])"
    )
    for session in (None, sid := sb.create_session()):
        r = sb.run(code, session=session)
        assert r.stdout == "-1 1\n-1 1\n['2']\n", r
    sb.release_session(sid)


def test_timeout_escape_with_signal_handlers(sb):
    code = "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGHUP, signal.SIGALRM):\n    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass"
    r = run(sb, code, timeout_s=0.5)
    assert r.status == "timeout" and r.duration_s < 1.5, r


def test_timeout_escape_with_detached_children(sb):
    code = "import os, subprocess, time\nif os.fork() == 0:\n    os.setpgid(0, 0)\n    if os.fork() == 0:\n        time.sleep(3)\n        open('/tmp/slot0/late', 'w').write('x')\n    os._exit(0)\nsubprocess.Popen(['sleep', '1000'], process_group=0)\nprint('parent done')"
    r = run(sb, code)
    assert r.status == "ok" and r.stdout == "parent done\n", r


@pytest.mark.smoke
def test_leftover_background_processes_are_killed(sb):
    sid = sb.create_session()
    try:
        r = sb.run(
            "import subprocess\np = subprocess.Popen(['sleep', '1000'])\np.pid", session=sid, timeout_s=2
        )
        assert r.status == "ok", r
        r = sb.run("p.poll()", session=sid, timeout_s=2)
        assert r.display == "-9", r  # SIGKILLed by the sandbox after the previous call
    finally:
        sb.release_session(sid)


# ------------------------------------------------------------------ output and input


def test_huge_stdout(sb):
    # 50 MB through a 64 KiB pipe is hundreds of wake-ups: about 0.4 s on an idle box, but several seconds on a
    # shared, loaded one. The test is about truncation, not speed.
    code = "import sys\nsys.stdout.write('x' * 50_000_000)\nprint('end', file=sys.stderr)"
    r = run(sb, code, timeout_s=30.0)
    assert r.status == "ok" and r.truncated, r
    assert len(r.stdout) < 9000 and "more bytes of stdout truncated" in r.stdout
    assert r.stderr == "end\n"


def test_infinite_stdout(sb):
    r = run(sb, "while True:\n    print('spam' * 1000)", timeout_s=0.5)
    assert r.status == "timeout" and r.truncated and len(r.stdout) < 9000, r


def test_binary_output(sb):
    r = run(sb, "import sys, os\nsys.stdout.buffer.write(bytes(range(256)) * 4 + os.urandom(1000))")
    assert r.status == "ok" and isinstance(r.stdout, str) and len(r.stdout) > 1000, r


def test_infinite_stdin_read(sb):
    r = run(
        sb,
        "import sys, os\ndata = sys.stdin.read()\nwhile os.read(0, 1 << 16):\n    pass\nprint(len(data))",
        stdin="y\n" * 10,
    )
    assert r.status == "ok" and r.stdout == "20\n", r


@pytest.mark.smoke
def test_forged_result_channel(sb):
    r = run(sb, "import os\nos.write(3, b'\\xff\\xff\\xff\\xffgarbage')\nprint('x')")
    assert r.status == "error", r
    sid = sb.create_session()
    try:
        r = sb.run("import os\nos.write(4, b'\\x00\\x00\\x00\\x05{bad}')", session=sid, timeout_s=2)
        assert r.status == "error" and "state was lost" in r.message, r
        assert sb.run("1 + 1", session=sid).display == "2"
    finally:
        sb.release_session(sid)


# ------------------------------------------------------------------ sessions


@pytest.mark.smoke
def test_os_exit_in_session_then_reuse(sb):
    sid = sb.create_session()
    try:
        assert sb.run("x = 41", session=sid).ok
        r = sb.run("import os\nos._exit(7)", session=sid)
        assert r.exit_code == 7 and "state was lost" in r.message, r
        r = sb.run("x", session=sid)
        assert r.status == "error" and "NameError" in r.stderr, r
        assert sb.run("x = 1\nx + 1", session=sid).display == "2"
    finally:
        sb.release_session(sid)


def test_background_thread_in_session_is_frozen_between_calls(sb):
    sid = sb.create_session()
    try:
        code = "import threading, time\nticks = []\ndef spin():\n    while True:\n        ticks.append(time.monotonic())\n        time.sleep(0.005)\nthreading.Thread(target=spin, daemon=True).start()\ntime.sleep(0.05)\nt_end = time.monotonic()"
        assert sb.run(code, session=sid).ok
        time.sleep(0.5)
        r = sb.run(
            "t_start = time.monotonic()\n(len(ticks) > 3, [t for t in ticks if t_end + 0.05 < t < t_start - 0.05])",
            session=sid,
        )
        assert r.display == "(True, [])", r  # it ran during calls, never in between
    finally:
        sb.release_session(sid)


def test_timeout_in_session_resets_it(sb):
    sid = sb.create_session()
    try:
        assert sb.run("y = 5", session=sid).ok
        r = sb.run("while True:\n    pass", session=sid, timeout_s=0.5)
        assert r.status == "timeout" and "state was lost" in r.message, r
        assert sb.run("'y' in globals()", session=sid).display == "False"
    finally:
        sb.release_session(sid)


@pytest.mark.smoke
@pytest.mark.skipif(not AS_ROOT, reason="per-session uids need root")
def test_sessions_cannot_touch_each_other(sb):
    a, b = sb.create_session(), sb.create_session()
    try:
        r = sb.run(
            "import os\nopen('secret.txt', 'w').write('A-secret')\n(os.getcwd(), os.getpid())", session=a
        )
        cwd, pid = eval(r.display)
        code = f"import os, signal\ntry:\n    print(open({cwd!r} + '/secret.txt').read())\nexcept OSError:\n    print('no read')\ntry:\n    os.kill({pid}, signal.SIGKILL); print('KILLED')\nexcept OSError:\n    print('no kill')"
        r = sb.run(code, session=b)
        if r.stdout != "no read\nno kill\n":  # b may live in the other worker, where the pid is someone else
            assert "A-secret" not in r.stdout and "KILLED" not in r.stdout, r
        assert sb.run("open('secret.txt').read()", session=a).display == "'A-secret'"
    finally:
        sb.release_session(a)
        sb.release_session(b)


def test_shm_does_not_leak_between_runs(sb):
    run(sb, "open('/dev/shm/leak', 'w').write('x')")
    for _ in range(2 * WORKERS):
        assert run(sb, "import os\nprint(os.listdir('/dev/shm'))").stdout == "[]\n"
