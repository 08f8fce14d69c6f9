"""Admission to the local sandbox pool: a session request beyond the pool's
capacity waits its turn (first come, first served) and fails only after ``session_wait_s``; a released session
keeps its slot until its kernel is closed; a cancelled request takes no slot; a cancelled run finishes in the
background without harming its worker; and waiting for a worker never counts as a python call's run time, so
legal long calls on one worker never wipe another episode's state."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from agentrl.envs.sandbox import SandboxError, SyncSandbox, make_backend
from agentrl.envs.tools.dispatch import Sessions, ToolBox
from agentrl.envs.tools.python import PythonTool
from agentrl.harmony.types import ToolCall

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)


@pytest.fixture
async def pool():
    """One worker admitting 3 sessions (256 MiB, 64 MiB guaranteed to each session and to the stateless runs)."""
    try:
        sb = make_backend("local", workers=1, memory_mb=64, worker_memory_mb=256, reserved_mb=64, session_wait_s=30)
        await sb.run("1", timeout_s=10)
    except SandboxError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    assert sb.max_sessions == 3
    yield sb
    await sb.aclose()


def _call(code: str) -> ToolCall:
    return ToolCall("python", "python", {"code": code}, code)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_waiting_requests_are_admitted_in_order_as_sessions_are_released(pool):
    held = [await pool.create_session() for _ in range(3)]
    waiting = []
    for _ in range(3):
        waiting.append(asyncio.create_task(pool.create_session()))
        await _settle()
    assert not any(t.done() for t in waiting)
    for i in range(3):
        await pool.release_session(held[i])
        await _settle()
        assert [t.done() for t in waiting] == [j <= i for j in range(3)]
    sids = [t.result() for t in waiting]
    for sid in sids:  # the admitted sessions work
        assert (await pool.run("print(7)", session=sid)).stdout == "7\n"
        await pool.release_session(sid)


async def test_a_request_fails_after_session_wait_s_and_a_cancelled_one_takes_no_slot(pool):
    held = [await pool.create_session() for _ in range(3)]
    pool.session_wait_s = 0.05
    with pytest.raises(SandboxError, match="pool is full: 3 live sessions.*no session was released within "
                                           "session_wait_s=0.05 s.*release_session"):
        await pool.create_session()
    pool.session_wait_s = 30
    cancelled = asyncio.create_task(pool.create_session())
    after = asyncio.create_task(pool.create_session())
    await _settle()
    cancelled.cancel()
    await pool.release_session(held[0])
    sid = await after  # the cancelled request, ahead of it, took nothing
    assert sum(len(w.sessions) for w in pool._workers) == 3
    for s in [*held[1:], sid]:
        await pool.release_session(s)
    assert sum(len(w.sessions) for w in pool._workers) == 0


async def test_a_released_session_keeps_its_slot_until_its_kernel_is_closed(pool):
    held = [await pool.create_session() for _ in range(3)]
    assert (await pool.run("x = 1", session=held[0])).ok
    worker = pool._workers[0]
    await worker.lock.acquire()  # the worker is busy: the kernel cannot be closed yet
    try:
        release = asyncio.create_task(pool.release_session(held[0]))
        waiter = asyncio.create_task(pool.create_session())
        await _settle()
        assert not release.done() and not waiter.done()
    finally:
        worker.lock.release()
    await release
    sid = await waiter
    for s in [*held[1:], sid]:
        await pool.release_session(s)


async def test_a_cancelled_run_finishes_in_the_background_and_spares_the_other_sessions(pool):
    keeper, victim = await pool.create_session(), await pool.create_session()
    assert (await pool.run("x = 42", session=keeper)).ok
    worker = pool._workers[0]
    generation = worker.generation
    run = asyncio.create_task(pool.run("import time\ntime.sleep(1)\ny = 1", session=victim, timeout_s=10))
    while not worker.lock.locked():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # its request is out (a cancel while it still waits for the worker proves less)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    kept = await pool.run("print(x)", session=keeper)
    assert kept.stdout == "42\n" and not kept.message, kept
    assert worker.generation == generation and worker.alive
    assert (await pool.run("print(y)", session=victim)).stdout == "1\n"  # the cancelled call ran to its end
    for s in (keeper, victim):
        await pool.release_session(s)


async def test_long_legal_calls_queued_on_one_worker_never_wipe_another_episodes_state():
    """Eight calls of 0.8 s each (within the tool's 1 s limit) queue on one worker: the last waits about 5.6 s,
    more than the dispatcher's old limit of the run's timeout + 5 s. None times out, and the state of a fifth
    episode on the same worker survives."""
    try:
        sb = make_backend("local", workers=1, memory_mb=64, worker_memory_mb=640, reserved_mb=32)
        await sb.run("1", timeout_s=10)
    except SandboxError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    box = ToolBox([PythonTool(sb, exec_timeout_s=1.0)])
    keeper = Sessions()
    try:
        assert (await box.call(_call("x = 42"), keeper)).error is None
        episodes = [Sessions() for _ in range(8)]
        records = await asyncio.gather(
            *(box.call(_call("import time\ntime.sleep(0.8)\nprint('ok')"), s) for s in episodes)
        )
        assert [(r.error, r.result) for r in records] == [(None, "ok")] * 8
        kept = await box.call(_call("print(x)"), keeper)
        assert (kept.error, kept.result) == (None, "42")
        for s in [keeper, *episodes]:
            await s.release_all()
    finally:
        await box.aclose()
        await sb.aclose()


async def test_a_request_waits_while_no_worker_is_in_rotation_and_gets_the_replacement(pool):
    """A run that once failed: a worker left rotation while it held a session, and no uid block was free for its
    replacement yet, so new sessions were refused at once ("pool is full: 1 live sessions"). They now wait until a
    replacement worker can start."""
    sid = await pool.create_session()
    assert (await pool.run("x = 1", session=sid)).ok
    spare, pool._free_blocks[:] = list(pool._free_blocks), []
    pool._retire(pool._workers[0], "a failed health check, made up for this test")
    assert not pool._workers
    waiter = asyncio.create_task(pool.create_session())
    await _settle()
    assert not waiter.done()
    pool._free_blocks.extend(spare)
    await pool.release_session(sid)  # the retired worker's last session: it goes, its replacement comes
    new = await waiter
    assert (await pool.run("print(5)", session=new)).stdout == "5\n"
    await pool.release_session(new)


async def test_a_pool_not_started_admits_the_sessions_a_collector_asks_for_within_its_memory():
    """admit(n) before the pool starts lowers each session's reserved share (never below MIN_RESERVED_MB) so that
    n sessions fit the workers' memory caps; every admitted session runs, and one more still waits its turn."""
    from agentrl.envs.sandbox.local import MIN_RESERVED_MB

    sb = make_backend("local", workers=2, memory_mb=64, worker_memory_mb=2048, session_wait_s=0.05)
    try:
        assert sb.max_sessions == 14  # 7 a worker, each guaranteed 2048 / 8 = 256 MiB
        assert sb.admit(10) == 14  # never lowers the capacity
        assert sb.admit(30) == 30 and sb.max_sessions_per_worker == 15
        cap = sb._settings.memory_cap
        assert cap.reserved_bytes == MIN_RESERVED_MB << 20 and cap.max_sessions == 15
        assert sb.code_uids.blocks == 2 * 16 and len(sb._workers) == 2  # uid blocks for the larger pool
        assert sb.admit(1000) == 30  # the floor: what the memory backs
        try:
            sids = [await sb.create_session() for _ in range(30)]
        except SandboxError as e:
            pytest.skip(f"local sandbox unavailable: {e}")
        results = await asyncio.gather(*(sb.run(f"x = {i}\nprint(x)", session=s) for i, s in enumerate(sids)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(30)]
        with pytest.raises(SandboxError, match=f"pool is full: 30 live sessions, at most 15 per worker, each "
                                               f"guaranteed {MIN_RESERVED_MB} MiB"):
            await sb.create_session()
        assert sb.admit(60) == 30  # started: the sizes stay
    finally:
        await sb.aclose()


async def test_admit_keeps_a_given_reserved_share_and_a_started_pool_as_they_are(pool):
    assert pool.admit(10) == 3  # reserved_mb given, and started
    sized = make_backend("local", workers=1, memory_mb=64, worker_memory_mb=2048, reserved_mb=512)
    try:
        assert sized.max_sessions == 3 and sized.admit(10) == 3
    finally:
        await sized.aclose()


def test_a_closed_pool_leaves_no_task_pending_for_the_gc():
    """Closing the pool awaits every task it started (workers' stderr readers, cancelled runs' cleanups, reaps)
    before its loop stops: a task left pending is finalised later by the garbage collector, inside whatever
    code runs then (on Python 3.11 that broke an unrelated ``ast.parse`` in the suite: "AST constructor
    recursion depth mismatch")."""
    try:
        box = SyncSandbox("local", workers=2, memory_mb=64, worker_memory_mb=256, reserved_mb=64)
        box.run("1", timeout_s=10)
    except SandboxError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    sid = box.create_session()
    box.run("import os\nos._exit(3)", session=sid, timeout_s=10)  # its worker is lost: abandoned and replaced
    assert box.run("print(1)").ok
    loop = box._loop
    box.close()
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
