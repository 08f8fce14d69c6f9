"""A checkpoint written with trainer.n_gpus > 1 (FSDP2, name-keyed optimizer state) loads in the single-GPU
trainer; a checkpoint of other parameters fails with a message that says what differs."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from _torchrun import run_launch

from agentrl.train.checkpoint import load_checkpoint, save_checkpoint


class _FullState:
    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def _trained(seed: int, freeze_first: bool = False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    if freeze_first:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
    return model, opt


def test_name_keyed_optimizer_state_loads_into_a_single_process_optimizer(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt = _trained(0)
    by_name = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert isinstance(by_name["param_groups"][0]["params"][0], str)  # the FSDP2 trainer's layout
    # names, not positions, say which moments belong to which parameter
    by_name["param_groups"][0]["params"].reverse()
    save_checkpoint(str(tmp_path), step=3, data_position=12, model=model, optimizer=_FullState(by_name),
                    extra={"n_gpus": 2})
    fresh, fresh_opt = _trained(1)
    state = load_checkpoint(str(tmp_path / "checkpoints" / "step_000003"), model=fresh, optimizer=fresh_opt)
    assert state["step"] == 3 and state["n_gpus"] == 2
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], fresh_opt.state[b][key]), key
    assert fresh_opt.param_groups[0]["lr"] == 1e-2


def test_optimizer_state_of_other_parameters_fails_clearly(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt = _trained(0)
    by_name = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    save_checkpoint(str(tmp_path), step=1, data_position=4, model=model, optimizer=_FullState(by_name))
    frozen, frozen_opt = _trained(1, freeze_first=True)
    with pytest.raises(ValueError, match=r"only in the checkpoint: \['0.bias', '0.weight'\].*actor.freeze"):
        load_checkpoint(str(tmp_path / "checkpoints" / "step_000001"), model=frozen, optimizer=frozen_opt)


@pytest.mark.distributed
def test_n_gpus_2_checkpoint_resumes_in_the_single_process_trainer(tmp_path):
    """The real thing: `agentrl train device=cpu trainer.n_gpus=2` (torchrun, gloo, FSDP2) saves step 1;
    the plain trainer (trainer.n_gpus=1) resumes it with the same weights and Adam state and runs step 2."""
    from agentrl.train.cli import load_run_config
    from agentrl.train.trainer import Trainer

    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "agentrl.cli", "train", "env=gsm8k", "model=tiny-gpt-oss", "device=cpu",
            "trainer.n_gpus=2", "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false",
            "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4", "eval.num_tasks=0",
            "model_kwargs.num_layers=1", "actor.freeze=[embeddings]", "trainer.total_steps=1", f"run_dir={run_dir}",
            "actor.entropy_coeff=0.01"]  # a gradient even when every GRPO group scores alike: Adam has state
    run_launch(args, cwd=tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000001"
    assert json.loads((ckpt / "state.json").read_text())["n_gpus"] == 2
    saved_opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    saved_model = torch.load(ckpt / "model.pt", weights_only=True)

    cfg = load_run_config([f"resume={run_dir}", "trainer.n_gpus=1", "trainer.total_steps=2"])
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    assert trainer.state.step == 1 and trainer.state.data_position == 2
    params = dict(trainer.model.named_parameters())
    for name, tensor in saved_model.items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    assert saved_opt["state"], "the n_gpus=2 step should have left Adam state"
    checked = 0
    for name, moments in saved_opt["state"].items():
        state = trainer.optimizer.state[params[name]]
        assert torch.equal(state["exp_avg"], moments["exp_avg"]), name
        assert torch.equal(state["exp_avg_sq"], moments["exp_avg_sq"]), name
        checked += 1
    assert checked == len([p for p in trainer.model.parameters() if p.requires_grad])
    trainer.state.step = 0  # fit() resumes again from the checkpoint
    summary = trainer.fit()
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["actor/optimizer_steps"] >= 0
