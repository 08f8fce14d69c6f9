"""The local backend: a pool of pre-started, isolated fork-server workers (Linux, bubblewrap).

Each worker is one sandbox (see :mod:`.isolation`) running :mod:`._worker`, which forks a child per stateless
run (about a millisecond) and keeps one long-lived kernel process per stateful session; each execution gets its
own namespaces, tmpfs, memory cgroup and (as root) uid, so nothing of one run or session reaches another.
Stateless runs go to the least busy worker; a session is pinned to the worker that holds its kernel. The host's
handle on one worker process (start, requests, kill) is :class:`.worker_handle._Worker`.

After every request the worker cleans up and checks itself against a fresh sandbox, outside any run's time
budget. A worker whose check fails is retired: it leaves rotation at once, keeps serving its live sessions until
they are released, and a fresh worker takes its place (the pool holds enough uid blocks for that, whatever
sequence of requests came before). A worker that dies or stops answering is killed with everything inside it and
restarted on its next use; sessions it held restart from a fresh state and say so in ``ExecResult.message``.

Sessions are admitted up to what the workers' memory can guarantee (``reserved_mb`` each, :attr:`LocalSandbox.
max_sessions` in all; a collector that would run more episodes at once may ask, before the pool starts, for a
smaller share that the memory still backs, :meth:`LocalSandbox.admit`); beyond that ``create_session`` waits in a
first-come first-served queue for a released session's slot (freed once its kernel is closed) and raises
:class:`SandboxError` after ``session_wait_s``. A run whose worker dies under it (not one that hangs) runs once
more on a fresh worker; a cancelled run finishes in the background without harming its worker.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import logging
import os
import secrets
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.envs.sandbox import isolation as iso
from agentrl.envs.sandbox import uid_blocks
from agentrl.envs.sandbox.base import (
    LIMITS,
    STATUSES,
    ExecResult,
    SandboxError,
    SandboxMessages,
    SandboxUnavailable,
)
from agentrl.envs.sandbox.worker_handle import (
    _UIDS_PER_WORKER,
    BlockBusy,
    CodeUids,
    WorkerLost,
    _is_root,
    _MemoryCap,
    _Settings,
    _Worker,
    uid_processes,
)

log = logging.getLogger(__name__)

#: Start of the uid range for code (an unused high range). Each pool takes a run of blocks of it that no other
#: pool on the host holds (uid_blocks: from a random slot on), each
#: worker one block of ``_UIDS_PER_WORKER`` uids (the first is the worker's own host uid). A pool of n workers
#: admitting k sessions each holds n x (k + 1) blocks: a retired worker keeps its block only while it holds a
#: live session, and the pool admits at most n x k of those, so a fresh worker always finds a free block.
DEFAULT_UID_BASE = 0x7E000000
_UID_RANGE = 0x01FFFFFF
MAX_TIMEOUT_S = 3600.0
#: Default pool size per CPU. Each execution's exit waits for an RCU grace period (its mount namespace is torn
#: down), about 1 ms of idle time per execution on a 2-vCPU VM: with 2 workers per core 7.5% of the CPU stayed
#: idle under full load and the pool ran 999 exec/s; with 3, 4% and 1,075 exec/s; with 4, 3% and 1,090 exec/s.
#: A worker costs about 7 MB of memory.
WORKERS_PER_CORE = 3
#: How long a retired worker's uid block may take to be free of its processes before it is given back, seconds.
_BLOCK_RETURN_S = 60.0
#: The share of this machine's RAM that a pool's memory caps (``worker_memory_mb`` x workers) may add up to by
#: default, so that every session's guaranteed memory is backed while the host (e.g. a trainer) keeps the rest.
HOST_MEMORY_SHARE = 0.5
#: The least share of its worker's memory cap that :meth:`LocalSandbox.admit` reserves for a session, MiB: twice
#: what a session kernel holds with numpy and sympy imported (66 MB resident, measured; bare 11 MB, numpy 31 MB).
MIN_RESERVED_MB = 128


@dataclass
class _Session:
    worker: _Worker
    key: str
    generation: int  # the worker generation whose kernel holds this session's state


def _default_worker_mb(workers: int, memory_mb: int) -> int:
    """``worker_memory_mb``'s default: 4 x ``memory_mb``, lowered so that ``workers`` caps fit in
    :data:`HOST_MEMORY_SHARE` of this machine's RAM, never below ``memory_mb`` (warns when that floor exceeds it)."""
    try:
        host_mb = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20
    except (ValueError, OSError):  # pragma: no cover - Linux always answers
        return 4 * memory_mb
    share_mb = int(host_mb * HOST_MEMORY_SHARE)
    worker_mb = max(memory_mb, min(4 * memory_mb, share_mb // workers))
    if worker_mb * workers > share_mb:
        log.warning(
            "%d sandbox workers x memory_mb=%d exceed %d MiB, %g of this machine's RAM: the sessions' guaranteed "
            "memory is not backed (use fewer workers or a lower memory_mb)",
            workers,
            memory_mb,
            share_mb,
            HOST_MEMORY_SHARE,
        )
    return worker_mb


class LocalSandbox:
    """A pool of isolated fork-server workers on this machine; implements :class:`SandboxBackend`.

    Args:
        workers: number of sandboxes (parallel runs); default: :data:`WORKERS_PER_CORE` per CPU (a worker
            waits while its child runs and while the kernel tears down the child's namespaces).
        isolation: ``"bubblewrap"`` (default) or ``"none"`` (NO isolation: the code runs as this user on the
            host; only for trusted code; warns loudly).
        python: the interpreter inside the sandbox; must be visible there (under /usr or ``ro_binds``) and,
            as root, readable by a non-root uid. The code can import what this interpreter has installed: for
            numpy/sympy on Debian, ``apt-get install python3-numpy python3-sympy``.
        memory_mb: memory limit of one execution, MiB: the address-space limit of each of its processes
            (RLIMIT_AS) and, with a memory cgroup, the limit on everything it holds together (its processes,
            shared memory, ``/tmp`` and ``/dev/shm`` files).
        max_processes: processes+threads per run (RLIMIT_NPROC; as root, counted per run's own uid).
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        max_open_files: RLIMIT_NOFILE.
        tmpfs_mb: size of each execution's private ``/tmp`` (and of its ``/dev/shm``), MiB.
        tmpfs_files: inodes (files, directories, hard links) in each of those, so that a flood of them is
            bounded and cheap to remove.
        worker_memory_mb: memory cap for everything one worker runs together (its session kernels and all
            processes the code forks), MiB. Enforced with a memory cgroup. Default: 4 x ``memory_mb``, lowered so
            that the whole pool's caps fit in :data:`HOST_MEMORY_SHARE` of this machine's RAM (never below
            ``memory_mb``; a warning says when the pool's guarantees then exceed that share).
        reserved_mb: memory every live session, and a worker's stateless runs, are guaranteed of their worker's
            ``worker_memory_mb``, MiB; default an eighth of it, or less when :meth:`admit` asks for more sessions
            before the pool starts (never below :data:`MIN_RESERVED_MB`). A worker admits
            ``worker_memory_mb // reserved_mb - 1`` live sessions (:attr:`max_sessions` in all). An execution may
            use up to ``memory_mb`` while the others leave that much free; when less than its share is free, idle
            sessions holding more than theirs are ended first (they are told why).
        session_wait_s: how long ``create_session`` waits, in a first-come first-served queue, for a slot when
            the pool holds :attr:`max_sessions` live sessions (a released session's slot frees once its kernel
            is closed); then it raises :class:`SandboxError`. 0: refuse at once.
        memory_cgroup: ``"auto"`` (use memory cgroups when running as root where one is writable; otherwise warn
            once), ``"required"`` (refuse to start without one) or ``"off"``.
        output_limit_bytes: bytes kept per stream (stdout, stderr); the rest is dropped and a marker added.
        seccomp: load the seccomp filter (needs libseccomp's Python binding for ``python``,
            Debian ``python3-seccomp``).
        uid_base: first uid used for code when running as root (default: a free run of blocks of a high range,
            reserved host-wide; SandboxError if another pool on this host holds part of the given one).
        ro_binds: extra host paths to mount read-only at the same place (e.g. a Python prefix).
        start_timeout_s: how long a worker may take to start.
        messages: the notes that reach the model in ``ExecResult.message`` (see
            :class:`~agentrl.envs.sandbox.base.SandboxMessages`; internal failures stay private by default).

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
        memory_mb: int = LIMITS.memory_mb,
        max_processes: int = LIMITS.max_processes,
        max_file_mb: int = 64,
        max_open_files: int = 256,
        tmpfs_mb: int = 256,
        tmpfs_files: int = 16384,
        worker_memory_mb: int | None = None,
        reserved_mb: int | None = None,
        memory_cgroup: str = "auto",
        output_limit_bytes: int = LIMITS.output_limit_bytes,
        seccomp: bool = True,
        uid_base: int | None = None,
        ro_binds: tuple[str, ...] = (),
        start_timeout_s: float = 30.0,
        messages: SandboxMessages | None = None,
        session_wait_s: float = 600.0,
    ) -> None:
        if isolation not in ("bubblewrap", "none"):
            raise SandboxError(f"isolation must be 'bubblewrap' or 'none', not {isolation!r}")
        n = workers if workers is not None else WORKERS_PER_CORE * len(os.sched_getaffinity(0))
        if n < 1:
            raise SandboxError(f"workers must be >= 1, got {n}")
        if memory_cgroup not in ("auto", "required", "off"):
            raise SandboxError(f"memory_cgroup must be 'auto', 'required' or 'off', not {memory_cgroup!r}")
        for name, value in (("memory_mb", memory_mb), ("tmpfs_mb", tmpfs_mb), ("tmpfs_files", tmpfs_files)):
            if value < 1:
                raise SandboxError(f"{name} must be >= 1, got {value}")
        self.isolated = isolation == "bubblewrap"
        self.messages = messages or SandboxMessages()
        mode = ("root" if _is_root() else "userns") if self.isolated else "none"
        ro_binds = tuple(ro_binds)
        limits = {
            "as_bytes": memory_mb << 20,
            "nproc": max_processes,
            "fsize_bytes": max_file_mb << 20,
            "nofile": max_open_files,
        }
        if not session_wait_s >= 0:
            raise SandboxError(f"session_wait_s must be >= 0, got {session_wait_s!r}")
        self.session_wait_s = float(session_wait_s)
        worker_mb = worker_memory_mb or _default_worker_mb(n, memory_mb)
        reserved = reserved_mb or max(1, worker_mb // 8)
        if not 1 <= reserved <= worker_mb // 2:
            raise SandboxError(
                f"reserved_mb must be between 1 and worker_memory_mb / 2 = {worker_mb // 2}, got {reserved}"
            )
        cap = _MemoryCap(memory_cgroup if self.isolated else "off", worker_mb << 20, reserved << 20)
        self._size, self._mode = n, mode
        #: Whether :meth:`admit` may still size the sessions' reserved share (none was given).
        self._sizable = reserved_mb is None
        self._uid_base_arg = uid_base
        #: Root mode: the pool's uid range, reserved host-wide (see uid_blocks) until aclose.
        self._uids: uid_blocks.UidRange | None = None
        self._size_for(cap)
        self._tmp_dir: tempfile.TemporaryDirectory | None = None
        if self.isolated:
            iso.bwrap_path()
            iso.check_interpreter(python, ro_binds)
        else:
            msg = (
                "UNSAFE SANDBOX: model-written code will run WITHOUT isolation, as this user, with access to "
                "the network, your files and your processes. Use only for trusted code."
            )
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            self._tmp_dir = tempfile.TemporaryDirectory(prefix="agentrl-unsafe-sandbox-")
        self._settings = _Settings(
            mode=mode,
            python=python,
            ro_binds=ro_binds,
            limits=limits,
            output_cap=output_limit_bytes,
            seccomp=seccomp and self.isolated,
            tmpfs_bytes=tmpfs_mb << 20,
            tmpfs_inodes=tmpfs_files,
            start_timeout_s=start_timeout_s,
            memory_cap=cap,
            on_unhealthy=self._retire,
        )
        self._next_index = 0
        self._workers: list[_Worker] = []
        self._retiring: list[_Worker] = []
        self._refill()
        self._sessions: dict[str, _Session] = {}
        #: Live sessions, those being released included until their kernel is closed: at most max_sessions.
        self._held = 0
        #: Requests for a session's worker, first come first served: (session key, moving, future of its worker).
        self._waiters: collections.deque[tuple[str, bool, asyncio.Future[_Worker]]] = collections.deque()
        self._closed = False
        self._start_lock = asyncio.Lock()
        self._started = False

    def _refill(self) -> None:
        """Bring the pool back to full strength: a fresh worker for every missing one that a free uid block
        allows (by construction there always is one, see DEFAULT_UID_BASE)."""
        while len(self._workers) < self._size and self._free_blocks:
            index, self._next_index = self._next_index, self._next_index + 1
            settings = self._settings
            if self._tmp_dir is not None:
                root = Path(self._tmp_dir.name) / str(index)
                root.mkdir(exist_ok=True)
                settings = _Settings(**{**settings.__dict__, "tmp_root": str(root)})
            self._workers.append(_Worker(index, self._free_blocks.pop(0), settings))

    def _size_for(self, cap: _MemoryCap) -> None:
        """Set the sessions each worker and the pool admit from ``cap`` and reserve the uid blocks they need (see
        :data:`DEFAULT_UID_BASE`; in root mode host-wide, giving back any range held before)."""
        n = self._size
        #: Live sessions one worker admits, and the whole pool.
        self.max_sessions_per_worker = cap.max_sessions
        self.max_sessions = n * cap.max_sessions
        blocks = n * (cap.max_sessions + 1)  # see DEFAULT_UID_BASE
        span = blocks * _UIDS_PER_WORKER
        uid_base = self._uid_base_arg
        if self._uids is not None:
            self._uids.release()
            self._uids = None
        if self._mode == "root":
            self._uids = uid_blocks.reserve(DEFAULT_UID_BASE, _UID_RANGE, blocks, _UIDS_PER_WORKER, uid_base)
            uid_base = self._uids.base
        elif uid_base is None:
            uid_base = DEFAULT_UID_BASE + secrets.randbelow(_UID_RANGE // span) * span
        #: The uids code may run as (root mode): every block of the pool but each block's first uid, which is
        #: its worker's own.
        self.code_uids = CodeUids(uid_base, blocks)
        self._free_blocks = [uid_base + b * _UIDS_PER_WORKER for b in range(blocks)]

    def admit(self, sessions: int) -> int:
        """Let the pool admit ``sessions`` live sessions at once if its memory backs them; returns
        :attr:`max_sessions`.

        Before the pool starts, and when no ``reserved_mb`` was given, each session's reserved share is lowered
        from its default (an eighth of ``worker_memory_mb``) so that ``ceil(sessions / workers)`` sessions plus
        the stateless runs share each worker's memory cap, but never below :data:`MIN_RESERVED_MB` (the pool
        then admits what that floor allows). Every admitted session keeps a share its worker's cap backs, so the
        admission control that keeps one session's memory from ending another's is unchanged; only the share is
        smaller. Never lowers the capacity; otherwise (started, closed, or ``reserved_mb`` given) a no-op.
        Collectors call it (through :meth:`~agentrl.envs.tools.StatefulTool.request_sessions`) with the number of
        episodes they would run at once."""
        cap = self._settings.memory_cap
        if not self._sizable or self._started or self._closed or any(w.alive for w in self._workers):
            return self.max_sessions
        per_worker = -(-sessions // self._size)
        if per_worker <= cap.max_sessions:
            return self.max_sessions
        floor = min(MIN_RESERVED_MB << 20, cap.capacity_bytes // 2)
        reserved = max(floor, cap.capacity_bytes // (per_worker + 1))
        if reserved >= cap.reserved_bytes:
            return self.max_sessions
        sized = _MemoryCap(cap.mode, cap.capacity_bytes, reserved)
        try:
            self._size_for(sized)
        except SandboxError as exc:  # an explicit uid_base whose larger range another pool holds: keep the size
            log.warning("the sandbox pool keeps %d sessions: %s", self.max_sessions, exc)
            self._size_for(cap)
            return self.max_sessions
        self._settings.memory_cap = sized
        self._workers, self._next_index = [], 0
        self._refill()
        return self.max_sessions

    def _retire(self, worker: _Worker, reason: str) -> None:
        """Take an unhealthy worker out of rotation at once: it keeps serving its live sessions until they are
        released; a fresh worker takes its place (or, failing that, the next request's :meth:`_refill`)."""
        if worker.retired or self._closed:
            return
        worker.retired = True
        if worker in self._workers:
            self._workers.remove(worker)
        self._retiring.append(worker)
        log.warning("sandbox worker %d failed its health check (%s); replacing it", worker.index, reason)
        try:
            self._refill()
            self._reap_retired()
        except Exception:  # noqa: BLE001 - the worker is out of rotation whatever happens here
            log.exception("could not replace sandbox worker %d yet; the next request retries", worker.index)
        self._wake()

    def _reap_retired(self) -> None:
        """Kill retired workers whose last session is gone and give their uid blocks back."""
        for worker in [w for w in self._retiring if not w.sessions]:
            self._retiring.remove(worker)

            async def stop(w: _Worker = worker) -> None:
                async with w.lock:
                    await w.kill()
                # the block goes back only once nothing of it runs any more (a sandbox dies in the background)
                deadline = time.monotonic() + _BLOCK_RETURN_S
                while (busy := uid_processes(w.code_uids)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if busy:
                    log.error(
                        "processes %s of retired sandbox block %d survive; not reusing it",
                        busy[:5],
                        w.uid_base,
                    )
                    return
                self._free_blocks.append(w.uid_base)
                if not self._closed:
                    self._refill()
                    self._wake()

            task = asyncio.get_running_loop().create_task(stop())
            self._settings.background.add(task)
            task.add_done_callback(self._settings.background.discard)

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
        ``memory_mb`` lowers the memory limit of a stateless run below the pool's (never raises it; ignored for
        sessions, whose kernel keeps the pool's limit).
        """
        self._check_open()
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise SandboxError("code and stdin must be str")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise SandboxError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        if not self._started:
            await self.start()
        sess = None
        if session is not None:
            sess = self._sessions.get(session)
            if sess is None:
                raise SandboxError(f"unknown sandbox session {session!r}; create one with create_session()")
        payload = {
            "op": "run",
            "code": code,
            "stdin": stdin,
            "timeout": float(timeout_s),
            "session": sess.key if sess is not None else None,
            "files": {p: base64.b64encode(data).decode("ascii") for p, data in (files or {}).items()},
            "fetch_files": list(fetch_files),
            "memory_bytes": (memory_mb << 20) if memory_mb and memory_mb > 0 else None,
        }
        start = time.monotonic()
        retried = False
        for _ in range(3):  # a worker that refuses (it failed its health check) is replaced; try the next
            self._refill()
            if sess is None and not self._workers:
                return self._internal_error("no sandbox worker could be started", time.monotonic() - start)
            worker = sess.worker if sess is not None else min(self._workers, key=lambda w: w.load)
            worker.load += 1
            try:
                lost = sess is not None and sess.generation != worker.generation and worker.alive
                resp = await worker.call(payload, timeout_s)
            except BlockBusy as exc:  # its uids are still in use: replace it by a worker with a free block
                resp = {"refused": str(exc)}
            except WorkerLost as exc:  # died under the run (killed from outside, crashed): once more, afresh
                if exc.hung or retried:
                    log.warning("sandbox run failed: %s", exc)
                    return self._internal_error(str(exc), time.monotonic() - start)
                log.warning("sandbox run failed: %s; running it again on a fresh worker", exc)
                retried = True
                resp = {"refused": None}
            except (ConnectionError, SandboxUnavailable) as exc:  # the worker cannot restart
                log.warning("sandbox run failed: %s", exc)
                return self._internal_error(str(exc), time.monotonic() - start)
            finally:
                worker.load -= 1
            if "refused" not in resp:
                break
            if resp["refused"] is None:
                continue
            self._retire(worker, str(resp["refused"]))
            if (
                sess is not None
            ):  # its kernel is gone (else the worker would have served it): move the session
                worker.sessions.discard(sess.key)
                self._reap_retired()
                try:
                    sess.worker = await self._take_slot(sess.key, moving=True)
                except SandboxError as exc:
                    return self._internal_error(str(exc), time.monotonic() - start)
                sess.generation = -1  # its state is lost; say so
        else:
            return self._internal_error(
                "no healthy sandbox worker accepted the run", time.monotonic() - start
            )
        if sess is not None:
            lost = lost or sess.generation != worker.generation
            sess.generation = worker.generation
        return self._to_result(resp, state_lost=lost)

    def _open_worker(self, moving: bool = False) -> _Worker | None:
        """The worker for one more session, now: the least loaded one in rotation that admits another, while the
        pool holds fewer than :attr:`max_sessions` slots (a ``moving`` session holds one already); else None."""
        self._refill()
        open_workers = [w for w in self._workers if len(w.sessions) < self.max_sessions_per_worker]
        if (self._held >= self.max_sessions and not moving) or not open_workers:
            return None
        return min(open_workers, key=lambda w: (len(w.sessions), w.load))

    async def _take_slot(self, key: str, *, moving: bool = False) -> _Worker:
        """A worker for session ``key`` (the key added to its sessions): at once if there is room and nobody waits,
        else after the requests ahead of it, within :attr:`session_wait_s`; raises SandboxError when none frees in
        time. A new session takes one of the pool's slots (:attr:`_held`), which it holds until its kernel is
        closed; a ``moving`` one (its worker left rotation) keeps its own and goes ahead of every waiting one."""
        worker = None if self._waiters and not moving else self._open_worker(moving)
        if worker is not None:
            worker.sessions.add(key)
            self._held += not moving
            return worker
        if self.session_wait_s <= 0:
            raise self._full_error()
        entry = (key, moving, asyncio.get_running_loop().create_future())
        self._waiters.appendleft(entry) if moving else self._waiters.append(entry)
        future = entry[2]
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.session_wait_s)
        except asyncio.TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                return future.result()  # admitted at the last moment
            raise self._full_error() from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().sessions.discard(key)  # admitted, never used: no kernel to close
                self._held -= not moving
                self._wake()
            raise
        finally:
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def _wake(self) -> None:
        """Hand freed room to the waiting requests, in order."""
        while self._waiters:
            key, moving, future = self._waiters[0]
            if future.done():  # timed out or cancelled
                self._waiters.popleft()
                continue
            worker = self._open_worker(moving)
            if worker is None:
                return
            self._waiters.popleft()
            worker.sessions.add(key)
            self._held += not moving
            future.set_result(worker)

    def _full_error(self) -> SandboxError:
        held = self._held
        if held < self.max_sessions:  # room in the pool, but not on any worker in rotation
            why = (
                f"no worker in rotation has room ({len(self._workers)} of {self._size} in rotation, "
                f"{len(self._retiring)} retired ones still hold uid blocks)"
            )
        else:
            why = "no session was released"
        return SandboxError(
            f"the sandbox pool is full: {held} live sessions, at most {self.max_sessions_per_worker} per worker, "
            f"each guaranteed {self._settings.memory_cap.reserved_bytes >> 20} MiB; {why} within "
            f"session_wait_s={self.session_wait_s:g} s. Release finished sessions with release_session(), keep "
            "the sessions in use at most max_sessions, or raise workers or worker_memory_mb, or lower reserved_mb"
        )

    async def create_session(self) -> str:
        """Reserve a stateful session (its kernel starts on the first run) and return its id. When the pool holds
        :attr:`max_sessions` sessions, waits for a slot (first come, first served) up to :attr:`session_wait_s`,
        then raises SandboxError."""
        self._check_open()
        if not self._started:
            await self.start()
        sid = uuid.uuid4().hex
        worker = await self._take_slot(sid)
        if self._closed:
            raise SandboxError("this sandbox backend is closed")
        self._sessions[sid] = _Session(worker, sid, worker.generation)
        return sid

    async def release_session(self, session: str) -> None:
        """Kill the session's kernel; the worker then verifies that nothing of it remains before its uid is
        used again. The session's slot frees once its kernel is closed, even if this call is cancelled. Unknown
        or already released ids are ignored."""
        sess = self._sessions.pop(session, None)
        if sess is None or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._close_session(sess))
        self._settings.background.add(task)
        task.add_done_callback(self._settings.background.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not (task.cancelled() and self._closed):  # aclose() ended it: nothing is left to release
                raise

    async def _close_session(self, sess: _Session) -> None:
        worker = sess.worker
        try:
            if worker.alive:
                await worker.call({"op": "close", "session": sess.key}, 10.0)
        except (ConnectionError, SandboxUnavailable):
            pass  # the worker is gone, and the kernel with it
        finally:
            worker.sessions.discard(sess.key)
            self._held -= 1
            if not self._closed:
                if worker.retired:
                    self._reap_retired()
                self._wake()

    async def aclose(self) -> None:
        """Kill every worker and session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sessions.clear()
        while self._waiters:
            _, _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(SandboxError("this sandbox backend is closed"))
        await asyncio.gather(*(w.kill() for w in self._workers + self._retiring))
        background = list(self._settings.background)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)  # none is left pending for the GC to finalise
        if self._tmp_dir is not None:
            self._tmp_dir.cleanup()
        if self._uids is not None:
            self._uids.release()

    async def __aenter__(self) -> LocalSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def health(self) -> list[dict[str, Any]]:
        """Each worker's state once its pending cleanup is done: ``index``, ``alive``, ``retired``, ``sessions``
        (live ones it holds) and ``last`` (its latest health frame: ``health``, ``problems``, ``cleanup_s``)."""
        out = []
        for worker in self._workers + self._retiring:
            async with worker.lock:
                out.append(
                    {
                        "index": worker.index,
                        "alive": worker.alive,
                        "retired": worker.retired,
                        "sessions": len(worker.sessions),
                        "last": dict(worker.last_health),
                    }
                )
        return out

    @property
    def num_workers(self) -> int:
        """Number of sandboxes in the pool (in rotation)."""
        return len(self._workers)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("this sandbox backend is closed")

    def _internal_error(self, detail: str, duration: float) -> ExecResult:
        return ExecResult(
            "", "", None, "sandbox_error", duration, message=self.messages.render("internal", detail=detail)
        )

    def _to_result(self, resp: dict[str, Any], *, state_lost: bool) -> ExecResult:
        problem = _invalid_reply(resp)
        if problem is not None:
            log.error("sandbox worker sent an invalid reply (%s): %.500r", problem, resp)
            return self._internal_error(f"invalid worker reply: {problem}", 0.0)
        notes = []
        if state_lost and not resp["reset"]:
            notes.append(self.messages.render("state_lost"))
        event = resp["event"]
        if event is not None:
            kind = event["kind"]
            fields = {k: v for k, v in event.items() if k != "kind"}
            if kind == "internal":
                log.warning("sandbox internal failure: %s", fields.get("detail"))
            notes.append(self.messages.render(kind, **fields))
        if resp["reset"]:
            notes.append(self.messages.render("kernel_reset"))
        if resp["evicted"] is not None:
            notes.append(self.messages.render("evicted", **resp["evicted"]))
        return ExecResult(
            stdout=resp["stdout"],
            stderr=resp["stderr"],
            exit_code=resp["exit_code"],
            status=resp["status"],
            duration_s=float(resp["duration_s"]),
            truncated=resp["truncated"],
            display=resp["display"],
            message="; ".join(n for n in notes if n),
            files=resp["files"],
            error=resp["error"],
        )


_EVENT_FIELDS = {
    "timeout": {"timeout_s": (int, float)},
    "cpu_limit": {},
    "signal": {"signal": str},
    "memory": {"memory_mb": int},
    "worker_memory": {"limit_mb": int, "memory_mb": int, "worker_mb": int},
    "corrupted": {},
    "internal": {"detail": str},
}


def _invalid_reply(resp: dict[str, Any]) -> str | None:
    """Why a worker's run reply does not match its schema exactly, or None. (Stdlib only: the pool also runs
    under a bare system Python.)"""
    expected = {
        "stdout": str,
        "stderr": str,
        "status": str,
        "duration_s": float,
        "truncated": bool,
        "reset": bool,
        "files": dict,
    }
    if set(resp) != {*expected, "exit_code", "display", "event", "error", "evicted"}:
        return f"fields {sorted(resp)}"
    evicted = resp["evicted"]
    if evicted is not None and not (
        type(evicted) is dict
        and set(evicted) == {"held_mb", "reserved_mb"}
        and all(type(v) is int for v in evicted.values())
    ):
        return "evicted"
    for key, kind in expected.items():
        if type(resp[key]) is not kind:
            return f"{key} is {type(resp[key]).__name__}"
    if resp["status"] not in STATUSES:
        return f"status {resp['status']!r}"
    if resp["exit_code"] is not None and type(resp["exit_code"]) is not int:
        return "exit_code"
    if resp["display"] is not None and type(resp["display"]) is not str:
        return "display"
    if not all(type(k) is str and (v is None or type(v) is str) for k, v in resp["files"].items()):
        return "files"
    error = resp["error"]
    if error is not None and not (
        type(error) is dict
        and set(error) == {"ename", "evalue"}
        and all(type(v) is str for v in error.values())
    ):
        return "error"
    event = resp["event"]
    if event is not None:
        if type(event) is not dict or event.get("kind") not in _EVENT_FIELDS:
            return "event"
        fields = _EVENT_FIELDS[event["kind"]]
        if set(event) != {"kind", *fields} or not all(isinstance(event[k], t) for k, t in fields.items()):
            return "event fields"
    return None


def unsafe_local(**kwargs: Any) -> LocalSandbox:
    """The local pool WITHOUT isolation (``make_backend("unsafe_local")``): trusted code only; warns loudly."""
    return LocalSandbox(isolation="none", **kwargs)
