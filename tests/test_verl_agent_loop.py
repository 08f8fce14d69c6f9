"""Our agent loop run by verl's own AgentLoopWorker against a real local OpenAI-compatible token server
(agentrl's server on the transformers engine, tiny GPT-OSS): the verl output must equal the trajectory
our own rollout produces for the same sampled tokens."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")

from _verl_test_env import register_multi_turn  # noqa: E402

pytestmark = pytest.mark.verl  # runs verl's own code: the verl tier


class Recording:
    """Server-side engine wrapper: remembers each sampled completion by its exact prompt."""

    def __init__(self, engine):
        self.engine = engine
        self.completions = {}

    async def generate(self, prompts, sampling):
        out = await self.engine.generate(prompts, sampling)
        for prompt, completion in zip(prompts, out, strict=True):
            self.completions[tuple(prompt)] = completion
        return out


class Replay:
    """Our rollout's engine: returns the recorded completion for the exact same context (KeyError otherwise)."""

    def __init__(self, completions):
        self.completions = completions

    async def generate(self, prompts, sampling):
        return [self.completions[tuple(p)] for p in prompts]


def test_agent_loop_through_verl_matches_our_rollout(tmp_path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    import agentrl
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.server import BackgroundServer, create_app
    from agentrl.engines.transformers_engine import TransformersEngine
    from agentrl.episodes import TokenPolicy, run_episode
    from agentrl.harmony import HarmonyFormat
    from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
    from agentrl.models.tiny import tiny_gpt_oss
    from agentrl.train.verl_backend.agent_loop import parse_spec
    from agentrl.train.verl_backend.config_map import verl_overrides
    from agentrl.train.verl_backend.dataset import write_env_dataset
    from agentrl.train.verl_backend.http_client import OpenAITokenClient
    from agentrl.train.verl_backend.validate import compose_verl_config

    env_name = register_multi_turn()
    model = tiny_gpt_oss(num_layers=1, hidden=64, seed=0)
    model_dir = tmp_path / "model"  # what verl's workers read: HF config + tokenizer
    model.config.architectures = ["GptOssForCausalLM"]
    model.config.save_pretrained(model_dir)
    harmony_hf_tokenizer().save_pretrained(model_dir)
    n, max_turns, max_new = 3, 3, 6
    train, val = write_env_dataset(tmp_path / "data", env_name, tasks="env", n_train=n, n_val=1, format="harmony",
                                   env_kwargs={"max_turns": max_turns}, max_new_tokens=max_new)
    cfg = {"env": env_name, "model": str(model_dir), "rollout": {"batch_size": n, "n": 1, "temperature": 1.0},
           "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
           "verl": {"max_prompt_length": 256, "max_response_length": 256}}
    vcfg = compose_verl_config(verl_overrides(cfg, [train], [val]))

    fmt = HarmonyFormat()
    recording = Recording(TransformersEngine(model, pad_token_id=0, seed=0))
    with BackgroundServer(create_app(recording, fmt, model_name="tiny-gpt-oss")) as server:
        worker = AgentLoopWorker(vcfg, OpenAITokenClient(vcfg, server.base_url))
        dataset = RLHFDataset([train], worker.tokenizer, vcfg.data)
        rows = [dataset[i] for i in range(n)]
        out = asyncio.run(worker.generate_sequences(DataProto.from_single_dict(collate_fn(rows))))

    b = out.batch
    assert b["responses"].shape == (n, 256) and b["prompts"].shape == (n, 256)
    for i, row in enumerate(rows):
        spec = parse_spec(row["agentrl"])
        env = agentrl.make(env_name, format=fmt, max_turns=max_turns)
        sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=fmt.stop_token_ids)
        policy = TokenPolicy(Replay(recording.completions), sampling)
        ours = asyncio.run(run_episode(env, policy, task=spec["task"], seed=0)).trajectory
        width = len(ours.response_ids)
        prompt_mask = b["attention_mask"][i, :256].bool()
        assert b["prompts"][i][prompt_mask].tolist() == ours.prompt_ids
        assert b["responses"][i, :width].tolist() == ours.response_ids
        assert b["attention_mask"][i, 256 + width :].sum() == 0  # nothing after our response
        assert b["response_mask"][i, :width].tolist() == ours.response_mask
        assert b["rollout_log_probs"][i, :width].tolist() == pytest.approx(ours.rollout_logprobs, abs=1e-6)
        assert float(b["rm_scores"][i].sum()) == pytest.approx(ours.reward) and ours.reward < 0
        assert int(out.non_tensor_batch["__num_turns__"][i]) == 1 + 2 * max_turns - 1
        # multi-turn: sampled tokens (mask 1, real log-probs) and env tokens (mask 0, log-prob 0)
        assert sum(ours.response_mask) == max_turns * max_new and 0 in ours.response_mask
        assert any(lp != 0.0 for lp in ours.rollout_logprobs)


