"""Sandbox throughput: the isolated fork-server pool against a fresh bubblewrap sandbox per execution.

Runs in one process, side by side, on this machine's cores (2 on the reference machine):

1. pool, stateless: ``LocalSandbox()`` (default size: ``WORKERS_PER_CORE`` per core), trivial snippets with 8 per
   core in flight -> exec/s;
2. pool, stateful: sequential runs in one session -> p50 latency, ms;
3. baselines, with as many in flight as the pool (a fresh sandbox gains from concurrency: its time goes as
   much to kernel waits for namespace setup and teardown as to CPU) -> exec/s:
   a. fresh bwrap per execution with the pool's isolation: same namespaces, binds and interpreter, and the
      ``python3 -I -c`` process loads the same seccomp filter (the worker's rules, those against channels between
      executions included), sets the same rlimits and drops to a non-root uid before running the snippet (what
      each pool child inherits from its worker). A fresh sandbox has its own pid namespace and /proc, as every
      pool execution now has. This is the baseline of the summary line;
   b. the same without seccomp, rlimits and uid drop (namespaces only: a weaker sandbox, for reference);
4. ``agentrl serve sandbox`` in a subprocess, driven over loopback HTTP by 16 concurrent clients -> req/s.

Phases 1, 3a and 3b alternate in ``--rounds`` rounds and are averaged, so that load from other processes on a
shared machine falls on all alike. The pool phase also counts the CPU time it consumes (this process plus every
process of the pool's sandboxes), which gives the cost of one execution, and the pool's implied rate on
``cores`` dedicated cores (``cores / CPU s per exec``). The fresh baselines are not CPU-bound, so only their
wall-clock rates are meaningful.

Every output is checked for correctness. The last line is the summary:
``sandbox: pool_exec_per_s=<n> stateful_p50_ms=<n> fresh_exec_per_s=<n> ratio=<pool/fresh>``.

Usage: ``python benchmarks/sandbox_bench.py [--seconds 5] [--skip-http]``. The cost of a change to the pool
against another tree (e.g. main), paired block by block, is ``benchmarks/sandbox_ab.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import httpx

from agentrl.envs.sandbox import isolation as iso
from agentrl.envs.sandbox._worker import seccomp as worker_seccomp
from agentrl.envs.sandbox.cgroups import descendants
from agentrl.envs.sandbox.local import WORKERS_PER_CORE, LocalSandbox

SNIPPET = "print(1 + 1)"
#: The worker's seccomp rules against channels between executions, as source for a fresh interpreter.
CHANNEL_RULES = "\n".join(
    [
        f"_LOCK_COMMANDS, F_NOTIFY, RWF_NOWAIT = {worker_seccomp._LOCK_COMMANDS!r}, {worker_seccomp.F_NOTIFY}, {worker_seccomp.RWF_NOWAIT}",
        f"POSIX_FADV_DONTNEED, POSIX_FADV_NOREUSE = {worker_seccomp.POSIX_FADV_DONTNEED}, {worker_seccomp.POSIX_FADV_NOREUSE}",
        f"MADV_MERGEABLE, MADV_COLD, MADV_PAGEOUT = {worker_seccomp.MADV_MERGEABLE}, {worker_seccomp.MADV_COLD}, {worker_seccomp.MADV_PAGEOUT}",
        f"SOL_SOCKET, SO_COOKIE, SO_NETNS_COOKIE = {worker_seccomp.SOL_SOCKET}, {worker_seccomp.SO_COOKIE}, {worker_seccomp.SO_NETNS_COOKIE}",
        inspect.getsource(worker_seccomp._add_channel_rules),
    ]
)


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` itself plus its reaped children (utime, stime, cutime, cstime)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(b")") + 2 :].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def pool_cpu_s(sb: LocalSandbox) -> float:
    """CPU seconds used so far by this process and every process of the pool's sandboxes."""
    own = os.times()
    total = own.user + own.system
    for worker in sb._workers:
        if worker.proc is not None:
            total += sum(_proc_cpu_s(pid) for pid in descendants(worker.proc.pid))
    return total


async def bench_pool_stateless(sb: LocalSandbox, seconds: float, in_flight: int) -> tuple[float, int]:
    done = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            r = await sb.run(SNIPPET, timeout_s=5)
            assert r.ok and r.stdout == "2\n", r
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    return done / (time.perf_counter() - start), done


async def bench_pool_stateful(sb: LocalSandbox, n: int) -> float:
    sid = await sb.create_session()
    assert (await sb.run("x = 0", session=sid)).ok
    latencies = []
    for i in range(n):
        t = time.perf_counter()
        r = await sb.run("x += 1\nx", session=sid, timeout_s=5)
        latencies.append(time.perf_counter() - t)
        assert r.display == str(i + 1), r
    await sb.release_session(sid)
    return statistics.median(latencies) * 1000


