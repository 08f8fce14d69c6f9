"""StreamingParser: incremental deltas, live channel/recipient, and the same result as a batch parse."""

from __future__ import annotations

import json

from agentrl.harmony import HarmonyFormat, Message, ParseErrorKind, ToolSpec
from agentrl.harmony.harmony_parser import ParserState

FMT = HarmonyFormat()
LOOKUP = ToolSpec("lookup", "Look up", {"type": "object", "properties": {"q": {"type": "string"}}})


def test_deltas_rebuild_each_message_and_state_is_live():
    msgs = [
        Message("assistant", "日本語 🙂 café, naïve — ok", channel="analysis"),
        Message("assistant", json.dumps({"q": "ß🙂"}), channel="commentary", recipient="functions.lookup",
                content_type="json"),
    ]
    ids = FMT.render_completion(msgs)
    sp = FMT.streaming_parser(tools=[LOOKUP])
    texts: list[str] = []
    seen: list[tuple[str | None, str | None]] = []
    current = ""
    for t in ids:
        was_content = sp.state is ParserState.CONTENT
        current += sp.feed(t)
        if sp.state is ParserState.CONTENT:
            seen.append((sp.channel, sp.recipient))
        elif was_content:
            texts.append(current)
            current = ""
    assert texts == [m.content for m in msgs]
    assert ("analysis", None) in seen and ("commentary", "functions.lookup") in seen
    assert sp.stopped and sp.tool_calls[0].arguments == {"q": "ß🙂"}
    assert sp.finish().to_dict() == FMT.parse(ids, tools=[LOOKUP]).to_dict()


def test_multibyte_character_split_across_tokens_is_not_garbled():
    # a character whose UTF-8 bytes span several tokens must come out whole, once
    ids = FMT.render_completion([Message("assistant", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⚙️", channel="final")])
    sp = FMT.streaming_parser()
    out = "".join(sp.feed(t) for t in ids)
    assert out == "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⚙️" and "\ufffd" not in out


def test_truncated_stream_reports_truncation():
    ids = FMT.render_completion([Message("assistant", "partial answer", channel="final")])[:-2]
    sp = FMT.streaming_parser()
    for t in ids:
        sp.feed(t)
    assert not sp.stopped
    turn = sp.finish()
    assert [e.kind for e in turn.errors] == [ParseErrorKind.TRUNCATED] and turn.final is None
