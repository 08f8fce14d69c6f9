"""IFEval-style verifiable instruction checkers, written from the IFEval paper's definitions, with no nltk.

``check(instruction_id, response, kwargs, prompt)`` returns whether ``response`` follows one instruction
(ids as in IFEval's ``input_data.jsonl``, e.g. ``"punctuation:no_comma"``). ``CHECKERS`` lists every
supported id. Words are ``\\w+`` runs; sentences are split on ``.``/``!``/``?`` followed by whitespace with
common abbreviations kept; the language check uses ``langdetect`` (seeded, so it is deterministic).
Loose scoring (:func:`check_loose`) also accepts the response without its first/last line or without
markdown asterisks, as IFEval's loose metric does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Checker = Callable[[str, dict[str, Any], str], bool]


def _relation(count: int, relation: str, n: int) -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise ValueError(f"relation must be 'less than' or 'at least', got {relation!r}")


def count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))


_ABBREV = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|vs|etc|e\.g|i\.e|Inc|Ltd|Co|No|U\.S)\.$", re.I)


def split_sentences(text: str) -> list[str]:
    """Sentences: split after ``.``/``!``/``?`` (and closing quotes) followed by whitespace, except after
    common abbreviations, initials and decimal points."""
    parts: list[str] = []
    start = 0
    for m in re.finditer(r"[.!?]+[\"')\]]*(?=\s|$)", text):
        candidate = text[start : m.end()]
        if _ABBREV.search(candidate) or re.search(r"(?:^|\s)[A-Z]\.$", candidate):
            continue
        if candidate.strip():
            parts.append(candidate.strip())
        start = m.end()
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _capital_word_frequency(r: str, kw: dict[str, Any], p: str) -> bool:
    words = re.findall(r"\b[^\W\d_]+(?:['’][^\W\d_]+)?\b", r)
    return _relation(
        sum(1 for w in words if w.isupper()), kw["capital_relation"], int(kw["capital_frequency"])
    )


def _language(r: str, kw: dict[str, Any], p: str) -> bool:
    from langdetect import DetectorFactory, LangDetectException, detect

    DetectorFactory.seed = 0
    try:
        return detect(r) == kw["language"]
    except LangDetectException:
        return True  # nothing detectable (e.g. only digits): IFEval counts it as followed


def _english_capital(r: str, kw: dict[str, Any], p: str) -> bool:
    return r.isupper() and _language(r, {"language": "en"}, p)


def _english_lowercase(r: str, kw: dict[str, Any], p: str) -> bool:
    return r.islower() and _language(r, {"language": "en"}, p)


def _repeat_prompt(r: str, kw: dict[str, Any], p: str) -> bool:
    return r.strip().lower().startswith(str(kw["prompt_to_repeat"]).strip().lower())


def _two_responses(r: str, kw: dict[str, Any], p: str) -> bool:
    parts = r.split("******")
    if len(parts) != 2:
        return False
    a, b = (x.strip() for x in parts)
    return bool(a) and bool(b) and a != b


def _placeholders(r: str, kw: dict[str, Any], p: str) -> bool:
    return len(re.findall(r"\[.*?\]", r)) >= int(kw["num_placeholders"])


def _postscript(r: str, kw: dict[str, Any], p: str) -> bool:
    marker = str(kw["postscript_marker"]).strip().lower()
    if marker == "p.p.s":
        pat = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "p.s.":
        pat = r"\s*p\.\s?s\..*$"
    else:
        pat = r"\s*" + re.escape(marker) + r".*$"
    return re.search(pat, r.lower(), flags=re.M) is not None


def _constrained(r: str, kw: dict[str, Any], p: str) -> bool:
    return any(opt in r.strip() for opt in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def _json_format(r: str, kw: dict[str, Any], p: str) -> bool:
    t = r.strip()
    t = re.sub(r"^```(?:json|Json|JSON)?\s*", "", t)
    t = re.sub(r"\s*```$", "", t)
    try:
        json.loads(t)
    except ValueError:
        return False
    return True


def _multiple_sections(r: str, kw: dict[str, Any], p: str) -> bool:
    splitter = str(kw["section_spliter"]).strip()
    sections = re.split(r"\s?" + re.escape(splitter) + r"\s?\d+\s?", r)
    return len(sections) - 1 >= int(kw["num_sections"])


def _bullets(r: str, kw: dict[str, Any], p: str) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", r, flags=re.M)
    dashes = re.findall(r"^\s*-.*$", r, flags=re.M)
    return len(stars) + len(dashes) == int(kw["num_bullets"])


def _highlights(r: str, kw: dict[str, Any], p: str) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", r) if h.strip("*").strip()]
    double = [
        h for h in re.findall(r"\*\*[^\n\*]*\*\*", r) if h.removeprefix("**").removesuffix("**").strip()
    ]
    return len(single) + len(double) >= int(kw["num_highlights"])


def _title(r: str, kw: dict[str, Any], p: str) -> bool:
    return any(t.strip("<>").strip() for t in re.findall(r"<<[^\n]+>>", r))


def _existence(r: str, kw: dict[str, Any], p: str) -> bool:
    return all(re.search(re.escape(k), r, flags=re.I) for k in kw["keywords"])


def _forbidden(r: str, kw: dict[str, Any], p: str) -> bool:
    return not any(re.search(r"\b" + re.escape(w) + r"\b", r, flags=re.I) for w in kw["forbidden_words"])


def _frequency(r: str, kw: dict[str, Any], p: str) -> bool:
    n = len(re.findall(re.escape(str(kw["keyword"])), r, flags=re.I))
    return _relation(n, kw["relation"], int(kw["frequency"]))


def _letter_frequency(r: str, kw: dict[str, Any], p: str) -> bool:
    n = r.lower().count(str(kw["letter"]).lower())
    return _relation(n, kw["let_relation"], int(kw["let_frequency"]))


def _paragraphs_by_stars(r: str) -> list[str]:
    return re.split(r"\s?\*\*\*\s?", r)


def _number_paragraphs(r: str, kw: dict[str, Any], p: str) -> bool:
    paras = _paragraphs_by_stars(r)
    n = len(paras)
    for i, para in enumerate(paras):
        if not para.strip():
            if i in (0, len(paras) - 1):
                n -= 1
            else:
                return False
    return n == int(kw["num_paragraphs"])


def _nth_paragraph_first_word(r: str, kw: dict[str, Any], p: str) -> bool:
    paras = [x for x in re.split(r"\n\n", r) if x.strip()]
    nth, total = int(kw["nth_paragraph"]), int(kw["num_paragraphs"])
    if len(paras) != total or nth > total or nth < 1:
        return False
    words = paras[nth - 1].strip().split()
    if not words:
        return False
    first = re.sub(r"^[\W_]+|[\W_]+$", "", words[0]).lower()
    return first == str(kw["first_word"]).lower()


def _number_sentences(r: str, kw: dict[str, Any], p: str) -> bool:
    return _relation(len(split_sentences(r)), kw["relation"], int(kw["num_sentences"]))


def _number_words(r: str, kw: dict[str, Any], p: str) -> bool:
    return _relation(count_words(r), kw["relation"], int(kw["num_words"]))


def _no_comma(r: str, kw: dict[str, Any], p: str) -> bool:
    return "," not in r


def _end_checker(r: str, kw: dict[str, Any], p: str) -> bool:
    return r.strip().strip('"').lower().endswith(str(kw["end_phrase"]).strip().lower())


def _quotation(r: str, kw: dict[str, Any], p: str) -> bool:
    t = r.strip()
    return len(t) > 1 and t[0] == '"' and t[-1] == '"'


CHECKERS: dict[str, Checker] = {
    "change_case:capital_word_frequency": _capital_word_frequency,
    "change_case:english_capital": _english_capital,
    "change_case:english_lowercase": _english_lowercase,
    "combination:repeat_prompt": _repeat_prompt,
    "combination:two_responses": _two_responses,
    "detectable_content:number_placeholders": _placeholders,
    "detectable_content:postscript": _postscript,
    "detectable_format:constrained_response": _constrained,
    "detectable_format:json_format": _json_format,
    "detectable_format:multiple_sections": _multiple_sections,
    "detectable_format:number_bullet_lists": _bullets,
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:title": _title,
    "keywords:existence": _existence,
    "keywords:forbidden_words": _forbidden,
    "keywords:frequency": _frequency,
    "keywords:letter_frequency": _letter_frequency,
    "language:response_language": _language,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:number_sentences": _number_sentences,
    "length_constraints:number_words": _number_words,
    "punctuation:no_comma": _no_comma,
    "startend:end_checker": _end_checker,
    "startend:quotation": _quotation,
}


def check(instruction_id: str, response: str, kwargs: dict[str, Any] | None = None, prompt: str = "") -> bool:
    """Whether ``response`` follows one instruction (strict). An empty response follows nothing.

    Raises:
        KeyError: for an unknown instruction id (the message lists the supported ones).
    """
    if instruction_id not in CHECKERS:
        raise KeyError(f"unknown IFEval instruction {instruction_id!r}; supported: {sorted(CHECKERS)}")
    if not response.strip():
        return False
    return bool(CHECKERS[instruction_id](response, kwargs or {}, prompt))


def loose_variants(response: str) -> list[str]:
    """The response plus versions without its first line, last line, both, and without ``*``."""
    lines = response.split("\n")
    base = [
        response,
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    ]
    return base + [b.replace("*", "") for b in base]


def check_loose(
    instruction_id: str, response: str, kwargs: dict[str, Any] | None = None, prompt: str = ""
) -> bool:
    """IFEval's loose criterion: any of :func:`loose_variants` follows the instruction."""
    return any(v.strip() and check(instruction_id, v, kwargs, prompt) for v in loose_variants(response))


def follow_flags(task: dict[str, Any], response: str | None, *, loose: bool = False) -> list[bool]:
    """One flag per instruction of an IFEval task (``instruction_id_list``/``kwargs``)."""
    if response is None:
        return [False] * len(task["instruction_id_list"])
    fn = check_loose if loose else check
    return [
        fn(i, response, kw, task.get("prompt", ""))
        for i, kw in zip(task["instruction_id_list"], task["kwargs"], strict=True)
    ]


class IFEvalScore:
    """Verifier over the final answer: the fraction of the task's instructions followed, or (``all_=True``)
    1.0 only if every instruction is followed (IFEval's prompt-level accuracy)."""

    def __init__(self, *, all_: bool = False, loose: bool = False) -> None:
        self.all_, self.loose = all_, loose
        self.name = ("ifeval_all" if all_ else "ifeval_fraction") + ("_loose" if loose else "")

    def __call__(self, ctx: Any) -> float:
        flags = follow_flags(ctx.task, ctx.final, loose=self.loose)
        if not flags:
            return 1.0
        return float(all(flags)) if self.all_ else sum(flags) / len(flags)
