"""HarmonyFormat: prompts, parsing, observations and stop ids against openai-harmony."""

from __future__ import annotations

import textwrap

import openai_harmony as oh
import pytest
from _no_torch import check_imports_without_torch

from agentrl.harmony import HarmonyFormat, Message, ParseErrorKind, ToolSpec

LOOKUP = ToolSpec("lookup", "Look up a fact", {"type": "object", "properties": {"q": {"type": "string"}}})
PYTHON = ToolSpec("python", "", namespace="python")


@pytest.fixture(scope="module")
def fmt() -> HarmonyFormat:
    return HarmonyFormat(reasoning_effort="low")


def ids(fmt: HarmonyFormat, text: str) -> list[int]:
    """Text with literal special tokens -> ids (test helper)."""
    return fmt.encoding.encode(text, allowed_special="all")


def test_import_and_use_without_torch_or_transformers():
    """The core path works with torch, transformers and tiktoken made unimportable."""
    code = textwrap.dedent(
        """
        import agentrl.harmony as h
        fmt = h.HarmonyFormat()
        prompt = fmt.render_prompt([h.Message("user", "hi")])
        turn = fmt.parse(fmt.render_completion([h.Message("assistant", "ok", channel="final")]))
        assert turn.final == "ok", turn
        b = h.TrajectoryBuilder(fmt, prompt)
        """
    )
    check_imports_without_torch([], code, also_blocked=("tiktoken",))


def test_prompt_matches_official_renderer(fmt):
    e = fmt.encoding
    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.LOW)
    dev = (
        oh.DeveloperContent.new()
        .with_instructions("Be terse.\n\nUse tools.")
        .with_function_tools([oh.ToolDescription.new(LOOKUP.name, LOOKUP.description, LOOKUP.parameters)])
    )
    conv = oh.Conversation.from_messages(
        [
            oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
            oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev),
            oh.Message.from_role_and_content(oh.Role.USER, "hi"),
        ]
    )
    want = e.render_conversation_for_completion(conv, oh.Role.ASSISTANT)
    got = fmt.render_prompt(
        [Message("system", "Be terse."), Message("user", "hi")], [LOOKUP], instructions="Use tools."
    )
    assert got == want
    assert got[-2:] == fmt.assistant_header_ids


def test_python_tool_goes_to_system_message(fmt):
    text = fmt.decode(fmt.render_prompt([Message("user", "x")], [PYTHON]))
    system = text.split("<|end|>")[0]
    assert "## python" in system and "<|start|>developer" not in text


def test_parse_tool_call_after_analysis(fmt):
    c = ids(
        fmt,
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary to=functions.lookup "
        '<|constrain|>json<|message|>{"q":"x"}<|call|>',
    )
    turn = fmt.parse(c, tools=[LOOKUP])
    assert turn.ok, turn.errors
    assert [m.channel for m in turn.messages] == ["analysis", "commentary"]
    (call,) = turn.tool_calls
    assert (call.recipient, call.name, call.arguments, call.channel) == (
        "functions.lookup",
        "lookup",
        {"q": "x"},
        "commentary",
    )
    assert turn.stop_token == fmt.tokens.call and turn.final is None


def test_parse_final(fmt):
    turn = fmt.parse(ids(fmt, "<|channel|>final<|message|>The answer is 4<|return|>"))
    assert turn.ok and turn.final == "The answer is 4" and turn.stop_token == fmt.tokens.return_


def test_python_call_in_analysis_is_allowed(fmt):
    turn = fmt.parse(
        ids(fmt, "<|channel|>analysis to=python code<|message|>print(1)<|call|>"), tools=[PYTHON]
    )
    assert turn.ok
    assert turn.tool_calls[0].arguments == {"code": "print(1)"}


@pytest.mark.parametrize(
    "text, kind",
    [
        ("<|channel|>final<|message|>The answ", ParseErrorKind.TRUNCATED),
        ("Just an answer<|return|>", ParseErrorKind.NO_HEADER),
        (
            '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"q": <|call|>',
            ParseErrorKind.BAD_JSON,
        ),
        (
            "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>[1]<|call|>",
            ParseErrorKind.BAD_JSON,
        ),
        (
            "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
            ParseErrorKind.UNKNOWN_RECIPIENT,
        ),
        (
            "<|channel|>analysis to=functions.lookup <|constrain|>json<|message|>{}<|call|>",
            ParseErrorKind.CALL_IN_ANALYSIS,
        ),
        ("<|channel|>final<|message|>a<|start|>b<|return|>", ParseErrorKind.STRAY_SPECIAL),
        ("<|channel|>final<|message|>a<|endoftext|><|return|>", ParseErrorKind.STRAY_SPECIAL),
        ("<|channel|>chatter<|message|>a<|return|>", ParseErrorKind.MALFORMED),
        ("<|channel|>final<|message|>a<|end|><|start|>user<|message|>hi<|end|>", ParseErrorKind.MALFORMED),
        ("", ParseErrorKind.EMPTY),
        ("<|return|>", ParseErrorKind.NO_HEADER),
    ],
)
def test_malformed_output_becomes_errors(fmt, text, kind):
    turn = fmt.parse(ids(fmt, text), tools=[LOOKUP])
    assert kind in {e.kind for e in turn.errors}, turn.errors
    assert not turn.tool_calls


def test_truncated_final_is_not_a_final(fmt):
    turn = fmt.parse(ids(fmt, "<|channel|>final<|message|>The answ"))
    assert turn.final is None and turn.stop_token is None
    assert turn.messages[-1].content == "The answ"


def test_observation_for_tool_result_and_user(fmt):
    c = ids(fmt, '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"q":"x"}<|call|>')
    obs = fmt.render_observation([Message("tool", "42", name="functions.lookup")], completion_ids=c)
    assert fmt.decode(obs) == (
        "<|start|>functions.lookup to=assistant<|channel|>commentary<|message|>42<|end|><|start|>assistant"
    )
    obs = fmt.render_observation([Message("user", "more?")], completion_ids=c)
    assert fmt.decode(obs) == "<|start|>user<|message|>more?<|end|><|start|>assistant"


def test_observation_closes_a_truncated_completion(fmt):
    obs = fmt.render_observation(
        [Message("user", "go on")], completion_ids=ids(fmt, "<|channel|>final<|message|>ab")
    )
    assert obs[0] == fmt.tokens.end


def test_observation_rejects_bad_messages(fmt):
    with pytest.raises(ValueError, match="name"):
        fmt.render_observation([Message("tool", "42")], completion_ids=[])
    with pytest.raises(ValueError, match="assistant"):
        fmt.render_observation([Message("assistant", "hi", channel="final")], completion_ids=[])


def test_stop_ids_vocab_and_text(fmt):
    assert sorted(fmt.stop_token_ids) == sorted([fmt.tokens.call, fmt.tokens.return_]) == [200002, 200012]
    assert fmt.vocab_size == 201088
    assert fmt.decode(fmt.encode("héllo <|start|>")) == "héllo <|start|>"
    assert fmt.tokens.start not in fmt.encode("<|start|>")


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="analysis"):
        HarmonyFormat(analysis="sometimes")
    with pytest.raises(ValueError, match="reasoning_effort"):
        HarmonyFormat(reasoning_effort="extreme")
