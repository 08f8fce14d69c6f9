"""Every file a command reads from a run directory, damaged in a copy of a real run (truncated, empty, not
JSON/YAML, the wrong schema, another model's): the command exits 2 with one line naming the file and what to
do, no traceback, and leaves every file of the run as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from _tiny_run import TINY

torch = pytest.importorskip("torch")

STEP = "checkpoints/step_000001"
TRAJ = "trajectories/step_000001.jsonl"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real one-step gsm8k training run of the one-layer tiny GPT-OSS (checkpoint, metrics, trajectories)."""
    from agentrl.cli import main

    run_dir = tmp_path_factory.mktemp("damage") / "run"
    argv = ["train", "env=gsm8k", *TINY, "trainer.total_steps=1", "eval.num_tasks=0", "sft.steps=0",
            "rollout.batch_size=1", "rollout.n=2", "rollout.max_new_tokens=8", "trainer.tensorboard=false",
            "trainer.progress=false", f"run_dir={run_dir}"]
    assert main(argv) == 0
    return run_dir


def _replace(path: Path, data: bytes) -> None:
    """A new file in place of ``path`` (the copy's files are hard links to the original run's)."""
    path.unlink()
    path.write_bytes(data)


def _half(path: Path) -> None:
    data = path.read_bytes()
    _replace(path, data[: len(data) // 2])


def _newer_schema(path: Path) -> None:
    record = json.loads(path.read_text().splitlines()[0])
    _replace(path, (json.dumps({**record, "schema": 99}) + "\n").encode())


def _another_models_weights(path: Path) -> None:
    buffer = path.with_name("other.pt")
    torch.save({"model.embed_tokens.weight": torch.zeros(3, 2)}, buffer)
    _replace(path, buffer.read_bytes())
    buffer.unlink()


RESUME = ["train", "resume={run}", "trainer.total_steps=2"]
SFT = ["sft", "env=gsm8k", *TINY, "data={run}", "steps=1", "eval.num_tasks=0", "run_dir={run}-sft"]
VIEW = ["view", "{run}", "out={run}.html"]

#: case -> (file, how it is damaged, the command, what the one line says)
CASES: dict[str, tuple[str, Callable[[Path], None], list[str], str]] = {
    # cut in half, the YAML may still parse (a key left without its value): then it is the schema that refuses it
    "config truncated": ("config.yaml", _half, RESUME, ("config.yaml is not a readable config",
                                                        "config.yaml does not fit this version")),
    "config not yaml": ("config.yaml", lambda p: _replace(p, b"env: [gsm8k\nmodel: {x\n"), RESUME, "config.yaml is not a readable config"),
    "config empty": ("config.yaml", lambda p: _replace(p, b""), RESUME, "config.yaml is empty"),
    "config a list": ("config.yaml", lambda p: _replace(p, b"- a\n- b\n"), RESUME, "not a mapping"),
    "config wrong type": ("config.yaml", lambda p: _replace(p, p.read_bytes().replace(b"batch_size: 1", b"batch_size: lots")),
                          RESUME, "config.yaml does not fit this version"),
    "metrics not json": ("metrics.jsonl", lambda p: _replace(p, b"{oops\n" + p.read_bytes()), RESUME, "metrics.jsonl:1: not JSON"),
    "metrics not records": ("metrics.jsonl", lambda p: _replace(p, b"[1, 2]\n"), RESUME, "metrics.jsonl:1: ValueError: not a metrics record"),
    "state truncated": (f"{STEP}/state.json", _half, RESUME, "state.json is not valid JSON"),
    "state empty": (f"{STEP}/state.json", lambda p: _replace(p, b""), RESUME, "state.json is empty"),
    "state wrong schema": (f"{STEP}/state.json", lambda p: _replace(p, b'{"step": "x"}'), RESUME, "state.json is not a checkpoint state"),
    "model truncated": (f"{STEP}/model.pt", _half, RESUME, "model.pt is not a readable checkpoint file"),
    "model empty": (f"{STEP}/model.pt", lambda p: _replace(p, b""), RESUME, "model.pt is empty"),
    "model of another model": (f"{STEP}/model.pt", _another_models_weights, RESUME, "model.pt holds another model's weights"),
    "optimizer truncated": (f"{STEP}/optimizer.pt", _half, RESUME, "optimizer.pt is not a readable checkpoint file"),
    "rng truncated": (f"{STEP}/rng.pt", _half, RESUME, "rng.pt is not a readable checkpoint file"),
    "trajectories empty (sft)": (TRAJ, lambda p: _replace(p, b""), SFT, "no trajectory left for SFT"),
    "trajectories truncated (sft)": (TRAJ, _half, SFT, "no trajectory left for SFT"),
    "trajectories not json (sft)": (TRAJ, lambda p: _replace(p, b"hello\n"), SFT, "1 unreadable lines"),
    "trajectories newer schema (sft)": (TRAJ, _newer_schema, SFT, "newer than this agentrl reads"),
    "trajectories empty (view)": (TRAJ, lambda p: _replace(p, b""), VIEW, "holds no readable trajectory"),
    "trajectories wrong schema (view)": (TRAJ, lambda p: _replace(p, b'{"schema": 2, "prompt_ids": [1]}\n'), VIEW,
                                         "not a record of this file"),
    "trajectories newer schema (view)": (TRAJ, _newer_schema, VIEW, "newer than this agentrl reads"),
}


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_run_file_is_one_line_exit_2_and_nothing_changes(case, run, tmp_path, capsys):
    from agentrl.cli import main

    name, damage, command, message = CASES[case]
    copy = tmp_path / "run"
    shutil.copytree(run, copy, copy_function=os.link)
    damage(copy / name)
    before = _snapshot(copy)
    capsys.readouterr()
    assert main([arg.format(run=copy) for arg in command]) == 2
    err = capsys.readouterr().err.strip()
    messages = (message,) if isinstance(message, str) else message
    assert any(m in err for m in messages) and name.rsplit("/", 1)[-1] in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert _snapshot(copy) == before  # nothing rewritten, nothing added
    assert not (tmp_path / "run-sft").exists() and not (tmp_path / "run.html").exists()  # nothing left behind


def test_sft_whose_filters_keep_nothing_says_which_before_the_model_loads(run, tmp_path, monkeypatch, capsys):
    """The tiny model's episodes are all wrong: sft.correct_only=true (the default) keeps none, and says so
    before any model loads; no run directory is left behind."""
    import agentrl.train.actor as actor
    from agentrl.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the SFT data was checked")

    monkeypatch.setattr(actor, "load_model", no_load)
    assert not any(json.loads(line)["reward"] > 0 for line in (run / TRAJ).read_text().splitlines())
    assert main(["sft", "env=gsm8k", *TINY, f"data={run}", "steps=1", f"run_dir={tmp_path / 'sft'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no trajectory left for SFT" in err and "2 not correct (sft.correct_only=true)" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "sft").exists()


@pytest.mark.parametrize("command", [
    ["eval", "env=gsm8k", "model={run}", "limit=1", "progress=false"],
    ["serve", "model", "model={run}"],
    ["train", "env=gsm8k", "model={run}", "trainer.total_steps=1", "run_dir={out}"],
])
def test_a_run_with_a_damaged_config_as_model_is_one_line_and_leaves_nothing(command, run, tmp_path, monkeypatch, capsys):
    """``model=RUN_DIR`` whose config.yaml is damaged: eval, serve and train exit 2 with one line naming the
    file, before any model loads, and write no output directory."""
    from agentrl.cli import main

    copy = tmp_path / "run"
    shutil.copytree(run, copy, copy_function=os.link)
    _replace(copy / "config.yaml", b"env: [gsm8k\nmodel: {x\n")
    monkeypatch.chdir(tmp_path)  # eval's default output directory is runs/eval/... under it
    capsys.readouterr()
    assert main([arg.format(run=copy, out=tmp_path / "out") for arg in command]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.yaml is not a readable config" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("command", [
    ["eval", "env=gsm8k", "model={run}", "limit=1", "progress=false"],
    ["train", "resume={run}", "trainer.total_steps=2"],
])
def test_a_truncated_model_pt_is_one_whole_sentence(command, run, tmp_path, monkeypatch, capsys):
    """A cut ``model.pt``: our line names the file and the fix (not torch's message, not cut mid-sentence),
    and eval writes no output directory."""
    from agentrl.cli import main

    copy = tmp_path / "run"
    shutil.copytree(run, copy, copy_function=os.link)
    _half(copy / STEP / "model.pt")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([arg.format(run=copy) for arg in command]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "miniz" not in err, err
    assert "model.pt is not a readable checkpoint file (cut short or damaged" in err, err
    assert err.endswith(("pass another model=", "overwrite=true")), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
