"""The typed trajectory record and the one run-directory I/O module (torch-free): schema-1 files still read,
every reader tolerates a torn last line, a bad file is one line naming it (exit status 2) and nothing is
overwritten, and each command refuses another command's run directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrl import rundir
from agentrl.harmony import HarmonyFormat, Message, SamplingRecord, Trajectory
from agentrl.harmony.trajectory import SCHEMA_VERSION

DATA = Path(__file__).parent / "data" / "schema1"
FMT = HarmonyFormat()


def _episode(reward: float = 1.0) -> Trajectory:
    """A real gsm8k episode (one final answer) with its typed fields set as a caller would."""
    import agentrl

    env = agentrl.make("gsm8k", format=FMT)
    try:
        env.reset(options={"task": {"id": "g1", "prompt": "1 + 1?", "answer": "2" if reward else "3"}})
        env.step(FMT.render_completion([Message("assistant", "\\boxed{2}", channel="final")]))
        traj = env.trajectory
    finally:
        env.close()
    traj.task_id, traj.sample, traj.group, traj.policy_version = "g1", 0, "7", 3
    traj.sampling = SamplingRecord(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=None)
    traj.train_logprobs = [(-0.1 if m else 0.0) for m in traj.response_mask]
    return traj


# ---------------------------------------------------------------------------- the record
def test_typed_fields_round_trip_and_are_not_metadata():
    traj = _episode()
    data = json.loads(traj.to_json())
    assert data["schema"] == SCHEMA_VERSION and data["metadata"] == {}
    assert data["env"] == "gsm8k" and data["stop_reason"] == "answer" and data["task"]["id"] == "g1"
    back = Trajectory.from_json(traj.to_json())
    assert back.to_dict() == traj.to_dict() and back.correct and back.tool_calls == 0


def test_schema_1_files_still_read():
    eval_run = rundir.load_trajectories(DATA / "eval_trajectories.jsonl")
    train_run = rundir.load_trajectories(DATA / "train_step_000001.jsonl")
    assert not eval_run.problems and not train_run.problems
    for _, t in eval_run.items:  # agentrl eval's metadata keys
        assert t.env == "retool" and t.task_id and t.sample == 0 and t.model == "tiny-gpt-oss"
        assert t.api == "completions" and t.requests == 2 and t.latency_s > 0 and t.stop_reason == "turn_limit"
        assert t.errors == {"truncation": 2} and not t.correct and t.metadata == {}
    for _, t in train_run.items:  # the trainer's (the env class name, an int group)
        assert t.env == "ReToolEnv" and t.task_id == "train-0" and t.group == "0" and t.task["prompt"]
    legacy = {**json.loads((DATA / "eval_trajectories.jsonl").read_text().splitlines()[0])}
    legacy["metadata"] = {"old_logprobs": [0.0] * len(legacy["response_ids"]), "note": "mine", "rollout_error": "X: y"}
    t = Trajectory.from_dict(legacy)
    assert t.train_logprobs == [0.0] * len(t.response_ids) and t.error == "X: y" and t.metadata == {"note": "mine"}


def test_a_newer_schema_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**_episode().to_dict(), "schema": SCHEMA_VERSION + 1}) + "\n")
    with pytest.raises(rundir.RunDirError, match=f"{path}.*newer than this agentrl.*upgrade agentrl"):
        rundir.load_trajectories(path)
    from agentrl.viewer.html import main as view_main

    assert view_main([str(path)]) == 2


# ---------------------------------------------------------------------------- torn last lines
def _torn(path: Path, lines: list[str]) -> None:
    """Complete ``lines``, then half of another one without its newline: a writer killed mid-line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines) + lines[0][: len(lines[0]) // 2])


def test_every_trajectory_reader_skips_a_torn_last_line(tmp_path):
    from agentrl.evaluation.config import EvalConfig
    from agentrl.evaluation.store import ResultStore
    from agentrl.train.sft_data import infer_env, load_sft_data
    from agentrl.viewer.html import load_view_items as view_load

    line = _episode().to_json()
    run = tmp_path / "train"
    _torn(run / "trajectories" / "step_000001.jsonl", [line, line])
    (run / "config.yaml").write_text("env: gsm8k\n")
    eval_dir = tmp_path / "eval"
    _torn(eval_dir / "trajectories.jsonl", [line])
    assert [len(view_load(p)[0]) for p in (run, eval_dir)] == [2, 1]  # the viewer
    assert all(not view_load(p)[1] for p in (run, eval_dir))  # skipped silently, not a problem
    kept, counts = load_sft_data(f"{run},{eval_dir}")  # SFT data
    assert len(kept) == 3 and counts == {"read": 3, "kept": 3, "unreadable": 0} and infer_env(str(run)) == "gsm8k"
    store = ResultStore(eval_dir, EvalConfig(env="gsm8k", model="http://x/v1"))  # agentrl eval resuming
    assert len(store.load()) == 1 and store.unreadable == 0
    store.write(_episode())  # the torn line is closed first: the new record stays readable
    store.close()
    loaded = rundir.load_trajectories(eval_dir)
    assert len(loaded.items) == 2 and len(loaded.problems) == 1 and "not JSON" in loaded.report()


def test_metrics_readers_skip_a_torn_last_line_and_name_a_bad_one(tmp_path):
    records = [json.dumps({"step": s, "x": float(s)}) for s in (1, 2, 3)]
    _torn(tmp_path / "metrics.jsonl", records)
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2, 3]
    rundir.truncate_metrics(tmp_path / "metrics.jsonl", 2)  # resume after step 2: the torn tail goes too
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == records[:2]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text(records[0] + "\n{oops\n" + records[1] + "\n")
    before = (bad / "metrics.jsonl").read_text()
    with pytest.raises(rundir.RunDirError, match="metrics.jsonl:2: not JSON"):
        rundir.truncate_metrics(bad / "metrics.jsonl", 1)
    assert (bad / "metrics.jsonl").read_text() == before  # nothing overwritten
    from agentrl.train.plots import main as plot_main

    assert plot_main([str(bad)]) == 2


