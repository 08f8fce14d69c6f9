"""A failure of a tool's backend (the sandbox pool admits no session, a worker is lost) is never the model's
failure: the env ends the episode at once as ``infrastructure``, unscored; collection runs it again; what still
fails is left out of training and of the evaluation's score, counted, and its traceback goes to ``errors.log``."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from _scripted_engine import ScriptedEngine, TrainerEngine, scripted_verl_agent_loop

import agentrl.envs.registry as registry
from agentrl.engines.base import SamplingParams
from agentrl.envs import AgentEnv
from agentrl.envs.sandbox.base import ExecResult, SandboxError
from agentrl.envs.tools.base import StatefulTool, Tool, ToolInfrastructureError
from agentrl.envs.tools.python import PythonTool
from agentrl.episodes import EnvPool, EpisodeJob, TokenPolicy, collect
from agentrl.episodes import runner as episode_runner
from agentrl.harmony import HarmonyFormat, Message, Trajectory

FMT = HarmonyFormat()
ENV = "infra-flaky"
SAMPLING = SamplingParams(max_new_tokens=200)


class FakeSandbox:
    """A sandbox backend whose first ``full`` session requests are refused as a full pool and whose first
    ``lost`` runs come back as ``sandbox_error`` (a lost worker); code containing ``raise`` fails as code does."""

    def __init__(self, full: int = 0, lost: int = 0) -> None:
        self.full, self.lost, self.sessions = full, lost, 0

    async def create_session(self) -> str:
        if self.full > 0:
            self.full -= 1
            raise SandboxError("the sandbox pool is full: 42 live sessions, at most 7 per worker")
        self.sessions += 1
        return f"s{self.sessions}"

    async def release_session(self, session: str) -> None:
        pass

    async def run(self, code: str, *, session=None, timeout_s: float = 10.0, stdin: str = "") -> ExecResult:
        if self.lost > 0:
            self.lost -= 1
            return ExecResult("", "", None, "sandbox_error", 0.0, message="sandbox worker 1 died")
        if "down" in code:  # this worker is always lost
            return ExecResult("", "", None, "sandbox_error", 0.0, message="sandbox worker 2 died")
        if "raise" in code:
            return ExecResult("", "ValueError: bad\n", 1, "error", 0.0, error={"ename": "ValueError", "evalue": "bad"})
        return ExecResult("42\n", "", 0, "ok", 0.0)

    async def aclose(self) -> None:
        pass


#: the backend every FlakyEnv's python tool uses (a test sets it)
BACKEND = FakeSandbox()


class FlakyEnv(AgentEnv):
    """Compute with python, answer in \\boxed{}; the python tool runs on :data:`BACKEND`."""

    def make_tools(self):
        return [PythonTool(BACKEND)]

    @classmethod
    def generate_task(cls, rng, split="train"):
        return {"prompt": f"compute 6*7 (#{int(rng.integers(1000))})", "answer": "42"}

    def reward(self, ctx):
        ok = ctx.final is not None and "\\boxed{42}" in ctx.final
        return float(ok), {"correct": float(ok)}


def script(prompt: str, sampling) -> list[Message]:
    """Call python once, then answer what it printed."""
    if "<|start|>python to=assistant" not in prompt:
        request = prompt.rsplit("<|start|>user", 1)[1]
        code = "raise" if "raise" in request else ("down" if "down" in request else "print(6*7)")
        return [Message("assistant", code, channel="analysis", recipient="python")]
    return [Message("assistant", "\\boxed{42}", channel="final")]


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    registry.register(ENV, f"{__name__}:FlakyEnv")
    monkeypatch.setattr(episode_runner, "INFRA_RETRY_DELAY_S", 0.0)
    global BACKEND
    BACKEND = FakeSandbox()


def _policy():
    return TokenPolicy(ScriptedEngine(FMT, script), SAMPLING)


async def _run(env: AgentEnv, task: dict):
    """One episode of ``env`` on ``task`` with the scripted policy (an :class:`~agentrl.episodes.EpisodeResult`)."""
    from agentrl.episodes import run_episode

    return await run_episode(env, _policy(), task=task)


TASK = {"prompt": "compute 6*7", "answer": "42"}


# ----------------------------------------------------------------------------- the env and the tool


async def test_a_full_pool_ends_the_episode_as_infrastructure_unscored():
    global BACKEND
    BACKEND = FakeSandbox(full=1)
    env = FlakyEnv(format=FMT)
    result = await _run(env, TASK)
    traj = result.trajectory
    assert result.stop_reason == traj.stop_reason == "infrastructure" and result.infrastructure
    assert traj.truncated and not traj.terminated and traj.reward == 0.0 and traj.reward_components == {}
    assert traj.errors == {"tool_infrastructure": 1} and traj.error_counts() == {"tool_infrastructure": 1}
    assert "the sandbox pool is full" in traj.error and traj.infrastructure_error == traj.error
    assert result.error == traj.error and not result.usable
    assert "SandboxError" in result.traceback and "Traceback" in result.traceback  # for errors.log
    assert len(result.steps) == 1 and result.steps[-1].info["infrastructure_error"] == traj.error
    (rec,) = traj.turns[0].tools
    assert rec.error == "tool_infrastructure"
    # the record survives serialisation
    again = Trajectory.from_json(traj.to_json())
    assert again.infrastructure_error == traj.error
    await env.aclose()


async def test_a_lost_worker_is_infrastructure_but_the_models_code_failing_is_not():
    global BACKEND
    BACKEND = FakeSandbox(lost=1)
    env = FlakyEnv(format=FMT)
    lost = await _run(env, TASK)
    assert lost.stop_reason == "infrastructure" and "sandbox worker 1 died" in lost.trajectory.error
    raised = await _run(env, {"prompt": "compute raise", "answer": "42"})  # the worker is back; the code raises
    assert raised.stop_reason == "answer" and raised.usable and raised.trajectory.error is None
    assert raised.trajectory.tool_errors == 0  # an exception in the code is the code's result
    await env.aclose()


async def test_a_tool_raising_tool_infrastructure_error_ends_the_episode():
    class Down(Tool):
        name = "lookup"
        parameters = {"type": "object", "properties": {}}

        async def call(self, arguments, session=None):
            raise ToolInfrastructureError("the lookup service does not answer")

    env = AgentEnv(format=FMT, tools=[Down()])
    await env.areset(options={"task": {"prompt": "look it up"}})
    call = '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}<|call|>'
    obs, reward, terminated, truncated, info = await env.astep(call)
    assert truncated and not terminated and reward == 0.0 and len(obs["tokens"]) == 0
    assert info["stop_reason"] == "infrastructure" and info["errors"] == ["tool_infrastructure"]
    assert env.trajectory.error == "tool_infrastructure: lookup: Error: the lookup service does not answer"
    await env.aclose()


class SlowSession(StatefulTool):
    """A stateful tool whose backend takes ``wait_s`` to admit a session."""

    name = "slow"
    parameters = {"type": "object", "properties": {}}
    timeout_s = 0.05  # the call's own limit

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    async def create_session(self):
        await asyncio.sleep(self.wait_s)
        return "s"

    async def release_session(self, session):
        pass

    async def call(self, arguments, session=None):
        return f"ran in {session}"


async def test_waiting_for_a_session_is_not_the_calls_time(monkeypatch):
    from agentrl.envs.tools import dispatch
    from agentrl.envs.tools.dispatch import Sessions, ToolBox
    from agentrl.harmony.types import ToolCall

    monkeypatch.setattr(dispatch, "SESSION_TIMEOUT_S", 2.0)
    call = ToolCall(recipient="functions.slow", name="slow", arguments={}, raw_arguments="{}")
    rec = await ToolBox([SlowSession(0.2)]).call(call, Sessions())  # admitted after the call's own limit
    assert rec.error is None and rec.result == "ran in s"
    monkeypatch.setattr(dispatch, "SESSION_TIMEOUT_S", 0.1)  # never admitted: the backend failed, not the call
    sessions = Sessions()
    rec = await ToolBox([SlowSession(5.0)]).call(call, sessions)
    assert rec.error == "tool_infrastructure" and "could not start its session within 0.1 s" in rec.result
    assert "ToolInfrastructureError" in sessions.tracebacks[0]


def test_tool_infrastructure_is_in_the_taxonomy():
    from agentrl.episodes import STOP_REASONS
    from agentrl.harmony.trajectory import ERROR_KINDS

    assert "tool_infrastructure" in ERROR_KINDS and "infrastructure" in STOP_REASONS
    assert ToolInfrastructureError("x").kind == "tool_infrastructure"


# ----------------------------------------------------------------------------- collection: retried, then left out


async def test_collect_runs_an_infrastructure_failure_again():
    global BACKEND
    BACKEND = FakeSandbox(full=2)  # the first two session requests are refused
    pool = EnvPool(lambda: FlakyEnv(format=FMT), 1)
    results = await collect(pool, lambda job: _policy(), [EpisodeJob(TASK, 0, "a")])
    await pool.aclose()
    (r,) = results
    assert r.stop_reason == "answer" and r.usable and r.trajectory.reward == 1.0 and r.error is None
    assert r.retries == 2 and len(r.retried_errors) == 2 and "pool is full" in r.retried_errors[0]


async def test_collect_gives_up_after_the_retries_and_keeps_the_record():
    global BACKEND
    BACKEND = FakeSandbox(full=3)
    pool = EnvPool(lambda: FlakyEnv(format=FMT), 1)
    results = await collect(pool, lambda job: _policy(), [EpisodeJob(TASK, 0, "a"), EpisodeJob(TASK, 1, "b")])
    await pool.aclose()
    failed, ok = results
    assert failed.infrastructure and not failed.usable and failed.retries == 2 and "pool is full" in failed.error
    assert failed.trajectory.stop_reason == "infrastructure" and failed.trajectory.task_id == "a"
    assert ok.usable and ok.retries == 0


async def test_collect_without_retries():
    global BACKEND
    BACKEND = FakeSandbox(full=1)
    pool = EnvPool(lambda: FlakyEnv(format=FMT), 1)
    (r,) = await collect(pool, lambda job: _policy(), [EpisodeJob(TASK, 0, "a")], infra_retries=0)
    await pool.aclose()
    assert r.infrastructure and r.retries == 0


# ----------------------------------------------------------------------------- tracebacks for developers


class _Boom:
    async def act(self, episode):
        raise RuntimeError("policy exploded")


async def test_a_failed_episode_keeps_its_full_traceback(monkeypatch):
    monkeypatch.delenv("AGENTRL_DEBUG", raising=False)
    pool = EnvPool(lambda: FlakyEnv(format=FMT), 1)
    (r,) = await collect(pool, _Boom(), [EpisodeJob(TASK, 0, "a")])
    await pool.aclose()
    assert r.error == "RuntimeError: policy exploded"  # the user's line
    assert r.traceback.startswith("Traceback") and "in act" in r.traceback and "policy exploded" in r.traceback
    ((what, text),) = r.failures()  # what the run's errors.log gets
    assert what == "task a sample 0: episode failed: RuntimeError: policy exploded" and text == r.traceback


async def test_agentrl_debug_reraises_a_failing_episode(monkeypatch):
    monkeypatch.setenv("AGENTRL_DEBUG", "1")
    pool = EnvPool(lambda: FlakyEnv(format=FMT), 1)
    with pytest.raises(RuntimeError, match="policy exploded"):
        await collect(pool, _Boom(), [EpisodeJob(TASK, 0, "a")])
    await pool.aclose()


def test_errorlog_appends_blocks(tmp_path):
    from agentrl import errorlog

    try:
        raise ValueError("first")
    except ValueError as exc:
        errorlog.append(tmp_path / "run", "episode a", errorlog.format_exception(exc))
    errorlog.append(tmp_path / "run", "episode b", "RuntimeError: second")
    text = (tmp_path / "run" / "errors.log").read_text()
    assert text.count("=== ") == 2 and "episode a\nTraceback" in text and "ValueError: first" in text
    assert "episode b\nRuntimeError: second" in text


# ----------------------------------------------------------------------------- training: left out, counted


def _episode(group, sample, *, infra=False, error=None, reward=1.0):
    from agentrl.episodes import EpisodeResult

    traj = Trajectory(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                      reward=reward)
    stop = "infrastructure" if infra else ("error" if error else "answer")
    traj.stop_reason = stop
    return EpisodeResult(traj, stop, group=group, sample=sample,
                         error="tool_infrastructure: python: down" if infra else error)


def test_trainable_leaves_out_infrastructure_failures_and_the_groups_they_leave_alone():
    from agentrl.train.rollout import trainable

    episodes = [
        _episode(0, 0), _episode(0, 1),  # a whole group: trained on
        _episode(1, 0), _episode(1, 1, infra=True),  # one left: its own baseline, dropped
        _episode(2, 0), _episode(2, 1), _episode(2, 2, infra=True),  # two left: trained on
        _episode(3, 0, error="RuntimeError: x"), _episode(3, 1, infra=True),  # nothing left
        _episode(4, 0),  # rollout.n=1: a group of one is what it is
    ]
    assert trainable(episodes) == [True, True, False, False, True, True, False, False, False, True]


def test_episode_metrics_count_infrastructure_failures_outside_the_score():
    from agentrl.train.metrics import episode_metrics

    ok, broken = _episode(0, 0, reward=1.0), _episode(0, 1, infra=True, reward=0.0)
    broken.retries = 2
    m = episode_metrics([ok, broken])
    assert m["critic/score/mean"] == 1.0 and m["episode/infra_errors"] == 1.0 and m["episode/infra_retries"] == 2.0
    assert m["episode/rollout_errors"] == 1.0
    only = episode_metrics([broken])
    assert only["episode/infra_errors"] == 1.0 and only["critic/score/mean"] != only["critic/score/mean"]  # NaN


class LookupEnv(AgentEnv):
    """Look the task up with a tool, then answer; the lookup service is down for tasks marked ``down``."""

    instructions = "Look the task up, then answer in \\\\boxed{}."

    def make_tools(self):
        return [Lookup()]

    @classmethod
    def generate_task(cls, rng, split="train"):
        n = int(rng.integers(10**6))
        return {"prompt": f"task {n} {'down' if n % 2 == 0 else 'up'}", "answer": "7"}

    def reward(self, ctx):
        ok = ctx.final is not None and "\\boxed{7}" in ctx.final
        return float(ok), {"correct": float(ok)}


class Lookup(Tool):
    name = "lookup"
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

    async def call(self, arguments, session=None):
        if "down" in arguments["q"]:
            raise ToolInfrastructureError("the lookup service does not answer")
        return "7"


def lookup_script(prompt: str, sampling) -> list[Message]:
    if "<|start|>functions.lookup to=assistant" not in prompt:
        q = prompt.rsplit("<|start|>user<|message|>", 1)[1].split("<|end|>", 1)[0]
        return [Message("assistant", json.dumps({"q": q}), channel="commentary", recipient="functions.lookup",
                        content_type="json")]
    return [Message("assistant", "\\boxed{7}", channel="final")]


def test_training_leaves_infrastructure_failures_out_and_the_summary_says_so(tmp_path):
    from agentrl.train.config import build_config
    from agentrl.train.reporting import headline
    from agentrl.train.trainer import Trainer

    registry.register("infra-lookup", f"{__name__}:LookupEnv")
    run = tmp_path / "run"
    cfg = build_config([
        "env=infra-lookup", "model=tiny-gpt-oss", "model_kwargs.num_layers=1", "data.tasks=env", "eval.num_tasks=4",
        "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=64", "rollout.max_turns=3",
        "trainer.total_steps=1", "trainer.progress=false", "trainer.tensorboard=false", "trainer.export_hf=false",
        "sft.steps=0", "eval.before=false", f"run_dir={run}",
    ])
    trainer = Trainer(cfg)
    trainer.actor.engine = TrainerEngine(trainer.format, lookup_script)
    summary = trainer.fit()
    down_eval = sum("down" in task["prompt"] for _, task in trainer.heldout.items)
    step = [Trajectory.from_json(x) for x in (run / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    down_train = sum(t.stop_reason == "infrastructure" for t in step)
    assert down_eval and down_train  # the seed marks some tasks of each down
    assert all(("down" in str(t.task)) == (t.stop_reason == "infrastructure") for t in step)
    assert all(t.train_logprobs is None for t in step if t.stop_reason == "infrastructure")  # never trained on
    after = summary["eval_after"]
    assert after["infra_errors"] == after["incomplete"] == down_eval and after["infra_retries"] == 2 * down_eval
    assert after["episodes"] == 4 - down_eval and after["mean"] == 1.0  # the others are right: no wrong answer
    assert summary["infra_errors"] == down_eval + down_train and summary["incomplete_evaluations"] == 1
    assert summary["infra_retries"] == 2 * (down_eval + down_train)
    assert summary["complete"] is False and summary["stopped_by"] is None
    assert summary["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", summary["commit"])
    line = headline(summary)
    assert line.startswith(f"agentrl train: INCOMPLETE (1/1 steps): {down_eval + down_train} infrastructure errors, "
                           "1 incomplete evaluations (tracebacks in errors.log)")
    log = (run / "errors.log").read_text()
    assert log.count("infrastructure failure, left out") == down_eval + down_train
    assert "ToolInfrastructureError: the lookup service does not answer" in log and "Traceback" in log
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["episode/infra_errors"] == down_train and record["eval/infra_errors"] == down_eval


# ----------------------------------------------------------------------------- agentrl eval: incomplete, not wrong


def test_agentrl_eval_counts_an_infrastructure_failure_as_incomplete_not_wrong(tmp_path):
    from agentrl.engines.server import BackgroundServer, create_app
    from agentrl.evaluation import EvalConfig, Evaluation
    from agentrl.evaluation.report import rows

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n"
                             for p in ["compute a", "compute b down", "compute c", "compute d"]))
    out = tmp_path / "eval"

    async def go():
        with BackgroundServer(create_app(ScriptedEngine(FMT, script), FMT, model_name="script")) as srv:
            cfg = EvalConfig(env=ENV, model=srv.base_url, tasks=str(tasks), limit=4, concurrency=2, out=str(out),
                             progress=False, max_new_tokens=64)
            return await Evaluation(cfg).run()

    metrics = asyncio.run(go())
    assert metrics["episodes"] == 3 and metrics["mean_reward"] == 1.0 and metrics["incomplete_items"] == 1
    assert metrics["run"]["infra_errors"] == 1 and metrics["run"]["infra_retries"] == 2
    assert metrics["run"]["episodes_failed"] == 1 and dict(rows(metrics))["run/infra_errors"] == 1
    (failed,) = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert failed["item_id"] == "1" and "sandbox worker 2 died" in failed["error"]
    log = (out / "errors.log").read_text()
    assert log.count("infrastructure failure, run again") == 2 and log.count("infrastructure failure, left out") == 1
    assert "ToolInfrastructureError: the code sandbox failed: sandbox worker 2 died" in log


# ----------------------------------------------------------------------------- fatal errors: one line, traceback kept


def _broken_trainer(monkeypatch):
    import agentrl.train.trainer as trainer_module

    class Broken:
        def __init__(self, cfg, **kwargs):
            raise RuntimeError("the model exploded while loading")

    monkeypatch.setattr(trainer_module, "Trainer", Broken)


def test_a_fatal_error_is_one_line_and_its_traceback_is_kept(tmp_path, monkeypatch, capsys):
    from agentrl.train.cli import run_trainer
    from agentrl.train.config import build_config

    monkeypatch.delenv("AGENTRL_DEBUG", raising=False)
    _broken_trainer(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    assert run_trainer(build_config(["env=retool", f"run_dir={run}"]), "agentrl train") == 2
    err = capsys.readouterr().err.strip()
    assert err == "agentrl train: the model exploded while loading"  # the user's line, unchanged
    log = (run / "errors.log").read_text()
    assert "fatal: RuntimeError" in log and "Traceback" in log and "in __init__" in log
    fresh = tmp_path / "fresh"  # a run that never started writes nothing
    assert run_trainer(build_config(["env=retool", f"run_dir={fresh}"]), "agentrl train") == 2
    assert not fresh.exists()


def test_agentrl_debug_reraises_a_fatal_error(tmp_path, monkeypatch):
    from agentrl.train.cli import run_trainer
    from agentrl.train.config import build_config

    monkeypatch.setenv("AGENTRL_DEBUG", "1")
    _broken_trainer(monkeypatch)
    with pytest.raises(RuntimeError, match="the model exploded"):
        run_trainer(build_config(["env=retool", f"run_dir={tmp_path / 'run'}"]), "agentrl train")


# ----------------------------------------------------------------------------- verl's agent loop: run again, then marked


def test_verl_agent_loop_runs_an_infrastructure_failure_again_then_marks_it():
    pytest.importorskip("verl")
    engine = ScriptedEngine(FMT, script)
    loop = scripted_verl_agent_loop(engine, response_length=1024)

    async def run(prompt):
        spec = {"env": ENV, "format": "harmony", "task": {"prompt": prompt, "answer": "42"}, "max_new_tokens": 64}
        return await loop.run({"temperature": 1.0}, agentrl=json.dumps(spec))

    global BACKEND
    BACKEND = FakeSandbox(full=2)  # refused twice, then admitted: the third run answers
    ok = asyncio.run(run("compute 6*7"))
    assert ok.reward_score == 1.0 and any(ok.response_mask) and ok.extra_fields["infrastructure_error"] is None
    before = engine.requests
    down = asyncio.run(run("compute down"))
    assert engine.requests - before == 3  # run three times
    assert down.reward_score == 0.0 and not any(down.response_mask) and down.response_ids
    assert "sandbox worker 2 died" in down.extra_fields["infrastructure_error"]
