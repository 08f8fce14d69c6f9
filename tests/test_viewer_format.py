"""``agentrl view`` decodes tokens with the format of the model that wrote the run, not always Harmony's:
a SmolLM2 eval run shows SmolLM2's text without any network access."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def _smollm2_run(tmp_path):
    from agentrl.harmony import Trajectory
    from agentrl.models.loading import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    prompt, answer = tok.encode("Which colour is the zebra?"), tok.encode(" Striped aubergine")
    traj = Trajectory(prompt_ids=prompt, response_ids=answer, response_mask=[1] * len(answer),
                      rollout_logprobs=[0.0] * len(answer), model="smollm2-135m")
    run = tmp_path / "eval"
    run.mkdir()
    (run / "trajectories.jsonl").write_text(traj.to_json() + "\n")
    (run / "config.json").write_text(json.dumps({"env": "retool", "model": "smollm2-135m", "format": "auto"}))
    return run, [tok.decode([t]) for t in answer]


def test_view_takes_the_format_from_the_run(tmp_path, monkeypatch):
    from agentrl.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, pieces = _smollm2_run(tmp_path)  # SmolLM2's text of each answer token

    def shown(page: str) -> list[bool]:
        text = (tmp_path / page).read_text()
        return [json.dumps(p)[1:-1] in text for p in pieces if p.strip()]

    assert main(["view", str(run), f"out={tmp_path / 'auto.html'}"]) == 0
    assert all(shown("auto.html"))
    assert main(["view", str(run), "format=harmony", f"out={tmp_path / 'harmony.html'}"]) == 0
    assert not all(shown("harmony.html"))  # what the viewer used to show: Harmony's tokens for SmolLM2's ids
