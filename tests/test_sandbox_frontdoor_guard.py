"""The front door, guarded: the retool env end to end with the real local sandbox at the held-out
evaluation's concurrency, as ``agentrl train env=retool`` runs it, loses no episode to the sandbox.

128 held-out tasks go through :func:`agentrl.episodes.collect` over 128 envs sharing one default local pool
(the trainer's path; the pool admits fewer sessions than that on a small machine), driven by the scripted teacher
that SFT uses (one python call with the task's program, then the boxed output; no model). Every episode must
finish without an infrastructure error: no episode error, no tool error, no tool result that mentions the sandbox
or a full pool, tool success 1.0 and every answer right. The same must hold when a worker is killed in the middle
of the collection, and when 128 episodes ask for sessions at once with nothing bounding them (they queue). And as
the trainer builds it (envs naming the ``"local"`` backend, a pool of 64 envs asking for 64 sessions before the
sandbox starts), the pool admits them: the evaluation samples 64 episodes at a time, as before admission control.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import replace

import pytest

from agentrl.envs.builtin.retool import ReToolEnv, ReToolScriptedTeacher
from agentrl.envs.sandbox import SandboxError, make_backend
from agentrl.envs.sandbox.local import MIN_RESERVED_MB
from agentrl.episodes import EnvPool, EpisodeJob, EpisodeResult, collect, run_episode
from agentrl.harmony import HarmonyFormat

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

EPISODES = 128  # the held-out evaluation's size (eval.num_tasks); its concurrency is at most this
INFRA_WORDS = ("pool is full", "sandbox", "worker", "internal")
MARK = "the slow one"


def _recording(worker):
    """``worker._send`` that also keeps the code of the last request in ``worker.sent``."""
    send = worker._send
    worker.sent = ""

    def record(payload):
        worker.sent = payload.get("code") or ""
        send(payload)

    return record


@pytest.fixture(scope="module")
def fmt():
    return HarmonyFormat()


@pytest.fixture(scope="module")
def tasks():
    return ReToolEnv.tasks("test", n=EPISODES, seed=0)


@pytest.fixture
async def backend():
    try:
        sb = make_backend("local")  # the main job's pool: every setting at its default
        await sb.run("1", timeout_s=10)
    except SandboxError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    yield sb
    await sb.aclose()


def _jobs(tasks):
    return [EpisodeJob(dict(t), i, t["id"], i) for i, t in enumerate(tasks)]


def _check(results: list[EpisodeResult], n: int = EPISODES) -> None:
    assert len(results) == n
    problems = []
    calls = ok_calls = 0
    for r in results:
        records = [rec for turn in r.trajectory.turns for rec in turn.tools]
        calls += len(records)
        ok_calls += sum(rec.error is None for rec in records)
        bad = [rec.result for rec in records if rec.error or any(w in rec.result.lower() for w in INFRA_WORDS)]
        if r.error or bad or r.trajectory.reward != 1.0:
            problems.append((r.task_id, r.error, r.stop_reason, bad[:1], r.trajectory.reward))
    assert not problems, f"{len(problems)} of {n} episodes hit the infrastructure, e.g. {problems[:3]}"
    assert calls == n and ok_calls == calls  # tool success 1.0


async def test_held_out_concurrency_loses_no_episode_even_when_a_worker_dies(fmt, tasks, backend):
    def make_env():
        return ReToolEnv(format=fmt, sandbox=backend, max_turns=2)

    pool = EnvPool(make_env, EPISODES)
    try:
        _check(await collect(pool, ReToolScriptedTeacher(), _jobs(tasks)))
        assert 1 <= pool.in_flight <= backend.max_sessions

        # One episode's program first sleeps; once its run is in flight, its worker is SIGKILLed (its sandbox dies
        # with every kernel in it) while the other workers go on serving.
        slow = EPISODES // 4
        jobs = _jobs(tasks)
        task = dict(jobs[slow].task, code=f"import time\ntime.sleep(2)  # {MARK}\n" + jobs[slow].task["code"])
        jobs[slow] = replace(jobs[slow], task=task)
        for w in backend._workers:
            w._send = _recording(w)
        killed = []

        async def kill_the_slow_run() -> None:
            while not (busy := [w for w in backend._workers if MARK in w.sent and w.alive and w.lock.locked()]):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            killed.append(busy[0].index)
            os.killpg(busy[0].proc.pid, 9)

        killer = asyncio.get_running_loop().create_task(kill_the_slow_run())
        _check(await collect(pool, ReToolScriptedTeacher(), jobs))
        assert killer.done() and killed
    finally:
        await pool.aclose()


async def test_unbounded_session_requests_wait_for_a_slot_instead_of_failing(fmt, tasks, backend):
    """Nothing bounds these 128 episodes to the pool's capacity: the sessions beyond it wait for released ones."""
    if backend.max_sessions >= EPISODES:
        pytest.skip(f"this machine's pool admits {backend.max_sessions} sessions: nothing would wait")
    envs = [ReToolEnv(format=fmt, sandbox=backend, max_turns=2) for _ in range(EPISODES)]
    teacher = ReToolScriptedTeacher()
    try:
        results = await asyncio.gather(
            *(run_episode(env, teacher, task=dict(t), seed=i) for i, (env, t) in enumerate(zip(envs, tasks, strict=True)))
        )
        _check(list(results))
    finally:
        for env in envs:
            await env.aclose()


