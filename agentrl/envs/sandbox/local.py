"""The local backend: a pool of pre-started, isolated fork-server workers (Linux, bubblewrap).

Each worker is one sandbox (see :mod:`.isolation`) running ``_worker.py``, which forks a child per stateless
run (about a millisecond) and keeps one long-lived kernel process per stateful session. Stateless runs go to
the least busy worker; a session is pinned to the worker that holds its kernel. A worker that dies or stops
answering is killed with everything inside it and restarted on its next use; sessions it held restart from a
fresh state and say so in ``ExecResult.message``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import struct
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.envs.sandbox import isolation as iso
from agentrl.envs.sandbox.base import ExecResult, SandboxError, SandboxUnavailable
from agentrl.envs.sandbox.cgroups import PREFIX as CGROUP_PREFIX
from agentrl.envs.sandbox.cgroups import MemoryCgroup, command_name, descendants, protect_from_oom

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
#: Extra seconds the host waits beyond a run's timeout before it declares the worker hung.
_GRACE_S = 10.0
#: Start of the uid range for code (an unused high range). Each pool takes a random block of it, each worker a
#: sub-block of ``_UIDS_PER_WORKER`` uids, so pools on one host (e.g. several trainers) do not share uids.
DEFAULT_UID_BASE = 0x7E000000
_UID_RANGE = 0x01FFFFFF
_UIDS_PER_WORKER = 4096
MAX_TIMEOUT_S = 3600.0


@dataclass
class _MemoryCap:
    mode: str  # "auto" | "required" | "off"
    limit_bytes: int
    warned: bool = False


@dataclass
class _Session:
    worker: _Worker
    slot: int
    generation: int  # the worker generation whose kernel holds this session's state


class _Worker:
    """Host-side handle of one sandboxed fork server. All traffic goes through :meth:`request`."""

    def __init__(self, index: int, argv: list[str], start_timeout_s: float, memory_cap: _MemoryCap) -> None:
        self.index = index
        self.argv = argv
        self.start_timeout_s = start_timeout_s
        self.memory_cap = memory_cap
        self.cgroup: MemoryCgroup | None = None
        self.lock = asyncio.Lock()
        self.load = 0  # runs queued or in flight here
        self.generation = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.free_slots = list(range(_UIDS_PER_WORKER - 1, 0, -1))
        self._stderr_task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Start the sandbox and wait for the worker's ready frame. Raises SandboxUnavailable on failure."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.generation += 1
        try:
            ready = await asyncio.wait_for(self._read_frame(), self.start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            stderr = await self._stop_and_read_stderr()
            raise SandboxUnavailable(
                iso.explain_start_failure(
                    stderr or f"no ready signal ({type(exc).__name__})", as_root=_is_root()
                )
            ) from None
        if ready.get("error"):
            stderr = await self._stop_and_read_stderr()
            raise SandboxUnavailable(
                iso.explain_start_failure(f"{ready['error']} {stderr}", as_root=_is_root())
            )
        self._stderr_task = asyncio.create_task(self._log_stderr(self.proc))
        try:
            self._cap_memory()
        except SandboxUnavailable:
            await self.kill()
            raise

    def _cap_memory(self) -> None:
        """Put the whole sandbox (no code has run yet) into a fresh memory cgroup, if configured."""
        cap = self.memory_cap
        if cap.mode == "off":
            return
        assert self.proc is not None
        name = f"{CGROUP_PREFIX}{os.getpid()}-{self.index}-{self.generation}"
        self.cgroup = MemoryCgroup.create(name, cap.limit_bytes) if _is_root() else None
        if self.cgroup is None:
            if cap.mode == "required":
                raise SandboxUnavailable(
                    "memory_cgroup='required' but no writable memory cgroup is available (run as root on a host "
                    "with the cgroup memory controller, or pass memory_cgroup='auto'/'off')"
                )
            if not cap.warned:
                cap.warned = True
                log.warning(
                    "no writable memory cgroup: each sandbox's total memory is bounded only by max_processes x "
                    "memory_mb (run as root with the cgroup memory controller for an aggregate cap)"
                )
            return
        try:
            for pid in descendants(self.proc.pid):
                self.cgroup.add(pid)
                if command_name(pid) == "bwrap":  # its init dying would end the sandbox
                    protect_from_oom(pid)
        except OSError as exc:
            self.cgroup.remove()
            self.cgroup = None
            if cap.mode == "required":
                raise SandboxUnavailable(
                    f"could not move the sandbox into its memory cgroup: {exc}"
                ) from None
            log.warning("could not move sandbox worker %d into its memory cgroup: %s", self.index, exc)

    async def request(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and return the worker's answer. The caller holds ``self.lock``.

        Raises ConnectionError if the worker died or hung (it is then killed; the next call restarts it).
        """
        if not self.alive:
            await self.start()
        assert self.proc is not None and self.proc.stdin is not None
        data = json.dumps(payload).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            await self.proc.stdin.drain()
            return await asyncio.wait_for(self._read_frame(), timeout_s + _GRACE_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            await self.kill()
            raise ConnectionError(
                f"sandbox worker {self.index} failed ({type(exc).__name__}: {exc})"
            ) from None
        except asyncio.CancelledError:
            # The answer may still come; it must never be read as the next request's. End this sandbox.
            self._abandon()
            raise

    async def _read_frame(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(4)
        (size,) = _HEADER.unpack(head)
        obj = json.loads(await self.proc.stdout.readexactly(size))
        if not isinstance(obj, dict):
            raise ValueError("worker frame is not an object")
        return obj

    async def kill(self) -> None:
        """Kill the sandbox (its pid namespace dies with it) and forget its kernels."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            self._stderr_task = None

    def _abandon(self) -> None:
        """Kill the sandbox now, without waiting; reaping and cgroup removal finish in the background."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            self._stderr_task = None
        cgroup, self.cgroup = self.cgroup, None
        task = asyncio.get_running_loop().create_task(_reap(proc, cgroup))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _stop_and_read_stderr(self) -> str:
        proc = self.proc
        await self.kill()
        if proc is None or proc.stderr is None:
            return ""
        try:
            return (await asyncio.wait_for(proc.stderr.read(), 5.0)).decode(errors="replace")
        except asyncio.TimeoutError:
            return ""

    async def _log_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            log.warning("sandbox worker %d: %s", self.index, line.decode(errors="replace").rstrip())


_BACKGROUND: set[asyncio.Task] = set()


async def _reap(proc: asyncio.subprocess.Process, cgroup: MemoryCgroup | None) -> None:
    await proc.wait()
    if cgroup is not None:
        cgroup.remove()


def _is_root() -> bool:
    return os.geteuid() == 0


class LocalSandbox:
    """A pool of isolated fork-server workers on this machine; implements :class:`SandboxBackend`.

    Args:
        workers: number of sandboxes (parallel runs); default: twice the CPU count (a worker waits while its
            child runs, so two per core keep the cores busy).
        isolation: ``"bubblewrap"`` (default) or ``"none"`` (NO isolation: the code runs as this user on the
            host; only for trusted code; warns loudly).
        python: the interpreter inside the sandbox; must be visible there (under /usr or ``ro_binds``) and,
            as root, readable by a non-root uid. The code can import what this interpreter has installed: for
            numpy/sympy on Debian, ``apt-get install python3-numpy python3-sympy``.
        memory_mb: address-space limit per process (RLIMIT_AS), MiB.
        max_processes: processes+threads per run (RLIMIT_NPROC; as root, counted per run's own uid).
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        max_open_files: RLIMIT_NOFILE.
        tmpfs_mb: size of the sandbox's private /tmp (and of /dev/shm), MiB, per worker.
        worker_memory_mb: memory cap for everything one worker runs together (its session kernels and all
            processes the code forks), MiB; default 4 x ``memory_mb``. Enforced with a memory cgroup.
        memory_cgroup: ``"auto"`` (use a memory cgroup when running as root where one is writable; otherwise warn
            once), ``"required"`` (refuse to start without one) or ``"off"``.
        output_limit_bytes: bytes kept per stream (stdout, stderr); the rest is dropped and a marker added.
        seccomp: load the seccomp filter (needs libseccomp's Python binding for ``python``,
            Debian ``python3-seccomp``).
        uid_base: first uid used for code when running as root (default: a random block of a high range).
        ro_binds: extra host paths to mount read-only at the same place (e.g. a Python prefix).
        start_timeout_s: how long a worker may take to start.

    Raises:
        SandboxUnavailable: (at construction or first use) if isolation cannot be set up; the message names the
            cause and the fix.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        isolation: str = "bubblewrap",
        python: str = "/usr/bin/python3",
        memory_mb: int = 1024,
        max_processes: int = 64,
        max_file_mb: int = 64,
        max_open_files: int = 256,
        tmpfs_mb: int = 256,
        worker_memory_mb: int | None = None,
        memory_cgroup: str = "auto",
        output_limit_bytes: int = 64 * 1024,
        seccomp: bool = True,
        uid_base: int | None = None,
        ro_binds: tuple[str, ...] = (),
        start_timeout_s: float = 30.0,
    ) -> None:
        if isolation not in ("bubblewrap", "none"):
            raise SandboxError(f"isolation must be 'bubblewrap' or 'none', not {isolation!r}")
        n = workers if workers is not None else 2 * len(os.sched_getaffinity(0))
        if n < 1:
            raise SandboxError(f"workers must be >= 1, got {n}")
        if memory_cgroup not in ("auto", "required", "off"):
            raise SandboxError(f"memory_cgroup must be 'auto', 'required' or 'off', not {memory_cgroup!r}")
        cap = _MemoryCap(
            memory_cgroup if isolation == "bubblewrap" else "off", (worker_memory_mb or 4 * memory_mb) << 20
        )
        ro_binds = tuple(ro_binds)
        limits = {
            "as_bytes": memory_mb << 20,
            "nproc": max_processes,
            "fsize_bytes": max_file_mb << 20,
            "nofile": max_open_files,
        }
        span = n * _UIDS_PER_WORKER
        if uid_base is None:
            uid_base = DEFAULT_UID_BASE + secrets.randbelow(_UID_RANGE // span) * span
        #: The uids code may run as (root mode): one per worker and slot.
        self.code_uids = range(uid_base, uid_base + span)
        self.isolated = isolation == "bubblewrap"
        self._tmp_dirs: list[tempfile.TemporaryDirectory] = []
        argvs = []
        if self.isolated:
            iso.bwrap_path()
            iso.check_interpreter(python, ro_binds)
            for i in range(n):
                cfg = iso.worker_config(
                    drop_uid=_is_root(),
                    uid_base=uid_base + i * _UIDS_PER_WORKER,
                    limits=limits,
                    output_cap=output_limit_bytes,
                    seccomp=seccomp,
                    tmp_root="/tmp",
                    own_pid_namespace=True,
                )
                argvs.append(
                    iso.bwrap_command(
                        python, cfg, as_root=_is_root(), tmpfs_bytes=tmpfs_mb << 20, ro_binds=ro_binds
                    )
                )
        else:
            msg = (
                "UNSAFE SANDBOX: model-written code will run WITHOUT isolation, as this user, with access to "
                "the network, your files and your processes. Use only for trusted code."
            )
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            for _ in range(n):
                tmp = tempfile.TemporaryDirectory(prefix="agentrl-unsafe-sandbox-")
                self._tmp_dirs.append(tmp)
                cfg = iso.worker_config(
                    drop_uid=False,
                    uid_base=0,
                    limits=limits,
                    output_cap=output_limit_bytes,
                    seccomp=False,
                    tmp_root=tmp.name,
                    own_pid_namespace=False,
                )
                argvs.append(iso.unisolated_command(python, cfg))
        self._workers = [_Worker(i, argv, start_timeout_s, cap) for i, argv in enumerate(argvs)]
        self._sessions: dict[str, _Session] = {}
        self._closed = False
        self._start_lock = asyncio.Lock()
        self._started = False

    async def start(self) -> None:
        """Start every worker now (otherwise they start on first use). Raises SandboxUnavailable."""
        async with self._start_lock:
            if self._started:
                return
            results = await asyncio.gather(*(w.start() for w in self._workers), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await asyncio.gather(*(w.kill() for w in self._workers))
                raise errors[0]
            self._started = True

    async def run(
        self,
        code: str,
        *,
        session: str | None = None,
        timeout_s: float = 10.0,
        stdin: str = "",
        files: Mapping[str, bytes] | None = None,
        fetch_files: Sequence[str] = (),
        memory_mb: int | None = None,
    ) -> ExecResult:
        """Run ``code``; see :class:`agentrl.envs.sandbox.base.SandboxBackend`.

        Extras of this backend: ``files`` (path -> content, relative to the run's working directory) are
        written before the code runs and ``fetch_files`` are read back into ``ExecResult.files`` (base64),
        both with the code's privileges; fetched files share a budget of 4x ``output_limit_bytes``.
        ``memory_mb`` lowers the address-space limit of a stateless run below the pool's (never raises it;
        ignored for sessions, whose kernel keeps the pool's limit).
        """
        self._check_open()
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise SandboxError("code and stdin must be str")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise SandboxError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        if not self._started:
            await self.start()
        if session is None:
            worker, slot, sess = min(self._workers, key=lambda w: w.load), 0, None
        else:
            sess = self._sessions.get(session)
            if sess is None:
                raise SandboxError(f"unknown sandbox session {session!r}; create one with create_session()")
            worker, slot = sess.worker, sess.slot
        payload = {
            "op": "run",
            "code": code,
            "stdin": stdin,
            "timeout": float(timeout_s),
            "slot": slot,
            "files": {p: base64.b64encode(data).decode("ascii") for p, data in (files or {}).items()},
            "fetch_files": list(fetch_files),
            "memory_bytes": (memory_mb << 20) if memory_mb and memory_mb > 0 else None,
        }
        start = time.monotonic()
        worker.load += 1
        try:
            async with worker.lock:
                lost = sess is not None and sess.generation != worker.generation and worker.alive
                try:
                    resp = await worker.request(payload, timeout_s)
                except (
                    ConnectionError,
                    SandboxUnavailable,
                ) as exc:  # the worker died, hung or cannot restart
                    return ExecResult(
                        "", "", None, "sandbox_error", time.monotonic() - start, message=str(exc)
                    )
                if sess is not None:
                    lost = lost or sess.generation != worker.generation
                    sess.generation = worker.generation
        finally:
            worker.load -= 1
        return _to_result(resp, state_lost=lost)

    async def create_session(self) -> str:
        """Reserve a stateful session (its kernel starts on the first run) and return its id."""
        self._check_open()
        if not self._started:
            await self.start()
        worker = max(self._workers, key=lambda w: (len(w.free_slots), -w.load))
        if not worker.free_slots:
            raise SandboxError(
                f"too many open sandbox sessions ({len(self._sessions)}); release finished ones with release_session()"
            )
        sid = uuid.uuid4().hex
        self._sessions[sid] = _Session(worker, worker.free_slots.pop(), worker.generation)
        return sid

    async def release_session(self, session: str) -> None:
        """Kill the session's kernel and free its slot. Unknown or already released ids are ignored."""
        sess = self._sessions.pop(session, None)
        if sess is None or self._closed:
            return
        worker = sess.worker
        async with worker.lock:
            if worker.alive:
                try:
                    await worker.request({"op": "close", "slot": sess.slot}, 10.0)
                except ConnectionError:
                    pass
        worker.free_slots.append(sess.slot)

    async def aclose(self) -> None:
        """Kill every worker and session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sessions.clear()
        await asyncio.gather(*(w.kill() for w in self._workers))
        for tmp in self._tmp_dirs:
            tmp.cleanup()

    async def __aenter__(self) -> LocalSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def num_workers(self) -> int:
        """Number of sandboxes in the pool."""
        return len(self._workers)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("this sandbox backend is closed")


def _to_result(resp: dict[str, Any], *, state_lost: bool) -> ExecResult:
    if "stdout" not in resp:  # the worker reported an internal failure
        return ExecResult("", "", None, "sandbox_error", 0.0, message=str(resp.get("message", resp)))
    message = resp.get("message", "")
    if state_lost and not resp.get("reset"):
        note = (
            "the sandbox worker holding this session was restarted, so the session's earlier state was lost"
        )
        message = f"{note}; {message}" if message else note
    return ExecResult(
        stdout=resp["stdout"],
        stderr=resp["stderr"],
        exit_code=resp["exit_code"],
        status=resp["status"],
        duration_s=float(resp["duration_s"]),
        truncated=bool(resp["truncated"]),
        display=resp.get("display"),
        message=message,
        files=resp.get("files") or {},
    )
