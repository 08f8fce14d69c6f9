"""A training run directory is a model: ``model=runs/<run>`` loads the run's base model with its latest
checkpoint's weights and the run's chat format, for ``agentrl eval`` and ``agentrl serve model`` alike."""

from __future__ import annotations

import pytest
import torch
from _tiny_run import TINY

import agentrl.envs.registry as registry
from agentrl.envs import AgentEnv
from agentrl.models.loading import load_model
from agentrl.train.config import build_config
from agentrl.train.trainer import Trainer


class FirstTokenEnv(AgentEnv):
    """One action; reward 1 when the first sampled id is even (so rewards differ within a group)."""

    single_turn = True

    @classmethod
    def generate_task(cls, rng, split="train"):
        return {"prompt": f"Say something about {int(rng.integers(10**6))}.", "answer": "0"}

    def reward(self, ctx):
        ids = ctx.trajectory.response_ids
        return float(bool(ids) and ids[0] % 2 == 0), {}


ARGS = ["env=first-token-test", *TINY, "rollout.batch_size=2", "rollout.n=4",
        "rollout.max_new_tokens=4", "eval.num_tasks=0", "trainer.total_steps=1", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.max_wall_s=0", "actor.lr=1e-2", "threads=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished one-step run; returns (run directory, the trained parameters)."""
    registry.register("first-token-test", f"{__name__}:FirstTokenEnv")
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    trainer = Trainer(build_config([*ARGS, f"run_dir={run_dir}"]))
    trainer.fit()
    return run_dir, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_run_dir_loads_the_latest_checkpoint(run):
    run_dir, trained = run
    loaded = load_model(str(run_dir))
    assert loaded.checkpoint is not None and loaded.checkpoint.endswith("step_000001")
    assert loaded.format_name == "harmony" and loaded.chat_format().name == "harmony"
    state = loaded.model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    base = load_model("tiny-gpt-oss", model_kwargs={"num_layers": 1})  # the run changed the weights
    assert any(not torch.equal(base.model.state_dict()[k], trained[k]) for k in trained)


def test_run_dir_serves_and_evaluates(run, tmp_path):
    from agentrl.engines.server import load_local_engine
    from agentrl.evaluation import EvalConfig, Evaluation
    from agentrl.evaluation.runner import run_async

    run_dir, _ = run
    engine, fmt, name = load_local_engine(str(run_dir))
    assert fmt.name == "harmony" and name == "tiny"
    metrics = run_async(Evaluation(EvalConfig(env="gsm8k", model=str(run_dir), limit=2, max_new_tokens=4,
                                              out=str(tmp_path / "eval"))).run())
    assert metrics["run"]["episodes_run"] == 2 and metrics["run"]["episodes_failed"] == 0


def test_run_dir_without_model_kwargs_loads(run, tmp_path, monkeypatch):
    """A run started without model_kwargs (the embedded default) saves ``model_kwargs: {}``; loading it as a
    model passes ``{}`` to the base model's loader (an empty DictConfig once broke this)."""
    import shutil

    from omegaconf import OmegaConf

    import agentrl.models.loading as loading

    run_dir, trained = run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    cfg = OmegaConf.load(copy / "config.yaml")
    cfg.model_kwargs = {}
    OmegaConf.save(cfg, copy / "config.yaml")
    seen, real = [], loading.load_model

    def base_loader(name, **kwargs):  # the real loader; only the layer count the fixture's run used is added
        seen.append(kwargs["model_kwargs"])
        return real(name, **{**kwargs, "model_kwargs": {"num_layers": 1}})

    monkeypatch.setattr(loading, "load_model", base_loader)
    loaded = real(str(copy))
    assert seen == [{}]
    assert all(torch.equal(v, trained[k]) for k, v in loaded.model.state_dict().items())


def test_run_without_checkpoint_and_bad_directories_are_clear_errors(tmp_path):
    empty_run = tmp_path / "fresh"
    (empty_run / "checkpoints").mkdir(parents=True)
    (empty_run / "config.yaml").write_text("model: tiny-gpt-oss\n")
    with pytest.raises(ValueError, match="has no checkpoint yet"):
        load_model(str(empty_run))
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match="no config.json.*training run directory"):
        load_model(str(plain))


def test_agentrl_sink_attention_is_registered_on_demand(tmp_path):
    """``attn_implementation=agentrl_sink`` works for any model name (the embedded trainer compares with
    verl on the same kernel): a saved GPT-OSS directory gives eager's logits (fp32; the kernel runs under
    TRITON_INTERPRET=1 without a GPU, see conftest)."""
    pytest.importorskip("triton")
    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.models.tiny import tiny_gpt_oss

    tiny_gpt_oss(num_layers=2, hidden=64, sliding_window=4, seed=1).save_pretrained(tmp_path / "m")
    harmony_hf_tokenizer().save_pretrained(tmp_path / "m")
    sink = load_model(str(tmp_path / "m"), attn_implementation="agentrl_sink")
    eager = load_model(str(tmp_path / "m"), attn_implementation="eager")
    assert (sink.attn_implementation, eager.attn_implementation) == ("agentrl_sink", "eager")
    ids = torch.tensor([[200006, 9, 17, 3, 44, 2, 8, 61, 7, 12]], device=sink.model.device)
    with torch.no_grad():
        torch.testing.assert_close(sink.model(ids).logits, eager.model(ids).logits.to(sink.model.device),
                                   atol=1e-4, rtol=1e-4)
