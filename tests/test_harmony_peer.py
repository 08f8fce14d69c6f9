"""Peer suite: openai/harmony's own rendered test conversations (``test-data/*.txt``, Apache-2.0) run through
our layer. They are vendored in ``tests/data/harmony_peer`` (v0.0.8, with their licence); set
``AGENTRL_HARMONY_TESTDATA`` to another checkout's ``test-data`` directory to run a different version.

For every file: text <-> ids round-trips. Conversation files: each assistant message parses cleanly with our
parser and re-renders token-identically; user and tool messages re-render identically through our
``Message`` mapping. Completion files: our parser recovers the same messages as openai-harmony's.
"""

from __future__ import annotations

import os
from pathlib import Path

import openai_harmony as oh
import pytest

from agentrl.harmony import HarmonyFormat, Message

DATA = Path(os.environ.get("AGENTRL_HARMONY_TESTDATA", Path(__file__).parent / "data" / "harmony_peer"))
FILES = sorted(DATA.glob("*.txt"))
if not FILES:
    raise FileNotFoundError(f"no openai/harmony test-data *.txt files in {DATA}")
FMT = HarmonyFormat()
T = FMT.tokens


def _ids(path: Path) -> list[int]:
    text = path.read_text(encoding="utf-8")
    if text.split() and all(w.isdigit() for w in text.split()):
        return [int(w) for w in text.split()]
    text = text.rstrip()
    ids = FMT.encoding.encode(text, allowed_special="all")
    assert FMT.decode(ids) == text
    return ids


def _units(ids: list[int]) -> list[list[int]]:
    """Split a rendered conversation at <|start|> tokens."""
    starts = [i for i, t in enumerate(ids) if t == T.start]
    return [ids[a:b] for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]


def _ours(m: oh.Message) -> Message:
    d = m.to_dict()
    ct = d.get("content_type")
    return Message(
        role=d["role"],
        content="".join(c["text"] for c in d["content"]),
        channel=d.get("channel"),
        recipient=d.get("recipient"),
        name=d.get("name"),
        content_type="json" if ct == "<|constrain|>json" else ct,
    )


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_peer_file(path):
    ids = _ids(path)
    if ids[0] != T.start:  # a completion: compare with openai-harmony's lenient parse
        theirs = [
            _ours(m)
            for m in FMT.encoding.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT, strict=False)
        ]
        turn = FMT.parse(ids)
        assert [
            (m.channel, m.recipient, m.content_type, m.content)
            for m in turn.messages
            if m.role == "assistant"
        ] == [(m.channel, m.recipient, m.content_type, m.content) for m in theirs if m.role == "assistant"]
        return
    header = FMT.assistant_header_ids
    for unit in _units(ids):
        if unit == header:  # the trailing "<|start|>assistant" of a completion prompt
            continue
        if unit[: len(header)] == header:
            body = unit[len(header) :]
            turn = FMT.parse(body)
            assert turn.ok, (FMT.decode(unit), turn.errors)
            stop = "auto" if body[-1] == T.return_ else "end"
            assert FMT.render_completion(turn.messages, stop=stop) == body
            continue
        try:
            (msg,) = FMT.encoding.parse_messages_from_completion_tokens(unit, None, strict=False)
        except oh.HarmonyError:
            # openai-harmony itself cannot read back a tool header without channel or recipient
            assert FMT.decode(unit).startswith("<|start|>functions."), FMT.decode(unit)
            continue
        ours = _ours(msg)
        if ours.role == "user" or (ours.role == "tool" and ours.channel):
            rendered = FMT.render_message(ours)
            if unit[-1] not in (T.end, T.call, T.return_):  # the file stops before the terminator
                rendered = rendered[:-1]
            assert rendered == unit, FMT.decode(unit)
