"""The host's handle on one sandboxed worker process of a :class:`~.local.LocalSandbox` pool: start it (in its
own sandbox and memory cgroup, with a uid block of its own), send it requests and read its answers and health
frames, and kill it with everything inside it. Also the host's scan for the processes of a uid block."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.sandbox import isolation as iso
from agentrl.envs.sandbox.base import SandboxUnavailable
from agentrl.envs.sandbox.cgroups import PREFIX as CGROUP_PREFIX
from agentrl.envs.sandbox.cgroups import CpuCgroup, MemoryCgroup, command_name, descendants, protect_from_oom

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
#: Extra seconds the host waits beyond a run's timeout before it declares the worker hung.
_GRACE_S = 10.0
#: How long a worker may take to clean up and check itself after a request before it is declared hung.
_HEALTH_TIMEOUT_S = 60.0
#: uids in one worker's block: the first is the worker's own host uid, the rest its code's (see
#: ``local.DEFAULT_UID_BASE``).
_UIDS_PER_WORKER = 4096
#: Memory a worker's cgroup may hold beyond its executions' capacity: bubblewrap, the worker, session inits and
#: kernel memory, bytes.
_SYSTEM_MARGIN = 64 << 20
#: Per-uid kernel quotas of one execution (Linux's defaults for a user); a worker's user namespace holds room
#: for all of its executions at once.
QUOTAS = {"msgqueue_bytes": 819200, "sigpending": 4096, "memlock_bytes": 8 << 20}


class WorkerLost(ConnectionError):
    """A worker died (``hung`` False) or stopped answering (``hung`` True) during a request; it was killed."""

    def __init__(self, message: str, *, hung: bool) -> None:
        super().__init__(message)
        self.hung = hung


class BlockBusy(SandboxUnavailable):
    """A worker cannot (re)start: processes of its uid block, from its previous sandbox, are still exiting."""


@dataclass
class _MemoryCap:
    mode: str  # "auto" | "required" | "off"
    capacity_bytes: int  # what a worker's executions may hold together
    reserved_bytes: int  # each live session's (and the stateless runs') guaranteed share of it
    warned: bool = False

    @property
    def max_sessions(self) -> int:
        """Live sessions a worker admits: every one of them, and its stateless runs, get their reserved share."""
        return max(1, self.capacity_bytes // self.reserved_bytes - 1)


@dataclass
class _Settings:
    """What every worker of a pool shares."""

    mode: str  # "root" | "userns" | "none"
    python: str
    ro_binds: tuple[str, ...]
    limits: dict[str, int]
    output_cap: int
    seccomp: bool
    tmpfs_bytes: int
    tmpfs_inodes: int
    start_timeout_s: float
    memory_cap: _MemoryCap
    tmp_root: str = ""
    pool_id: str = field(default_factory=lambda: secrets.token_hex(4))
    on_unhealthy: Any = None  # callback(worker, reason)
    background: set[asyncio.Task] = field(default_factory=set)


class _Worker:
    """Host-side handle of one sandboxed fork server. All traffic goes through :meth:`call`."""

    def __init__(self, index: int, uid_base: int, settings: _Settings) -> None:
        self.index = index
        self.uid_base = uid_base
        self.s = settings
        self.cgroup: MemoryCgroup | None = None
        self.cpu_cgroup: CpuCgroup | None = None
        self.lock = asyncio.Lock()
        self.load = 0  # runs queued or in flight here
        self.generation = 0
        self.sessions: set[str] = set()
        self.retired = False
        #: The worker's latest health frame: {health, problems, cleanup_s}.
        self.last_health: dict[str, Any] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self._stderr_task: asyncio.Task | None = None
        self._frame_size: int | None = None  # of a frame whose header was read, body not yet

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def code_uids(self) -> range:
        return range(self.uid_base, self.uid_base + _UIDS_PER_WORKER)

    async def start(self) -> None:
        """Start the sandbox and wait for the worker's ready frame. Raises SandboxUnavailable on failure."""
        s = self.s
        if s.mode == "root":  # a uid is never reused while anything of its previous holder may remain
            leftover = uid_processes(self.code_uids)
            deadline = time.monotonic() + 5.0
            while (
                leftover and time.monotonic() < deadline
            ):  # a killed sandbox's processes may still be exiting
                await asyncio.sleep(0.01)
                leftover = uid_processes(self.code_uids)
            if leftover:
                raise BlockBusy(
                    f"processes {leftover[:5]} still run as uids of sandbox block {self.uid_base}; refusing to reuse it"
                )
        for cgroup in self._take_cgroups():  # a previous sandbox's, if it died without kill()
            await asyncio.to_thread(cgroup.remove)
        self.generation += 1
        self._frame_size = None
        self.cgroup = self._make_cgroup()
        self.cpu_cgroup = CpuCgroup.create(self._cgroup_name())
        cg_fd = self.cgroup.open_dir() if self.cgroup is not None else None
        source_fd = iso.worker_source_fd() if s.mode != "none" else None
        pass_fds = tuple(fd for fd in (cg_fd, source_fd) if fd is not None)
        try:
            if s.mode == "none":
                argv = iso.unisolated_command(s.python)
            else:
                argv = iso.bwrap_command(s.python, mode=s.mode, source_fd=source_fd, ro_binds=s.ro_binds)
            # Born inside its cgroups, so the cgroup namespace shows none of the host's. The memory cgroup must
            # take it; the CPU cgroup may refuse (e.g. cgroup v2's rules on where processes may live): the
            # sandbox then runs in ours, CPU shared as without one.
            joins: list[tuple[str, str]] = []
            if self.cgroup is not None:
                joins.append(('echo $$ > "$%d" &&', str(self.cgroup.path / "sys" / "cgroup.procs")))
            if self.cpu_cgroup is not None:
                joins.append(('{ echo $$ > "$%d"; } 2>/dev/null;', str(self.cpu_cgroup.procs_file)))
            if joins:
                script = " ".join(step % i for i, (step, _) in enumerate(joins, 1))
                files = [path for _, path in joins]
                argv = ["/bin/sh", "-c", f'{script} shift {len(joins)} && exec "$@"', "sh", *files, *argv]
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        finally:
            for fd in pass_fds:
                os.close(fd)
        config = iso.worker_config(
            mode=s.mode,
            uid_base=self.uid_base,
            n_uids=_UIDS_PER_WORKER - 1,
            limits=s.limits,
            output_cap=s.output_cap,
            seccomp=s.seccomp,
            tmpfs_bytes=s.tmpfs_bytes,
            tmpfs_inodes=s.tmpfs_inodes,
            cgroup={"fd": cg_fd, "version": self.cgroup.version} if self.cgroup is not None else None,
            worker_bytes=s.memory_cap.capacity_bytes,
            reserved_bytes=s.memory_cap.reserved_bytes,
            max_sessions=s.memory_cap.max_sessions,
            quotas=QUOTAS,
            tmp_root=s.tmp_root,
        )
        try:
            self._send(config)
            ready = await asyncio.wait_for(self._read_frame(), s.start_timeout_s)
            if not ready.get("error"):
                health = await asyncio.wait_for(self._read_frame(), s.start_timeout_s)
        except asyncio.CancelledError:  # a half-started sandbox must not outlive the call that wanted it
            self._abandon()
            raise
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
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
        self.last_health = health
        if not health.get("health"):
            await self.kill()
            raise SandboxUnavailable(f"a fresh sandbox failed its own health check: {health.get('problems')}")
        self._stderr_task = asyncio.create_task(self._log_stderr(self.proc))
        if self.cgroup is not None and self.proc is not None:
            for pid in descendants(self.proc.pid):  # bubblewrap and the worker: never the OOM killer's choice
                if command_name(pid) in ("bwrap", "python3", "sh") or pid == self.proc.pid:
                    protect_from_oom(pid)

    def _make_cgroup(self) -> MemoryCgroup | None:
        """A fresh memory cgroup for this sandbox, if configured (see :class:`MemoryCgroup`)."""
        cap = self.s.memory_cap
        if cap.mode == "off" or not _is_root():
            group = None
        else:
            name = self._cgroup_name()
            owner = self.uid_base if self.s.mode == "root" else None
            group = MemoryCgroup.create(name, cap.capacity_bytes + _SYSTEM_MARGIN, owner_uid=owner)
        if group is None:
            if cap.mode == "required":
                raise SandboxUnavailable(
                    "memory_cgroup='required' but no writable memory cgroup is available (run as root on a host "
                    "with the cgroup memory controller, or pass memory_cgroup='auto'/'off')"
                )
            if cap.mode == "auto" and not cap.warned:
                cap.warned = True
                log.warning(
                    "no writable memory cgroup: an execution's memory is bounded only by its address-space "
                    "limit, and shared memory and tmpfs files are not counted (run as root with the cgroup "
                    "memory controller for full accounting)"
                )
        return group

    def _cgroup_name(self) -> str:
        """The name of this sandbox's cgroups (one per controller hierarchy; see :func:`cgroups._remove_stale`)."""
        return f"{CGROUP_PREFIX}{os.getpid()}-{self.s.pool_id}-{self.index}-{self.generation}"

    def _send(self, payload: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = json.dumps(payload).encode()
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)

    async def call(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and return the worker's answer, restarting a dead worker first.

        The worker then cleans up and sends a health frame; until it arrives the worker stays locked (in the
        background: the caller has its answer), so cleanup is charged to no run's time budget. ``timeout_s`` counts
        from the moment the request is sent, never the wait for the lock. A caller cancelled mid-request leaves the
        request to finish in the background (its answer is dropped): the worker and its sessions live on.

        Raises WorkerLost if the worker died or hung (it is then killed; the next call restarts it), and
        SandboxUnavailable if it cannot be (re)started.
        """
        await self.lock.acquire()
        handed_off = False
        try:
            if not self.alive:
                await self.start()
            assert self.proc is not None and self.proc.stdin is not None
            deadline = time.monotonic() + timeout_s + _GRACE_S  # the run's clock starts once it is sent
            try:
                self._send(payload)
                await self.proc.stdin.drain()
                resp = await _within(self._read_frame(), timeout_s + _GRACE_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                await self.kill()
                raise WorkerLost(
                    f"sandbox worker {self.index} failed ({type(exc).__name__}: {exc})",
                    hung=isinstance(exc, asyncio.TimeoutError),
                ) from None
            except asyncio.CancelledError:
                # The caller is gone, not the run: it ends by itself (within its timeout), its answer is read and
                # dropped in the background, and the worker with every other session's state lives on.
                self._background(self._drop_answer(deadline))
                handed_off = True
                raise
            self._background(self._await_health())
            handed_off = True
            return resp
        finally:
            if not handed_off:
                self.lock.release()

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.s.background.add(task)
        task.add_done_callback(self.s.background.discard)

    async def _drop_answer(self, deadline: float) -> None:
        """Read and drop the answer of a request whose caller was cancelled, then its health frame (the worker
        stays locked until then, so the answer is never read as the next request's)."""
        try:
            await _within(self._read_frame(), max(0.0, deadline - time.monotonic()))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            if self.proc is not None:
                log.warning(
                    "sandbox worker %d failed after its caller left (%r); killing it", self.index, exc
                )
            await self.kill()
            self.lock.release()
            return
        except asyncio.CancelledError:
            self._abandon()
            self.lock.release()
            raise
        await self._await_health()

    async def _await_health(self) -> None:
        """Read the health frame that follows every answer; then release the worker."""
        try:
            health = await _within(self._read_frame(), _HEALTH_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            if self.proc is not None:
                log.warning("sandbox worker %d did not finish its cleanup (%r); killing it", self.index, exc)
            await self.kill()
        except asyncio.CancelledError:
            self._abandon()
            raise
        else:
            self.last_health = health
            if not health.get("health") and self.s.on_unhealthy is not None:
                self.s.on_unhealthy(self, "; ".join(health.get("problems") or ["unknown"]))
        finally:
            self.lock.release()

    async def _read_frame(self) -> dict[str, Any]:
        """The next frame. Safe to cancel: a frame whose header was read is resumed by the next call."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise ConnectionError("the sandbox worker is gone")
        if self._frame_size is None:
            (self._frame_size,) = _HEADER.unpack(await proc.stdout.readexactly(4))
        body = await proc.stdout.readexactly(self._frame_size)
        self._frame_size = None
        obj = json.loads(body)
        if not isinstance(obj, dict):
            raise ValueError("worker frame is not an object")
        return obj

    async def kill(self) -> None:
        """Kill the sandbox (its pid namespace dies with it) and forget its kernels. Its stderr reader is
        cancelled and awaited even when this call is cancelled (the pool's close cancels a retired worker's
        stop): a task left pending is finalised later by the garbage collector, inside whatever code runs then."""
        proc, self.proc, self._frame_size = self.proc, None, None
        try:
            if proc is not None and proc.returncode is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                await proc.wait()
            for cgroup in self._take_cgroups():
                await asyncio.to_thread(cgroup.remove)
        finally:
            if self._stderr_task is not None:
                task, self._stderr_task = self._stderr_task, None
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _abandon(self) -> None:
        """Kill the sandbox now, without waiting; reaping and cgroup removal finish in the background."""
        proc, self.proc, self._frame_size = self.proc, None, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            self.s.background.add(self._stderr_task)  # the pool's close awaits it
            self._stderr_task.add_done_callback(self.s.background.discard)
            self._stderr_task = None
        task = asyncio.get_running_loop().create_task(_reap(proc, self._take_cgroups()))
        self.s.background.add(task)
        task.add_done_callback(self.s.background.discard)

    def _take_cgroups(self) -> list[MemoryCgroup | CpuCgroup]:
        """This sandbox's cgroups, forgotten here (the caller removes them once its processes are gone)."""
        groups = [g for g in (self.cgroup, self.cpu_cgroup) if g is not None]
        self.cgroup = self.cpu_cgroup = None
        return groups

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


async def _within(coro: Any, timeout: float) -> Any:
    """Await ``coro`` for at most ``timeout`` seconds (raises TimeoutError). ``asyncio.timeout`` where available:
    unlike ``wait_for`` it runs the coroutine in the caller's task instead of a new one (two per execution)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)


async def _reap(proc: asyncio.subprocess.Process, cgroups: list[MemoryCgroup | CpuCgroup]) -> None:
    await proc.wait()
    for cgroup in cgroups:
        await asyncio.to_thread(cgroup.remove)


@dataclass(frozen=True)
class CodeUids:
    """The code uids of ``blocks`` consecutive uid blocks from ``base`` (supports ``uid in ...``)."""

    base: int
    blocks: int

    def __contains__(self, uid: object) -> bool:
        if not isinstance(uid, int):
            return False
        offset = uid - self.base
        return 0 <= offset < self.blocks * _UIDS_PER_WORKER and offset % _UIDS_PER_WORKER != 0


def _is_root() -> bool:
    return os.geteuid() == 0


def uid_processes(uids: range | CodeUids) -> list[int]:
    """Host pids (zombies included) running as a uid in ``uids``.

    The uid is the owner of ``/proc/<pid>`` (the kernel sets it to the effective uid), which no process can
    write; ``/proc/<pid>/status`` is never parsed, since it starts with the process name, which sandboxed code
    chooses (``Uid:x``, ``Uid:<a uid>``, bytes that are not UTF-8). Code runs without capabilities on nosuid
    mounts, so its effective uid is its real uid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        if uid in uids:
            found.append(int(name))
    return found
