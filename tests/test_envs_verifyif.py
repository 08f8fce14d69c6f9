"""verifyif: IFEval checkers and the env, on the real IFEval prompts with real Harmony tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from agentrl.data import dataset_path
from agentrl.envs.builtin.verifyif import VerifyIFEnv, make_prompt
from agentrl.envs.rewards.ifeval import CHECKERS, check, check_loose, follow_flags, split_sentences
from agentrl.harmony import default_format
from agentrl.harmony.types import Message

IFEVAL = dataset_path("ifeval")  # the IFEval prompts shipped in agentrl.data


def final(text: str) -> list[int]:
    return default_format().render_completion([Message("assistant", text, channel="final")])


@pytest.mark.parametrize(
    ("iid", "kwargs", "good", "bad"),
    [
        ("punctuation:no_comma", {}, "No commas here.", "One, two."),
        ("change_case:english_lowercase", {}, "this is all lowercase english text.", "This is Not."),
        ("change_case:english_capital", {}, "THIS IS ALL CAPITAL ENGLISH TEXT.", "THIS is not."),
        ("change_case:capital_word_frequency", {"capital_relation": "at least", "capital_frequency": 2},
         "THE BIG dog", "The BIG dog"),
        ("length_constraints:number_words", {"relation": "less than", "num_words": 5},
         "four words right here", "this has five words now"),
        ("length_constraints:number_sentences", {"relation": "at least", "num_sentences": 3},
         "One. Two! Three?", "Dr. Smith left. Fine."),
        ("length_constraints:number_paragraphs", {"num_paragraphs": 2},
         "para one\n***\npara two", "one\n***\n\n***\ntwo"),
        ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
         "First.\n\nThen, more.", "First.\n\nAnd more."),
        ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n- c"),
        ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and *two*", "*one* and ** **"),
        ("detectable_format:title", {}, "<<A Title>>\nbody", "<< >> body"),
        ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
        ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
         "Section 1\na\nSection 2\nb", "Section 1 only"),
        ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
        ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
        ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] at [address]", "[name] only"),
        ("keywords:existence", {"keywords": ["river", "bridge"]}, "A Bridge over the river.", "Only a river."),
        ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "A category of dogs.", "A Cat."),
        ("keywords:frequency", {"keyword": "sun", "relation": "at least", "frequency": 2}, "sun and Sun", "sun once"),
        ("keywords:letter_frequency", {"letter": "z", "let_relation": "less than", "let_frequency": 2}, "zoo", "zizz"),
        (
            "language:response_language",
            {"language": "de"},
            "Dies ist ein kurzer Satz, der auf Deutsch geschrieben wurde.",
            "This is a short sentence written in English.",
        ),
        ("startend:end_checker", {"end_phrase": "Any other questions?"},
         "Done. Any other questions?", "Any other questions? Done."),
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


def test_every_real_ifeval_row_is_checkable():
    tasks = VerifyIFEnv.tasks(path=str(IFEVAL), n=1000)
    assert len(tasks) == 541
    for t in tasks:
        flags = follow_flags(t, "A plain answer. It has two sentences.")
        assert len(flags) == len(t["instruction_id_list"])


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
        _, r, term, trunc, info = env.step(bad)  # no stop token: the episode is truncated
        assert (r, term, trunc) == (0.0, False, True) and info["errors"]


def test_generator_makes_checkable_consistent_tasks():
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = make_prompt(rng)
        assert 1 <= len(t["instruction_id_list"]) <= 3
        follow_flags(t, "Some answer.")
    check_env(VerifyIFEnv(), skip_render_check=True)


_FILLER = (
    "the people of the town ride old bicycles to work every day and they enjoy the fresh morning air "
    "while the children walk to school along the quiet streets near the park"
).split()


def _sentence(words: int, start: int, avoid: set[str]) -> str:
    filler = [w for w in _FILLER if w not in avoid]
    return " ".join(filler[(start + i) % len(filler)] for i in range(words)).capitalize() + "."


def _build(ids: list[str], kw: dict[str, dict], k: int, w: int) -> str:
    """A response with ``k`` body sentences of ``w`` words that addresses every constraint in ``ids``."""
    avoid = set(kw.get("keywords:forbidden_words", {}).get("forbidden_words", []))
    body = [_sentence(w, 7 * i, avoid) for i in range(k)]
    words = []  # everything a constraint asks to mention goes into one extra sentence
    if "keywords:existence" in kw:
        words += kw["keywords:existence"]["keywords"]
    if "keywords:frequency" in kw and kw["keywords:frequency"]["relation"] == "at least":
        words += [kw["keywords:frequency"]["keyword"]] * kw["keywords:frequency"]["frequency"]
    if "detectable_content:number_placeholders" in kw:
        words += [
            f"[slot{i}]" for i in range(kw["detectable_content:number_placeholders"]["num_placeholders"])
        ]
    if "detectable_format:number_highlighted_sections" in kw:
        words += [
            f"*part{i}*" for i in range(kw["detectable_format:number_highlighted_sections"]["num_highlights"])
        ]
    sentences = (["We mention " + " ".join(words) + "."] if words else []) + body
    if "length_constraints:number_paragraphs" in kw:
        n = kw["length_constraints:number_paragraphs"]["num_paragraphs"]
        if len(sentences) < n:
            return ""
        chunks = [sentences[i::n] for i in range(n)]
        text = "\n***\n".join(" ".join(c) for c in chunks)
    else:
        text = " ".join(sentences)
    if "detectable_format:number_bullet_lists" in kw:
        text += "\n" + "\n".join(
            f"* point {i}" for i in range(kw["detectable_format:number_bullet_lists"]["num_bullets"])
        )
    if "detectable_format:title" in kw:
        text = "<<a short title>>\n" + text
    if "detectable_content:postscript" in kw:
        text += f"\n{kw['detectable_content:postscript']['postscript_marker']} see you soon."
    if "combination:two_responses" in kw:
        text = f"{text}\n******\nAnother answer follows here."
    if "detectable_format:json_format" in kw:
        text = json.dumps({"answer": text})
    if "startend:end_checker" in kw:
        text += " " + kw["startend:end_checker"]["end_phrase"]
    if "startend:quotation" in kw:
        text = f'"{text}"'
    if "change_case:english_lowercase" in kw:
        text = text.lower()
    if "change_case:english_capital" in kw:
        text = text.upper()
    return text


def _solve(task: dict) -> str | None:
    """Search the builder's parameters for a response the checkers accept (None: none found)."""
    ids, kw = task["instruction_id_list"], dict(zip(task["instruction_id_list"], task["kwargs"], strict=True))
    for k in range(1, 13):
        for w in (3, 6, 10, 20, 45, 90, 200, 420):
            text = _build(ids, kw, k, w)
            if text and all(follow_flags(task, text)):
                return text
    return None


def test_generated_tasks_are_satisfiable():
    """Every offline-generated verifyif task admits a response that follows all of its constraints, so the
    maximum reward is reachable; a few are scored through the env."""
    tasks = VerifyIFEnv.tasks(n=150, seed=0) + VerifyIFEnv.tasks("test", n=50, seed=0)
    unsolved = [t for t in tasks if _solve(t) is None]
    assert not unsolved, [(t["instruction_id_list"], t["kwargs"]) for t in unsolved[:5]]
    env = VerifyIFEnv(strict_all=True)
    for t in tasks[:5]:
        env.reset(options={"task": t})
        assert env.step(final(_solve(t)))[1] == 1.0
