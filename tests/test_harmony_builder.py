"""TrajectoryBuilder: masks, log-probs, boundary rules and the analysis policies on hand-made episodes."""

from __future__ import annotations

import json

import pytest

from agentrl.harmony import HarmonyFormat, Message, ToolRecord, ToolSpec, Trajectory, TrajectoryBuilder

FMT = HarmonyFormat()
T = FMT.tokens
LOOKUP = ToolSpec("lookup", "Look up", {"type": "object", "properties": {"q": {"type": "string"}}})
CALL = Message(
    "assistant",
    json.dumps({"q": "x"}),
    channel="commentary",
    recipient="functions.lookup",
    content_type="json",
)
THINK = Message("assistant", "let me think", channel="analysis")
FINAL = Message("assistant", "It is 4.", channel="final")


def builder(analysis: str = "keep") -> TrajectoryBuilder:
    prompt = FMT.render_prompt([Message("user", "2+2?")], [LOOKUP], analysis=analysis)
    return TrajectoryBuilder(FMT, prompt, analysis=analysis, tools=[LOOKUP])


def test_tool_episode_masks_logprobs_and_records():
    b = builder()
    c1 = FMT.render_completion([THINK, CALL])
    parsed = b.add_model(c1, [-0.25] * len(c1))
    assert parsed.tool_calls[0].name == "lookup"
    obs = FMT.render_observation([Message("tool", "4", name="functions.lookup")], completion_ids=c1)
    b.add_env(obs, tools=[ToolRecord("lookup", {"q": "x"}, "4", latency_s=0.01)])
    c2 = FMT.render_completion([FINAL])
    b.add_model(c2)  # no log-probs from this engine
    (traj,) = b.finish(reward=1.0, terminated=True)
    assert traj.response_ids == c1 + obs + c2
    assert traj.response_mask == [1] * len(c1) + [0] * len(obs) + [1] * len(c2)
    assert traj.rollout_logprobs[: len(c1)] == [-0.25] * len(c1)
    assert traj.rollout_logprobs[len(c1) :] == [0.0] * (len(obs) + len(c2))
    assert traj.logprobs_missing is True and traj.num_segments == 1
    assert [t.model_span for t in traj.turns] == [(0, len(c1)), (len(c1) + len(obs), len(traj.response_ids))]
    assert traj.turns[0].env_span == (len(c1), len(c1) + len(obs)) and traj.turns[0].tools[0].result == "4"
    assert traj.turns[1].parsed.final == "It is 4." and traj.reward == 1.0 and traj.terminated
    assert Trajectory.from_json(traj.to_json()).to_dict() == traj.to_dict()


def test_appends_in_place():
    b = builder()
    ids, mask = b.trajectory.response_ids, b.trajectory.response_mask
    c1 = FMT.render_completion([CALL])
    b.add_model(c1)
    b.add_env(FMT.render_observation([Message("tool", "4", name="functions.lookup")], completion_ids=c1))
    assert b.trajectory.response_ids is ids and b.trajectory.response_mask is mask  # extended, never copied


def test_engine_stopping_at_end_continues_in_the_same_segment():
    b = builder()
    c1 = FMT.render_completion([THINK])  # ends with <|end|>
    assert c1[-1] == T.end
    b.add_model(c1)
    b.add_env(FMT.render_observation([], completion_ids=c1))  # just <|start|>assistant
    b.add_model(FMT.render_completion([FINAL]))
    assert len(b.finish()) == 1


def test_truncated_completion_is_closed_by_an_env_end_token():
    b = builder()
    c1 = FMT.render_completion([FINAL])[:-3]
    assert not b.add_model(c1).ok
    with pytest.raises(ValueError, match="truncated"):
        b.add_env(FMT.render_message(Message("user", "go on")) + FMT.assistant_header_ids)
    obs = FMT.render_observation([Message("user", "go on")], completion_ids=c1)
    b.add_env(obs)
    traj = b.trajectory
    assert traj.response_ids[len(c1)] == T.end and traj.response_mask[len(c1)] == 0


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda b, c: b.add_env(FMT.assistant_header_ids), "add_model first"),
        (lambda b, c: (b.add_model(c), b.add_model(c)), "two completions in a row"),
        (lambda b, c: b.add_model(c, [0.0]), "log-probs"),
        (lambda b, c: b.add_model([]), "empty"),
        (
            lambda b, c: (b.add_model(c), b.add_env(FMT.render_message(Message("user", "x")))),
            "end with <|start|>assistant",
        ),
        (
            lambda b, c: (b.add_model(c), b.add_env(FMT.encode("hello") + FMT.assistant_header_ids)),
            "must start with <|start|>",
        ),
    ],
)
def test_boundary_rule_violations_raise(action, match):
    b = builder()
    with pytest.raises(ValueError, match=match):
        action(b, FMT.render_completion([CALL]))


def test_prompt_must_end_with_assistant_header():
    with pytest.raises(ValueError, match="<|start|>assistant"):
        TrajectoryBuilder(FMT, FMT.encode("hello"))
    with pytest.raises(ValueError, match="analysis"):
        TrajectoryBuilder(FMT, FMT.assistant_header_ids, analysis="maybe")


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_follow_up_question_starts_a_new_segment(policy):
    """After <|return|> the sampled token stays (trained) in segment 0; the next prompt writes it as <|end|>
    and, under "drop", leaves out the earlier analysis."""
    b = builder(policy)
    c1 = FMT.render_completion([THINK, FINAL])
    b.add_model(c1, [-1.0] * len(c1))
    follow = [Message("user", "and 3+3?")]
    b.add_env(FMT.render_observation(follow, completion_ids=c1))
    first, second = b.finish()
    assert (
        first.response_ids == c1 and first.response_ids[-1] == T.return_ and set(first.response_mask) == {1}
    )
    assert second.response_ids == [] and second.prompt_ids[-2:] == FMT.assistant_header_ids
    expected = FMT.render_prompt([Message("user", "2+2?"), THINK, FINAL, *follow], [LOOKUP], analysis=policy)
    assert second.prompt_ids == expected
    assert ("let me think" in FMT.decode(second.prompt_ids)) == (policy == "keep")
