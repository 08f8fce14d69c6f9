"""verifyif: IFEval checkers and the env, on the real IFEval prompts with real Harmony tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from agentrl.envs import default_format
from agentrl.envs.builtin.verifyif import VerifyIFEnv, make_prompt
from agentrl.envs.rewards.ifeval import CHECKERS, check, check_loose, follow_flags, split_sentences
from agentrl.harmony.types import Message

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
IFEVAL = DATA / "ifeval" / "input_data.jsonl"
needs_data = pytest.mark.skipif(not IFEVAL.is_file(), reason=f"IFEval data not found at {IFEVAL}")


def final(text: str) -> list[int]:
    return default_format().render_completion([Message("assistant", text, channel="final")])


@pytest.mark.parametrize(
    ("iid", "kwargs", "good", "bad"),
    [
        ("punctuation:no_comma", {}, "No commas here.", "One, two."),
        ("change_case:english_lowercase", {}, "this is all lowercase english text.", "This is Not."),
        ("change_case:english_capital", {}, "THIS IS ALL CAPITAL ENGLISH TEXT.", "THIS is not."),
        (
            "change_case:capital_word_frequency",
            {"capital_relation": "at least", "capital_frequency": 2},
            "THE BIG dog",
            "The BIG dog",
        ),
        (
            "length_constraints:number_words",
            {"relation": "less than", "num_words": 5},
            "four words right here",
            "this has five words now",
        ),
        (
            "length_constraints:number_sentences",
            {"relation": "at least", "num_sentences": 3},
            "One. Two! Three?",
            "Dr. Smith left. Fine.",
        ),
        (
            "length_constraints:number_paragraphs",
            {"num_paragraphs": 2},
            "para one\n***\npara two",
            "one\n***\n\n***\ntwo",
        ),
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
            "First.\n\nThen, more.",
            "First.\n\nAnd more.",
        ),
        ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n- c"),
        (
            "detectable_format:number_highlighted_sections",
            {"num_highlights": 2},
            "*one* and *two*",
            "*one* and ** **",
        ),
        ("detectable_format:title", {}, "<<A Title>>\nbody", "<< >> body"),
        ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
        (
            "detectable_format:multiple_sections",
            {"section_spliter": "Section", "num_sections": 2},
            "Section 1\na\nSection 2\nb",
            "Section 1 only",
        ),
        ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
        ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
        (
            "detectable_content:number_placeholders",
            {"num_placeholders": 2},
            "[name] at [address]",
            "[name] only",
        ),
        (
            "keywords:existence",
            {"keywords": ["river", "bridge"]},
            "A Bridge over the river.",
            "Only a river.",
        ),
        ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "A category of dogs.", "A Cat."),
        (
            "keywords:frequency",
            {"keyword": "sun", "relation": "at least", "frequency": 2},
            "sun and Sun",
            "sun once",
        ),
        (
            "keywords:letter_frequency",
            {"letter": "z", "let_relation": "less than", "let_frequency": 2},
            "zoo",
            "zizz",
        ),
        (
            "language:response_language",
            {"language": "de"},
            "Dies ist ein kurzer Satz, der auf Deutsch geschrieben wurde.",
            "This is a short sentence written in English.",
        ),
        (
            "startend:end_checker",
            {"end_phrase": "Any other questions?"},
            "Done. Any other questions?",
            "Any other questions? Done.",
        ),
        ("startend:quotation", {}, '"quoted"', 'not "quoted"'),
        ("combination:two_responses", {}, "first******second", "same******same"),
        ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "Say hi. Hi!", "Hi! Say hi."),
    ],
)
def test_each_checker(iid, kwargs, good, bad):
    assert check(iid, good, kwargs) is True
    assert check(iid, bad, kwargs) is False
    assert check(iid, "", kwargs) is False


def test_checker_registry_covers_ifeval_and_loose_mode():
    assert len(CHECKERS) == 25
    with pytest.raises(KeyError, match="supported"):
        check("nope:nope", "x")
    # Loose: a chatty first line is forgiven.
    assert not check("startend:quotation", 'Sure!\n"quoted"')
    assert check_loose("startend:quotation", 'Sure!\n"quoted"')
    assert split_sentences("Mr. Smith went to Washington. He saw 3.5 apples! Then? Done") == [
        "Mr. Smith went to Washington.",
        "He saw 3.5 apples!",
        "Then?",
        "Done",
    ]


@needs_data
def test_every_real_ifeval_row_is_checkable():
    tasks = VerifyIFEnv.tasks(path=str(IFEVAL), n=1000)
    assert len(tasks) == 541
    for t in tasks:
        flags = follow_flags(t, "A plain answer. It has two sentences.")
        assert len(flags) == len(t["instruction_id_list"])


@needs_data
def test_verifyif_episodes_on_real_prompts():
    rows = {json.loads(line)["key"]: line for line in IFEVAL.read_text().splitlines()}
    assert 1001 in rows
    tasks = {t["id"]: t for t in VerifyIFEnv.tasks(path=str(IFEVAL), n=1000)}
    env = VerifyIFEnv()
    no_comma = tasks[1001]  # Shakespearean itinerary without commas
    env.reset(options={"task": no_comma})
    _, r, term, trunc, info = env.step(final("Hark thou shalt see Kyoto at dawn and Nara by dusk."))
    assert (r, term, trunc) == (1.0, True, False)
    env.reset(options={"task": no_comma})
    assert env.step(final("First, Kyoto; then, Nara."))[1] == 0.0
    three = tasks[1000]  # no comma + 3 highlighted sections + at least 300 words
    text = " ".join(["word"] * 300) + " *part one* *part two* *part three*"
    env.reset(options={"task": three})
    _, r, *_, info = env.step(final(text))
    assert r == 1.0 and info["reward_components"] == {"ifeval_fraction": 1.0, "ifeval_all": 1.0}
    env.reset(options={"task": three})
    _, r, *_, info = env.step(final(text.replace("word word", "word, word", 1)))
    assert r == pytest.approx(2 / 3) and info["reward_components"]["ifeval_all"] == 0.0
    strict = VerifyIFEnv(strict_all=True)
    strict.reset(options={"task": three})
    assert strict.step(final(text.replace("word word", "word, word", 1)))[1] == 0.0
    for bad in ([], default_format().encode("cut off, mid")):
        env.reset(options={"task": no_comma})
        _, r, term, _, info = env.step(bad)
        assert (r, term) == (0.0, True) and info["errors"]


def test_generator_makes_checkable_consistent_tasks():
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = make_prompt(rng)
        assert 1 <= len(t["instruction_id_list"]) <= 3
        follow_flags(t, "Some answer.")
    check_env(VerifyIFEnv(), skip_render_check=True)