def test_verl_agent_loop_appends_after_a_torn_line(tmp_path):
    path = tmp_path / "step_000001-1.jsonl"
    line = _episode().to_json()
    _torn(path, [line])
    rundir.append_lines(path, [line])
    loaded = rundir.read_jsonl(path, Trajectory.from_dict)
    assert len(loaded.items) == 2 and len(loaded.problems) == 1 and loaded.torn == 0


# ---------------------------------------------------------------------------- bad files, other commands' dirs
def test_damaged_json_files_are_one_line_naming_them(tmp_path):
    from agentrl.evaluation.report import load_metrics

    for text, expected in (("", "is empty"), ('{"a": ', "is not valid JSON")):
        path = tmp_path / "metrics.json"
        path.write_text(text)
        with pytest.raises(rundir.RunDirError, match=f"{path} {expected}") as info:
            load_metrics(tmp_path)
        assert "\n" not in str(info.value)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{")
    with pytest.raises(rundir.RunDirError, match="state.json is not valid JSON.*remove that checkpoint"):
        rundir.read_checkpoint_state(ckpt)


def test_each_command_refuses_another_commands_run_directory(tmp_path, capsys):
    from agentrl.cli import main

    train_run, eval_run = tmp_path / "train", tmp_path / "eval"
    (train_run / "checkpoints").mkdir(parents=True)
    (train_run / "config.yaml").write_text("env: gsm8k\n")
    eval_run.mkdir()
    shutil.copy(DATA / "eval_trajectories.jsonl", eval_run / "trajectories.jsonl")
    (eval_run / "config.json").write_text("{}")
    cases = [
        (["eval", "env=gsm8k", "model=http://127.0.0.1:9/v1", f"out={train_run}"], "is a training run directory"),
        (["train", "env=gsm8k", f"run_dir={eval_run}"], "is an `agentrl eval` directory"),
        (["train", f"resume={eval_run}"], "is an `agentrl eval` directory"),
        (["sft", "env=retool", f"data={tmp_path / 'nowhere'}"], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in train_run.iterdir()) == ["checkpoints", "config.yaml"]  # nothing written
    assert (eval_run / "config.json").read_text() == "{}"


def test_env_records_an_empty_action_through_the_builder():
    """AgentEnv builds its trajectory with TrajectoryBuilder (episode mode): an empty completion is a model turn
    with an empty span and a parse error, never an exception."""
    import agentrl

    env = agentrl.make("retool", format=FMT, max_turns=2)
    try:
        env.reset(options={"task": {"prompt": "1 + 1?", "answer": "2"}})
        obs, reward, terminated, truncated, info = env.step([])
        traj = env.trajectory
        assert not (terminated or truncated) and len(obs["tokens"]) and info["errors"]
        assert traj.turns[0].model_span == (0, 0) and traj.response_mask == [0] * len(obs["tokens"])
        assert traj.logprobs_missing and traj.env == "retool"
    finally:
        env.close()
