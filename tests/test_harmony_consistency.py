"""Generated multi-turn tool conversations: our prompts, completions, observations and trajectories are
token-identical to openai-harmony's renderers, and parse -> render round trips are exact."""

from __future__ import annotations

import json
import random

import openai_harmony as oh
import pytest

from agentrl.harmony import HarmonyFormat, Message, ToolSpec, TrajectoryBuilder
from agentrl.harmony.harmony_format import to_harmony_message

TOOLS = [
    ToolSpec(
        "lookup",
        "Look up a fact by key",
        {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    ),
    ToolSpec(
        "add",
        "Add two integers",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    ),
    ToolSpec("python", "", namespace="python"),
]
WORDS = "the a answer tool result café 日本 émoji 🙂 x=1 {json} <|start|> 42 \n step".split(" ")
N_CONVERSATIONS = 24


def text(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversation(seed: int) -> tuple[list[Message], dict]:
    """A random conversation: 1-3 user turns, each a chain of 0-3 tool calls (functions or python) with
    analysis, commentary preambles and tool results, ending with a final answer."""
    rng = random.Random(seed)
    functions = rng.sample(TOOLS[:2], rng.randint(1, 2))
    opts = {
        "instructions": text(rng) if rng.random() < 0.6 else None,
        "reasoning_effort": rng.choice(["low", "medium", "high"]),
        "tools": [*functions, TOOLS[2]],
    }
    msgs: list[Message] = []
    if rng.random() < 0.5:
        msgs.append(Message("system", text(rng)))
    for _ in range(rng.randint(1, 3)):
        msgs.append(Message("user", text(rng)))
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.7:
                msgs.append(Message("assistant", text(rng), channel="analysis"))
            if rng.random() < 0.3:
                msgs.append(Message("assistant", text(rng), channel="commentary"))
            if rng.random() < 0.7:
                name = rng.choice(functions).name
                args = {"key": text(rng, 1, 3)} if name == "lookup" else {"a": rng.randint(-9, 99), "b": 3}
                recipient = f"functions.{name}"
                msgs.append(
                    Message(
                        "assistant",
                        json.dumps(args),
                        channel="commentary",
                        recipient=recipient,
                        content_type="json",
                    )
                )
                msgs.append(Message("tool", json.dumps({"result": text(rng)}), name=recipient))
            else:
                code = f"print({rng.randint(0, 9)} + 1)"
                msgs.append(
                    Message("assistant", code, channel="analysis", recipient="python", content_type="code")
                )
                msgs.append(Message("tool", str(rng.randint(1, 10)), name="python", channel="analysis"))
        if rng.random() < 0.8:
            msgs.append(Message("assistant", text(rng), channel="analysis"))
        msgs.append(Message("assistant", text(rng), channel="final"))
    return msgs, opts


def model_turns(msgs: list[Message]) -> list[tuple[int, int]]:
    """(start, end) of each run of assistant messages that one completion produces: it ends at a tool call
    (``<|call|>``) or a final answer (``<|return|>``)."""
    spans, i = [], 0
    while i < len(msgs):
        if msgs[i].role != "assistant":
            i += 1
            continue
        j = i
        while not (msgs[j].recipient or msgs[j].channel == "final"):
            j += 1
        spans.append((i, j + 1))
        i = j + 1
    return spans


@pytest.fixture(scope="module")
def fmt() -> HarmonyFormat:
    return HarmonyFormat()


def official(fmt: HarmonyFormat, msgs: list[Message], opts: dict, drop: bool, *, training: bool) -> list[int]:
    """openai-harmony's own rendering, built from its API directly (system + developer + messages)."""
    system = oh.SystemContent.new().with_reasoning_effort(
        oh.ReasoningEffort(opts["reasoning_effort"].capitalize())
    )
    system = system.with_python_tool()
    lead = [m.content for m in msgs if m.role == "system"]
    body = [m for m in msgs if m.role != "system"]
    instructions = "\n\n".join(lead + ([opts["instructions"]] if opts["instructions"] else []))
    dev = oh.DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    dev = dev.with_function_tools(
        [
            oh.ToolDescription.new(t.name, t.description, t.parameters)
            for t in opts["tools"]
            if t.namespace == "functions"
        ]
    )
    hmsgs = [
        oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev),
        *[to_harmony_message(m) for m in body],
    ]
    conv = oh.Conversation.from_messages(hmsgs)
    cfg = oh.RenderConversationConfig(auto_drop_analysis=drop)
    if training:
        return fmt.encoding.render_conversation_for_training(conv, cfg)
    return fmt.encoding.render_conversation_for_completion(conv, oh.Role.ASSISTANT, cfg)


def rollout(fmt: HarmonyFormat, msgs: list[Message], opts: dict, policy: str, check):
    """Replay the conversation through TrajectoryBuilder as an env would; ``check(i, context)`` is called
    before each completion with the number of messages so far."""
    spans = model_turns(msgs)
    first = spans[0][0]
    prompt = fmt.render_prompt(
        msgs[:first],
        opts["tools"],
        instructions=opts["instructions"],
        reasoning_effort=opts["reasoning_effort"],
        analysis=policy,
    )
    b = TrajectoryBuilder(fmt, prompt, analysis=policy, tools=opts["tools"])
    rng = random.Random(len(msgs))
    for k, (s, e) in enumerate(spans):
        check(s, b.context_ids)
        completion = fmt.render_completion(msgs[s:e])
        parsed = b.add_model(completion, [-rng.random() for _ in completion])
        assert parsed.ok, parsed.errors
        env_end = spans[k + 1][0] if k + 1 < len(spans) else len(msgs)
        if env_end > e:
            b.add_env(fmt.render_observation(msgs[e:env_end], completion_ids=completion))
    return b


@pytest.mark.parametrize("seed", range(N_CONVERSATIONS))
def test_keep_policy_matches_official_renderers(fmt, seed):
    msgs, opts = conversation(seed)
    b = rollout(fmt, msgs, opts, "keep",
                lambda i, ctx: _assert_same(fmt, ctx, official(fmt, msgs[:i], opts, drop=False, training=False)))
    segs = b.finish(reward=1.0)
    last = segs[-1]
    _assert_same(fmt, last.prompt_ids + last.response_ids, official(fmt, msgs, opts, drop=False, training=True))
    n_user_turns = sum(m.role == "user" for m in msgs)
    assert len(segs) == n_user_turns  # a new segment only after each <|return|>
    _check_masks(fmt, segs, msgs)


@pytest.mark.parametrize("seed", range(N_CONVERSATIONS))
def test_drop_policy_matches_official_completion_renderer(fmt, seed):
    msgs, opts = conversation(seed)
    b = rollout(fmt, msgs, opts, "drop",
                lambda i, ctx: _assert_same(fmt, ctx, official(fmt, msgs[:i], opts, drop=True, training=False)))
    segs = b.finish()
    _check_masks(fmt, segs, msgs)
    # Our own whole-conversation rendering equals the official training rendering under the same policy.
    ours = fmt.render_training(
        msgs,
        opts["tools"],
        instructions=opts["instructions"],
        reasoning_effort=opts["reasoning_effort"],
        analysis="drop",
    )
    assert ours == official(fmt, msgs, opts, drop=True, training=True)


def test_single_user_turn_is_one_segment_under_both_policies(fmt):
    for seed in range(N_CONVERSATIONS):
        msgs, opts = conversation(seed)
        if sum(m.role == "user" for m in msgs) != 1:
            continue
        segs = {p: rollout(fmt, msgs, opts, p, lambda i, c: None).finish() for p in ("keep", "drop")}
        assert len(segs["keep"]) == len(segs["drop"]) == 1
        assert segs["keep"][0].to_dict() == segs["drop"][0].to_dict()


@pytest.mark.parametrize("seed", range(N_CONVERSATIONS))
def test_parse_render_round_trip(fmt, seed):
    msgs, opts = conversation(seed)
    for s, e in model_turns(msgs):
        completion = fmt.render_completion(msgs[s:e])
        turn = fmt.parse(completion, tools=opts["tools"])
        assert turn.ok, turn.errors
        assert turn.messages == msgs[s:e]
        theirs = fmt.encoding.parse_messages_from_completion_tokens(completion, oh.Role.ASSISTANT)
        assert [to_harmony_message(m).model_dump() for m in turn.messages] == [m.model_dump() for m in theirs]
        assert fmt.render_completion(turn.messages) == completion
        last = msgs[e - 1]
        if last.recipient:
            (call,) = turn.tool_calls
            assert call.recipient == last.recipient and call.raw_arguments == last.content
            assert turn.stop_token == fmt.tokens.call
        else:
            assert turn.final == last.content and turn.stop_token == fmt.tokens.return_


def _assert_same(fmt: HarmonyFormat, got: list[int], want: list[int]) -> None:
    if got != want:
        k = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        raise AssertionError(
            f"token streams differ at {k} (len {len(got)} vs {len(want)}):\n"
            f"ours:     {fmt.decode(got[max(0, k - 20) : k + 30])!r}\nofficial: {fmt.decode(want[max(0, k - 20) : k + 30])!r}"
        )


def _check_masks(fmt: HarmonyFormat, segs, msgs: list[Message]) -> None:
    """Mask 1 exactly on sampled ids (with their log-probs), 0 on env ids; each turn's spans tile the response."""
    for seg in segs:
        seg.validate()
        pos = 0
        for turn in seg.turns:
            a, b = turn.model_span
            assert a == pos and set(seg.response_mask[a:b]) == {1}
            assert all(lp < 0 for lp in seg.rollout_logprobs[a:b])
            c, d = turn.env_span
            assert c == b and set(seg.response_mask[c:d]) <= {0}
            assert all(lp == 0.0 for lp in seg.rollout_logprobs[c:d])
            pos = d
        assert pos == len(seg.response_ids)
