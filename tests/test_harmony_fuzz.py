"""Property tests: parsing arbitrary token garbage never raises, and streaming parse equals batch parse."""

from __future__ import annotations

import json

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.harmony import HarmonyFormat, Message, ToolSpec

TOOLS = [
    ToolSpec("lookup", "Look up", {"type": "object", "properties": {"q": {"type": "string"}}}),
    ToolSpec("python", "", namespace="python"),
]
FMT = HarmonyFormat()
T = FMT.tokens
FORMATTING = [T.start, T.end, T.message, T.channel, T.constrain, T.return_, T.call, 199999, 200014]
PIECES = [
    FMT.encode(s)
    for s in [
        "assistant",
        "analysis",
        "commentary",
        "final",
        " to=functions.lookup",
        " to=python",
        " json",
        '{"q":',
        '"x"}',
        "é",
        "🙂",
    ]
]
SETTINGS = settings(max_examples=examples(300))

token = st.one_of(
    st.integers(0, FMT.vocab_size - 1),
    st.sampled_from(FORMATTING),
    st.integers(-5, 300_000),  # out-of-vocabulary ids must not crash either
)
chunk = st.one_of(token.map(lambda t: [t]), st.sampled_from(PIECES))
garbage = st.lists(chunk, max_size=40).map(lambda cs: [t for c in cs for t in c])


messages = st.lists(
    st.sampled_from(
        [
            Message("assistant", "think 🙂", channel="analysis"),
            Message("assistant", "preamble", channel="commentary"),
        ]
    ),
    max_size=3,
).flatmap(
    lambda lead: st.sampled_from(
        [
            Message(
                "assistant",
                json.dumps({"q": "x"}),
                channel="commentary",
                recipient="functions.lookup",
                content_type="json",
            ),
            Message("assistant", "print(1)", channel="analysis", recipient="python", content_type="code"),
            Message("assistant", "done", channel="final"),
        ]
    ).map(lambda last: [*lead, last])
)


def _check(turn, ids) -> None:
    json.dumps(turn.to_dict())  # always serialisable
    for call in turn.tool_calls:
        assert isinstance(call.arguments, dict)
    if turn.ok:
        assert ids and turn.stop_token in (T.end, T.call, T.return_)
    if turn.stop_token is None:
        assert not turn.ok


@SETTINGS
@given(garbage)
def test_garbage_never_raises_and_stream_matches_batch(ids):
    turn = FMT.parse(ids, tools=TOOLS)
    _check(turn, ids)
    sp = FMT.streaming_parser(tools=TOOLS)
    for t in ids:
        sp.feed(t)
    assert sp.finish().to_dict() == turn.to_dict()


@SETTINGS
@given(messages, st.integers(0, 10_000), garbage)
def test_corrupted_valid_completions_never_raise(msgs, cut, noise):
    ids = FMT.render_completion(msgs)
    clean = FMT.parse(ids, tools=TOOLS)
    assert clean.ok and clean.messages == msgs
    k = cut % (len(ids) + 1)
    for variant in (ids[:k], ids[:k] + noise, noise + ids, ids[:k] + noise + ids[k:]):
        _check(FMT.parse(variant, tools=TOOLS), variant)


@pytest.mark.parametrize("k", range(1, 6))
def test_every_proper_prefix_of_a_call_is_flagged(k):
    ids = FMT.render_completion(
        [
            Message(
                "assistant",
                '{"q": "x"}',
                channel="commentary",
                recipient="functions.lookup",
                content_type="json",
            )
        ]
    )
    turn = FMT.parse(ids[:-k], tools=TOOLS)
    assert not turn.ok and not turn.tool_calls and turn.stop_token is None


@pytest.mark.parametrize("bad", [-1, -5, 201_088 + 10_000])
def test_streaming_ignores_out_of_vocabulary_ids_inside_content(bad):
    """An id outside the vocabulary inside message content adds no text and does not raise (CI found
    [<|message|>, -1] raising OverflowError in the streaming parser while the batch parser ignored it)."""
    sp = FMT.streaming_parser(tools=TOOLS)
    for t in [T.start, *FMT.encode("assistant"), T.message]:
        sp.feed(t)
    assert sp.feed(bad) == ""
    assert sp.feed(FMT.encode("hi")[0]) == "hi"