def fresh_argv(same_isolation: bool) -> list[str]:
    """bwrap with the pool's namespaces, binds and interpreter, running SNIPPET in a fresh ``python3 -I -c``.

    With ``same_isolation`` the fresh process also does what a pool worker does once and each pool child
    inherits: load the same seccomp filter, set the same rlimits and, as root, drop to a non-root uid. Without
    it, the sandbox has the namespaces only.
    """
    mode = "root" if os.geteuid() == 0 else "userns"
    argv = iso.bwrap_command("/usr/bin/python3", mode=mode, source_fd=-1, ro_binds=())
    at = argv.index("--ro-bind-data")  # the worker's source is not needed: the snippet runs with -c
    argv = argv[:at] + argv[at + 3 :]
    # a worker's tuning, not isolation (no effect on a fresh interpreter's start)
    at = argv.index("LD_BIND_NOW")
    argv = argv[: at - 1] + argv[at + 2 :]
    # a private /tmp of the pool's default size, as each pool execution gets
    at = argv.index("/tmp")
    argv[at - 2] = str(256 << 20)
    script = SNIPPET
    if same_isolation:
        channel_rules = textwrap.indent(CHANNEL_RULES, " " * 12).lstrip()
        script = textwrap.dedent(
            f"""
            import errno, os, resource, seccomp
            flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
            eperm = seccomp.ERRNO(errno.EPERM)
            for name in {worker_seccomp._DENIED!r}:
                try:
                    flt.add_rule(eperm, name)
                except (RuntimeError, ValueError, OSError):
                    pass
            flt.add_rule(eperm, "socket", seccomp.Arg(0, seccomp.NE, 1))
            flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
            for flag in {worker_seccomp._CLONE_NS_FLAGS!r}:
                flt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
            {channel_rules}
            _add_channel_rules(flt, seccomp)
            flt.load()
            for res, value in ((resource.RLIMIT_AS, 1 << 30), (resource.RLIMIT_NPROC, 64),
                               (resource.RLIMIT_FSIZE, 64 << 20), (resource.RLIMIT_NOFILE, 256),
                               (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, 6)):
                resource.setrlimit(res, (value, value))
            if os.getuid() == 0:
                os.setgroups([])
                os.setresgid(2**31 - 2, 2**31 - 2, 2**31 - 2)
                os.setresuid(2**31 - 2, 2**31 - 2, 2**31 - 2)
            exec(compile({SNIPPET!r}, "<cell>", "exec"))
            """
        )
    return argv[: argv.index("/usr/bin/python3")] + ["/usr/bin/python3", "-I", "-c", script]


async def bench_fresh_bwrap(seconds: float, concurrency: int, same_isolation: bool) -> tuple[float, int]:
    argv = fresh_argv(same_isolation)
    done = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            assert proc.returncode == 0 and out == b"2\n", (proc.returncode, out)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - start), done


async def bench_http(workers: int, seconds: float, clients: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "serve",
            "sandbox",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
        ],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=clients)) as client:
            for _ in range(300):
                try:
                    if (await client.get("/v1/ping")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            done = 0
            deadline = time.perf_counter() + seconds

            async def one() -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    r = await client.post(
                        "/run_code", json={"code": SNIPPET, "language": "python"}, timeout=30
                    )
                    body = r.json()
                    assert body["status"] == "Success" and body["run_result"]["stdout"] == "2\n", body
                    done += 1

            start = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(clients)))
            return done / (time.perf_counter() - start)
    finally:
        server.terminate()
        server.wait(timeout=30)


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput phase per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--skip-http", action="store_true")
    args = p.parse_args(argv)

    load_start = os.getloadavg()
    pool_rates: list[float] = []
    fresh_rates: dict[bool, list[float]] = {True: [], False: []}
    pool_cpu = 0.0
    pool_n = 0
    in_flight = 8 * args.cores
    workers = WORKERS_PER_CORE * args.cores
    async with LocalSandbox(workers=workers) as sb:
        await bench_pool_stateless(sb, 1.0, in_flight)  # warm-up
        for _ in range(args.rounds):
            c0 = pool_cpu_s(sb)
            rate, n = await bench_pool_stateless(sb, args.seconds, in_flight)
            pool_cpu += pool_cpu_s(sb) - c0
            pool_rates.append(rate)
            pool_n += n
            for same_isolation in (True, False):
                rate, _ = await bench_fresh_bwrap(args.seconds, in_flight, same_isolation)
                fresh_rates[same_isolation].append(rate)
        stateful = await bench_pool_stateful(sb, 500)
    pool = statistics.mean(pool_rates)
    fresh, fresh_ns_only = statistics.mean(fresh_rates[True]), statistics.mean(fresh_rates[False])
    pool_ms = 1000 * pool_cpu / pool_n
    print(
        f"pool stateless: {pool:.0f} exec/s ({workers} workers, {in_flight} in flight); rounds: "
        + ", ".join(f"{r:.0f}" for r in pool_rates),
        flush=True,
    )
    print(f"pool stateful: p50 {stateful:.2f} ms per run (500 sequential runs in one session)", flush=True)
    for same_isolation, label in ((True, "the pool's isolation"), (False, "namespaces only")):
        rates = fresh_rates[same_isolation]
        print(
            f"fresh bwrap per execution, {label}: {statistics.mean(rates):.0f} exec/s ({in_flight} in flight); "
            "rounds: " + ", ".join(f"{r:.0f}" for r in rates),
            flush=True,
        )
    print(
        f"pool CPU per execution (this process + every process of the sandboxes): {pool_ms:.2f} ms; capacity on "
        f"{args.cores} dedicated cores: {args.cores * 1000 / pool_ms:.0f} exec/s; pool / namespaces-only fresh "
        f"bwrap: {pool / fresh_ns_only:.1f}",
        flush=True,
    )
    if not args.skip_http:
        http = await bench_http(workers, args.seconds, 16)
        print(f"agentrl serve sandbox over loopback HTTP: {http:.0f} req/s (16 clients)", flush=True)
    print(
        json.dumps(
            {
                "cores": args.cores,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "loadavg_1min_start": load_start[0],
                "loadavg_1min_end": os.getloadavg()[0],
                "pool_cpu_ms_per_exec": round(pool_ms, 3),
            }
        )
    )
    print(
        f"sandbox: pool_exec_per_s={pool:.0f} stateful_p50_ms={stateful:.2f} "
        f"fresh_exec_per_s={fresh:.0f} ratio={pool / fresh:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
