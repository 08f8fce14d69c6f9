"""``agentrl eval`` of gsm8k on GSM8K test items (shipped in agentrl.data) against a real OpenAI-compatible endpoint whose
model is scripted: item ``q`` is answered correctly by exactly its first ``c(q)`` samples, so pass@k,
mean@k and maj@k are known in closed form."""

from __future__ import annotations

import hashlib
import json
import math
import re

import pytest
from _scripted_engine import ScriptedEngine

from agentrl.data import dataset_path
from agentrl.engines.base import SamplingParams
from agentrl.engines.server import BackgroundServer, create_app
from agentrl.envs.tasks import load_gsm8k
from agentrl.evaluation import EvalConfig, Evaluation
from agentrl.evaluation.cli import main as eval_main
from agentrl.harmony import HarmonyFormat, Message, Trajectory

DATA = dataset_path("gsm8k")

N, LIMIT = 4, 10
FMT = HarmonyFormat()


def n_correct(question: str) -> int:
    """How many of the N samples of this question are right: 0..N, fixed by a hash of the question."""
    return int(hashlib.sha256(question.encode()).hexdigest(), 16) % (N + 1)


def make_policy(gold: dict[str, str]):
    def policy(prompt: str, sampling: SamplingParams) -> list[Message]:
        question = re.findall(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", prompt, re.S)[-1]
        sample = sampling.seed  # the eval draws sample j with seed 0 + j
        answer = gold[question] if sample < n_correct(question) else str(int(gold[question]) + 1)
        return [
            Message("assistant", "Let me add it up.", channel="analysis"),
            Message("assistant", f"The answer is \\boxed{{{answer}}}.", channel="final"),
        ]

    return policy


@pytest.fixture(scope="module")
def tasks():
    return load_gsm8k(DATA)[:LIMIT]


@pytest.fixture(scope="module")
def endpoint(tasks):
    gold = {t["prompt"]: t["answer"] for t in tasks}
    with BackgroundServer(
        create_app(ScriptedEngine(FMT, make_policy(gold)), FMT, model_name="scripted")
    ) as srv:
        yield srv.base_url


def expected(tasks) -> dict[str, float]:
    cs = [n_correct(t["prompt"]) for t in tasks]
    out = {
        f"pass@{k}": sum(1 - math.comb(N - c, k) / math.comb(N, k) for c in cs) / len(cs) for k in (1, 2, 4)
    }
    out[f"mean@{N}"] = sum(c / N for c in cs) / len(cs)
    # majority of all 4 samples: right when c > 2, a coin flip when c == 2 (2 right vs 2 of the same wrong answer)
    out["maj@4"] = sum(1.0 if c > 2 else 0.5 if c == 2 else 0.0 for c in cs) / len(cs)
    out["maj@1"] = out["pass@1"]
    return out


def config(endpoint, out, **kw) -> EvalConfig:
    return EvalConfig(
        env="gsm8k", model=endpoint, tasks=str(DATA), limit=LIMIT, n=N, concurrency=8, out=str(out), **kw
    )


async def test_eval_gsm8k_pass_at_k_is_known(endpoint, tasks, tmp_path):
    assert len({n_correct(t["prompt"]) for t in tasks}) >= 3  # the items really differ
    metrics = await Evaluation(config(endpoint, tmp_path / "run")).run()
    for key, value in expected(tasks).items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    assert metrics["episodes"] == N * LIMIT and metrics["incomplete_items"] == 0
    assert metrics["tool_calls_per_episode"] == 0 and sum(metrics["errors"].values()) == 0
    assert metrics["requests_per_episode"] == 1 and metrics["gen_tokens_per_episode"] > 5
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == N * LIMIT
    traj = Trajectory.from_json(lines[0])
    traj.validate()
    # lossless: the exact sampled ids, their log-probs, the parsed turn and the grading
    assert FMT.decode(traj.prompt_ids).endswith("<|start|>assistant")
    assert traj.response_mask == [1] * len(traj.response_ids) and len(traj.rollout_logprobs) == len(
        traj.response_ids
    )
    assert traj.turns[0].parsed.final.startswith("The answer is")
    assert traj.correct == (traj.reward == 1.0) and traj.final_answer is not None
    assert Trajectory.from_json(traj.to_json()).to_dict() == traj.to_dict()


async def test_eval_resumes_and_keeps_torn_lines(endpoint, tasks, tmp_path):
    out = tmp_path / "run"
    first = await Evaluation(config(endpoint, out)).run()
    again = await Evaluation(config(endpoint, out)).run()
    assert again["run"]["episodes_run"] == 0 and again["run"]["episodes_skipped"] == N * LIMIT
    path = out / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:25]) + "\n" + lines[25][:100])  # a crash mid-write
    resumed = await Evaluation(config(endpoint, out)).run()
    assert resumed["run"]["episodes_run"] == N * LIMIT - 25 and resumed["run"]["unreadable_lines"] == 0
    assert {k: resumed[k] for k in expected(tasks)} == {k: first[k] for k in expected(tasks)}
    assert (out / "trajectories.torn").read_text() == lines[25][:100] + "\n"  # the torn line is kept, set aside
    assert all(json.loads(line) for line in path.read_text().splitlines())  # the file holds whole lines only
    path.write_text("\n".join([*lines[:3], "{oops", *lines[3:]]) + "\n")  # a damaged line in the middle
    with pytest.raises(ValueError, match=r"trajectories.jsonl:4: not JSON .*repair or delete that line"):
        await Evaluation(config(endpoint, out)).run()
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="different config.*overwrite=true"):
        await Evaluation(config(endpoint, out, temperature=0.5)).run()
    with pytest.raises(ValueError, match="env_kwargs"):
        await Evaluation(config(endpoint, out, env_kwargs={"max_turns": 2})).run()
    fresh = await Evaluation(config(endpoint, out, temperature=0.5, overwrite=True)).run()
    assert fresh["run"]["episodes_run"] == N * LIMIT and fresh["run"]["episodes_skipped"] == 0