def test_trajectory_to_output_contract():
    import numpy as np

    from agentrl.harmony.trajectory import Trajectory
    from agentrl.train.verl_backend.agent_loop import trajectory_to_output

    traj = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 0, 1],
                      rollout_logprobs=[-0.5, 0.0, -0.25], reward=0.75)
    routing = np.arange(6 * 2).reshape(6, 2)  # the server recorded one row too many
    out = trajectory_to_output(traj, {"generate_sequences": 1.0}, routed_experts=routing)
    assert (out.prompt_ids, out.response_ids, out.response_mask) == ([1, 2], [3, 4, 5], [1, 0, 1])
    assert out.response_logprobs == [-0.5, 0.0, -0.25] and out.reward_score == 0.75
    assert out.routed_experts.shape == (5, 2) and out.num_turns == 1
    no_lp = trajectory_to_output(traj, {}, logprobs=False)  # the server sent none: not zeros
    assert no_lp.response_logprobs is None and no_lp.routed_experts is None
    traj.response_mask = [1, 0]
    with pytest.raises(ValueError, match="lengths disagree"):
        trajectory_to_output(traj, {})


def test_weight_versions_reach_verl_and_episodes_are_saved(tmp_path):
    """verl's v1 trainer reads min/max_global_steps of every sample (its staleness metrics fail on None):
    the first generation's versions are kept and max_global_steps follows the last one. Finished episodes
    are appended per step and per worker process."""
    import json
    import os

    from agentrl.harmony.trajectory import Trajectory
    from agentrl.train.verl_backend.agent_loop import (
        VerlServerPolicy,
        save_trajectory,
        trajectory_file,
        trajectory_to_output,
    )

    policy = VerlServerPolicy(None, {}, [], max_new_tokens=4, prompt_length=16, env_name="x")
    policy.record({"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3, "num_cached_tokens": 5})
    policy.record({"global_steps": 4, "min_global_steps": 4, "max_global_steps": 4})
    assert policy.server_fields == {"global_steps": 3, "min_global_steps": 3, "max_global_steps": 4,
                                    "num_cached_tokens": 5}
    traj = Trajectory(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], rollout_logprobs=[-1.0, -2.0],
                      reward=1.0, reward_components={"correct": 1.0})
    out = trajectory_to_output(traj, {}, server_fields=policy.server_fields)
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)
    assert out.extra_fields["reward_components"] == {"correct": 1.0}

    row = {"global_steps": 4, "uid": "u-1", "task": {"id": "t7"}, "extra_info": {"split": "train"}}
    assert trajectory_file(str(tmp_path), row, policy.server_fields).endswith(f"step_000004-{os.getpid()}.jsonl")
    assert os.path.basename(trajectory_file("d", {"extra_info": {"split": "test"}}, {"global_steps": 2})) == \
        f"eval_step_000003-{os.getpid()}.jsonl"  # no row step (verl's legacy trainer): weights version + 1
    for _ in range(2):
        save_trajectory(str(tmp_path / "trajectories"), traj, row, policy.server_fields)
    lines = (tmp_path / "trajectories" / f"step_000004-{os.getpid()}.jsonl").read_text().splitlines()
    assert len(lines) == 2
    saved = Trajectory.from_json(lines[0])
    assert saved.response_ids == [2, 3] and saved.reward == 1.0
    assert (saved.task_id, saved.group, saved.policy_version) == ("t7", "u-1", 3)
    # an unwritable directory is logged, never raised: the episode still reaches verl
    (tmp_path / "file").write_text("")
    save_trajectory(str(tmp_path / "file" / "sub"), traj, row, policy.server_fields)
    assert json.loads(lines[1])["response_ids"] == [2, 3]


def test_env_registered_only_in_the_launching_process_is_built_from_its_entry_point():
    from agentrl.envs import env_class
    from agentrl.harmony import HarmonyFormat
    from agentrl.train.verl_backend.agent_loop import make_env

    with pytest.raises(KeyError):
        env_class("verl_add_entry_point_only")
    spec = {"env": "verl_add_entry_point_only", "entry_point": "_verl_test_env:AddEnv", "env_kwargs": {},
            "task": {"prompt": "What is 1 + 2?", "answer": "3"}, "format_reward": 0.5}
    env = make_env(spec, HarmonyFormat())
    assert type(env).__name__ == "AddEnv" and env_class("verl_add_entry_point_only").__name__ == "AddEnv"
    with pytest.raises(KeyError, match="no env named"):
        make_env({"env": "nowhere_env", "task": {}}, HarmonyFormat())
