"""``resume=RUN`` continues a run as it was: an override of a key that makes the run what it is (env, model,
format, LoRA shape, ...) is refused with one line, exit 2, and the run's config.yaml is not rewritten."""

from __future__ import annotations

import pytest
from _tiny_run import TINY
from omegaconf import OmegaConf


@pytest.fixture
def run(tmp_path):
    from agentrl.train.config import build_config

    run_dir = tmp_path / "run"
    cfg = build_config(["env=retool", *TINY, f"run_dir={run_dir}"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run_dir


@pytest.mark.parametrize("override", ["env=gsm8k", "model=smollm2-135m", "format=harmony", "model_kwargs.num_layers=2",
                                      "env_kwargs.tier=compute", "seed=1", "actor.lora.rank=8", "actor.lora.alpha=4",
                                      "actor.lora.target_modules=[q_proj]"])
def test_resume_refuses_identity_keys_and_writes_nothing(run, override, capsys, monkeypatch):
    import agentrl.train.actor as actor
    from agentrl.cli import main

    def no_load(*args, **kwargs):  # a resume that is not refused fails here at once instead of training
        raise AssertionError("the resume was not refused before the model loaded")

    monkeypatch.setattr(actor, "load_model", no_load)

    before = (run / "config.yaml").read_text()
    assert main(["train", f"resume={run}", override]) == 2
    err = capsys.readouterr().err.strip()
    key = override.split("=", 1)[0]
    key = key if key.startswith("actor.") else key.split(".")[0]  # model_kwargs.num_layers is part of model_kwargs
    assert f"continues the run as it was: {key}=" in err and "differs from its" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert (run / "config.yaml").read_text() == before and sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_resume_accepts_other_keys_and_the_same_identity(run):
    from agentrl.train.cli import load_run_config

    cfg = load_run_config([f"resume={run}", "trainer.total_steps=20", "env=retool", "model=tiny-gpt-oss"])
    assert cfg.trainer.total_steps == 20 and cfg.env == "retool" and cfg.model_kwargs.num_layers == 1