async def test_eval_over_chat_completions_gives_the_same_numbers(endpoint, tasks, tmp_path):
    metrics = await Evaluation(config(endpoint, tmp_path / "chat", api="chat")).run()
    for key, value in expected(tasks).items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    traj = Trajectory.from_json((tmp_path / "chat" / "trajectories.jsonl").read_text().splitlines()[0])
    assert traj.api == "chat" and traj.usage["completion_tokens"] > 0


async def test_eval_over_two_processes_gives_the_same_numbers(endpoint, tasks, tmp_path):
    metrics = await Evaluation(config(endpoint, tmp_path / "p2", processes=2)).run()
    for key, value in expected(tasks).items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    lines = (tmp_path / "p2" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == N * LIMIT and all(Trajectory.from_json(x) for x in lines)  # no interleaved writes
    assert metrics["run"]["episodes_run"] == N * LIMIT


async def test_unreachable_endpoint_is_recorded_not_lost(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EvalConfig(
        env="gsm8k",
        model=f"http://127.0.0.1:{port}/v1",
        served_model="m",
        tasks=str(DATA),
        limit=2,
        n=1,
        retries=0,
        concurrency=1,
        out=str(tmp_path / "down"),
    )
    with pytest.raises(RuntimeError, match="every episode failed"):
        await Evaluation(cfg).run()
    errors = [json.loads(x) for x in (tmp_path / "down" / "errors.jsonl").read_text().splitlines()]
    assert {e["item_id"] for e in errors} == {"0", "1"} and "ConnectError" in errors[0]["error"]


def test_cli_runs_and_compares(endpoint, tmp_path, capsys):
    common = [f"model={endpoint}", "env=gsm8k", f"tasks={DATA}", "limit=3", "n=2", "progress=false"]
    assert eval_main([*common, f"out={tmp_path / 'a'}"]) == 0
    assert eval_main([*common, f"out={tmp_path / 'b'}", "api=chat"]) == 0
    capsys.readouterr()
    assert eval_main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "pass@1" in table and "pass@2" in table and "+0.0000" in table
    assert eval_main(["env=gsm8k"]) == 2
