"""A training run SIGKILLed after its step-2 checkpoint resumes exactly (``--resume DIR``, the same as
``resume=DIR``): step count, data position and the sampled token streams continue as in an uninterrupted run."""

from __future__ import annotations

import json

from _cli_process import kill_at, run_here
from _tiny_run import QUIET

ARGS = [
    "env=gsm8k", "model=tiny-gpt-oss", *QUIET, "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=6",
    "rollout.max_turns=1", "eval.num_tasks=0", "trainer.total_steps=4", "trainer.max_wall_s=0",
    "trainer.progress=false", "trainer.tensorboard=false", "actor.freeze=[embeddings,lm_head]", "threads=1",
    "trainer.save_every=1",  # a checkpoint after every step (the CPU default writes one every 10)
]


def _responses(run, step):
    with open(run / "trajectories" / f"step_{step:06d}.jsonl") as f:
        return [(json.loads(line)["task_id"], json.loads(line)["response_ids"]) for line in f]


def _state(run):
    latest = (run / "checkpoints" / "latest").read_text()
    return json.loads((run / "checkpoints" / latest / "state.json").read_text())


def test_killed_run_resumes_exactly(tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    run_here("train", [*ARGS, f"run_dir={ref}"])  # the uninterrupted run (no process boundary to test)

    kill_at("train", [*ARGS, f"run_dir={killed}"], "step 2/4")  # a step line follows its checkpoint
    assert _state(killed)["step"] in (2, 3)  # at most the step in flight is lost

    out = run_here("train", ["--resume", str(killed)])  # == resume=DIR
    assert "resumed from" in out
    state = _state(killed)
    assert state["step"] == 4 and state["data_position"] == 4 * 2 == _state(ref)["data_position"]
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    for step in (3, 4):
        assert _responses(killed, step) == _responses(ref, step)
    assert [t for t, _ in _responses(killed, 3)] == ["train-4", "train-4", "train-5", "train-5"]
