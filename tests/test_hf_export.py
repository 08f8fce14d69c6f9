"""At the end of a run its last checkpoint's model is also written in the HF format (``save_pretrained``), which
``transformers`` (so vLLM and TRL) loads as it is (issue 27 §9)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_the_last_checkpoint_is_also_a_save_pretrained_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from agentrl.cli import main

    run = tmp_path / "run"
    assert main(["train", "env=gsm8k", "model=tiny-gpt-oss", "model_kwargs.num_layers=1", "trainer.total_steps=1",
                 "eval.num_tasks=0", "sft.steps=0", "rollout.batch_size=1", "rollout.n=2", "rollout.max_new_tokens=4",
                 "trainer.tensorboard=false", "trainer.progress=false", f"run_dir={run}"]) == 0
    ckpt = run / "checkpoints" / "step_000001"
    assert (ckpt / "hf" / "config.json").is_file() and not list(ckpt.glob(".tmp-*"))
    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    saved = torch.load(ckpt / "model.pt", weights_only=True)
    assert set(model.state_dict()) == set(saved)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_a_lora_run_exports_its_adapter_merged_into_the_base(tmp_path, capsys):
    """LoRA runs export too (issue 36 §2.7): the HF folder is the base with the adapter folded in, the same
    weights ``model=RUN_DIR`` loads, and the console says so."""
    from transformers import AutoModelForCausalLM

    from agentrl.cli import main
    from agentrl.models.loading import load_model

    run = tmp_path / "run"
    assert main(["train", "env=gsm8k", "model=tiny-gpt-oss", "model_kwargs.num_layers=1", "trainer.total_steps=1",
                 "eval.num_tasks=0", "sft.steps=0", "rollout.batch_size=1", "rollout.n=2", "rollout.max_new_tokens=4",
                 "actor.lora.rank=4", "trainer.tensorboard=false", "trainer.progress=false", f"run_dir={run}"]) == 0
    assert "HF format (save_pretrained, the LoRA adapter merged into the base)" in capsys.readouterr().out
    hf = run / "checkpoints" / "step_000001" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    merged = load_model(str(run)).model.state_dict()
    assert set(model.state_dict()) == set(merged) and not any("lora" in k for k in merged)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in merged.items())