async def test_the_trainers_pool_gets_its_64_episodes_in_flight_with_every_session_backed(fmt, tasks, backend):
    """The trainer's envs name the backend (one shared pool, created on first use); its pool of 64 envs (rollout.
    concurrency) asks for 64 sessions before the sandbox starts, and a machine whose memory backs them at
    MIN_RESERVED_MB each runs all 64 at once (this box: 6 workers x 11 sessions of 167 MiB, instead of 7 of 251)."""
    pool = EnvPool(lambda: ReToolEnv(format=fmt, sandbox="local", max_turns=2), 64)
    try:
        in_flight = await pool.open()
        shared = await pool._envs[0].toolbox.tools["python"].backend()
        assert shared is not backend and in_flight == min(64, shared.max_sessions)
        cap = shared._settings.memory_cap
        assert cap.reserved_bytes >= MIN_RESERVED_MB << 20  # what every admitted session is guaranteed
        assert shared.max_sessions == shared.num_workers * (cap.capacity_bytes // cap.reserved_bytes - 1)
        if cap.capacity_bytes // (-(-64 // shared.num_workers) + 1) >= MIN_RESERVED_MB << 20:
            assert in_flight == 64  # the memory backs them: nothing bounds the evaluation below its concurrency
        _check(await collect(pool, ReToolScriptedTeacher(), _jobs(tasks)))
    finally:
        await pool.aclose()


async def test_agentrl_eval_sizes_its_pool_for_its_concurrency_before_starting_it(backend):
    """``agentrl eval`` builds one started pool for all its envs: it asks it first for ``concurrency`` sessions
    (at most one per episode of the run), so its collection keeps that many in flight where the memory backs them."""
    import contextlib

    pytest.importorskip("torch")
    from agentrl.evaluation import EvalConfig
    from agentrl.evaluation.policies import open_runner

    async with contextlib.AsyncExitStack() as stack:
        cfg = EvalConfig(env="retool", model="tiny-gpt-oss", max_new_tokens=2, concurrency=64, limit=EPISODES)
        runner = await open_runner(cfg, stack)
        sb = runner.env_kwargs["sandbox"]
        cap = sb._settings.memory_cap
        assert sb._started and cap.reserved_bytes >= MIN_RESERVED_MB << 20
        if cap.capacity_bytes // (-(-64 // sb.num_workers) + 1) >= MIN_RESERVED_MB << 20:
            assert sb.max_sessions >= 64
        small = await open_runner(replace(cfg, limit=4), stack)  # 4 episodes: no share is lowered for them
        assert small.env_kwargs["sandbox"].max_sessions == backend.max_sessions
