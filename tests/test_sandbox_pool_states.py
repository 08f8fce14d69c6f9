"""Availability of the local sandbox pool under random sequences of hostile runs and sessions.

A hypothesis state machine drives one pool with stateless runs and session calls drawn from a set of attacks
(processes left behind, unix-socket garbage, memory parked in tmpfs, queues hoarded, forged channels, timeouts),
opens and releases sessions, and, as root, fakes an escape from the host side so that a worker fails its health
check while it holds sessions. After every step: the pool is at full strength with no retired worker in rotation,
every worker answers a plain run, and a new session is admitted whenever the pool has room for one. When the
sequence ends and its sessions are released, the retired workers are gone and no task of any code uid is left.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import textwrap
import time

import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_sandbox_attacks import MQ_HOG, SOCKET_CYCLE, ZOMBIE_LEADER, code_tasks

from agentrl.envs.sandbox import SandboxError, SyncSandbox

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

AS_ROOT = os.geteuid() == 0
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

WORKERS = 2
ATTACKS = {
    "benign": "print('fine')",
    "zombie_leader": textwrap.dedent(ZOMBIE_LEADER.format(action="pass")),
    "socket_garbage": textwrap.dedent(SOCKET_CYCLE),
    "process_swarm": "import os, time\nfor _ in range(12):\n    if os.fork() == 0:\n        os.setpgid(0, 0); time.sleep(100)\nprint('forked')",
    "fill_tmp": "i = 0\ntry:\n    while True:\n        open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20)); i += 1\nexcept OSError:\n    print('full')",
    "park_shm": "for i in range(24):\n    open(f'/dev/shm/p{i}', 'wb').write(b'p' * (1 << 20))",
    "memory_hog": "x = []\nwhile True:\n    x.append(bytearray(8 << 20))",
    "queue_hoard": textwrap.dedent(MQ_HOG),
    "fake_internal_failure": "import os\nos._exit(71)",
    "close_channels": "import os\nos.closerange(0, 64)",
    "forge_frame": "import os, struct\nbody = b'S0 ok'\nos.write(4 if 'kept' in globals() else 3, struct.pack('>I', len(body)) + body)",
    "spin": "while True:\n    pass",
}
attacks = st.sampled_from(sorted(ATTACKS))


class PoolUnderAttack(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.box = SyncSandbox(
            "local", workers=WORKERS, memory_mb=96, tmpfs_mb=32, max_processes=24, output_limit_bytes=4096,
            session_wait_s=0,  # a full pool refuses at once (the queue is tested in test_sandbox_admission.py)
        )
        self.pool = self.box._backend
        self.sessions: list[str] = []

    def run(self, code: str, **kw):
        # generous for all but the attacks that use up their time (a busy shared machine is slow to start)
        timeout = 1.0 if code in (ATTACKS["spin"], ATTACKS["memory_hog"]) else 10.0
        r = self.box.run(code, timeout_s=timeout, **kw)
        note(
            f"run{' in a session' if kw.get('session') else ''} {code[:40]!r}: {r.status} {r.message[:80]!r}"
        )
        assert r.status != "sandbox_error", r  # every attack is the code's own business
        return r

    @rule(attack=attacks)
    def stateless(self, attack: str) -> None:
        self.run(ATTACKS[attack])

    @precondition(lambda self: len(self.sessions) < self.pool.max_sessions)
    @rule()
    def open_session(self) -> None:
        sid = self.box.create_session()
        self.sessions.append(sid)
        assert self.run("kept = 1", session=sid).ok

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 100), attack=attacks)
    def session_call(self, index: int, attack: str) -> None:
        self.run(ATTACKS[attack], session=self.sessions[index % len(self.sessions)])

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        self.box.release_session(self.sessions.pop(index % len(self.sessions)))

    @precondition(lambda self: AS_ROOT and shutil.which("nsenter") is not None)
    @rule(index=st.integers(0, WORKERS - 1))
    def escape_from_the_host(self, index: int) -> None:
        """Leave a file in a worker's own (read-only, never used) /dev/shm, as an escape would: it must fail its
        health check after the next request and leave rotation, keeping its sessions."""
        from test_sandbox_isolation import _worker_pid

        worker = self.pool._workers[index]
        if not worker.alive:
            self.run("print(1)")
        if worker.alive:
            script = "mount -t tmpfs none /dev/shm && echo x > /dev/shm/escaped"
            subprocess.run(
                ["nsenter", f"--mount=/proc/{_worker_pid(worker)}/ns/mnt", "sh", "-c", script], check=True
            )
            self.run("print(2)")

    @invariant()
    def full_strength(self) -> None:
        states = self.box._loop.run_until_complete(self.pool.health())
        assert len(self.pool._workers) == WORKERS, states
        assert not any(w.retired for w in self.pool._workers), states
        for i in range(WORKERS):
            r = self.box.run(f"print({i})", timeout_s=5)
            assert r.ok and r.stdout == f"{i}\n", (r, states)

    @invariant()
    def admits_while_there_is_room(self) -> None:
        if len(self.sessions) < self.pool.max_sessions:
            sid = self.box.create_session()
            self.box.release_session(sid)
        else:
            with pytest.raises(SandboxError, match="pool is full"):
                self.box.create_session()

    def teardown(self) -> None:
        try:
            for sid in self.sessions:
                self.box.release_session(sid)
            deadline = time.monotonic() + 15
            while self.pool._retiring and time.monotonic() < deadline:
                self.box._loop.run_until_complete(asyncio.sleep(0.05))
            assert not self.pool._retiring and len(self.pool._workers) == WORKERS
            assert all(self.box.run("print(0)").ok for _ in range(WORKERS))
            if AS_ROOT:
                deadline = time.monotonic() + 5
                while (left := code_tasks(self.box)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert left == []
        finally:
            self.box.close()


def test_random_hostile_sequences_never_disable_the_pool():
    run_state_machine_as_test(
        PoolUnderAttack,
        settings=settings(
            max_examples=3,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,  # the same sequences in every CI run; the slow test below explores
        ),
    )


@pytest.mark.slow
def test_random_hostile_sequences_never_disable_the_pool_longer():
    run_state_machine_as_test(
        PoolUnderAttack,
        settings=settings(
            max_examples=25,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )
