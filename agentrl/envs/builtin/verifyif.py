"""``verifyif``: verifiable instruction following (IFEval style); the final answer is checked in code.

Each task has a ``prompt`` and IFEval's ``instruction_id_list``/``kwargs``. The reward is the fraction of
instructions the final answer follows (``strict_all=True``: 1.0 only if all are followed); both numbers are
always recorded as reward components (``ifeval_fraction``, ``ifeval_all``). Tasks: the offline generator
(writing requests combined with 1-3 constraints), a local IFEval ``input_data.jsonl``, or the hub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from agentrl.envs.env import AgentEnv, EnvLimits
from agentrl.envs.rewards import Rubric
from agentrl.envs.rewards.ifeval import IFEvalScore
from agentrl.envs.tasks import ifeval_row_to_task, load_hf_rows, load_ifeval

INSTRUCTIONS = "Answer the user's request in your final message, following every instruction exactly."

TOPICS = (
    "the history of the bicycle",
    "why cities plant trees",
    "how to brew green tea",
    "a day at a lighthouse",
    "the benefits of learning a second language",
    "a review of a fictional smartphone",
    "saving water at home",
    "the life cycle of a butterfly",
    "an invitation to a neighbourhood picnic",
    "how vaccines train the immune system",
    "a cover letter for a junior data analyst",
    "the rules of chess for beginners",
    "a travel guide to Lisbon",
)
FORMS = (
    "Write a short essay about {t}.",
    "Write a blog post about {t}.",
    "Explain {t} to a teenager.",
    "Write a product description related to {t}.",
    "Write a letter to a friend about {t}.",
)
KEYWORDS = ("river", "window", "quiet", "garden", "energy", "future", "simple", "bridge", "light", "market")


def _sentences_kwargs(g: np.random.Generator) -> dict[str, Any]:
    # "less than" leaves room for a title, a postscript, an end phrase and one sentence per paragraph.
    if g.random() < 0.5:
        return {"relation": "at least", "num_sentences": int(g.integers(2, 9))}
    return {"relation": "less than", "num_sentences": int(g.integers(7, 13))}


# instruction id -> (kwargs sampler, description); kwargs use IFEval's names.
_R = np.random.Generator
_SPECS: dict[str, tuple[Callable[[_R], dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
    "punctuation:no_comma": (lambda g: {}, lambda k: "Do not use any commas in your response."),
    "change_case:english_lowercase": (
        lambda g: {},
        lambda k: "Your entire response must be in English and in lowercase letters only.",
    ),
    "change_case:english_capital": (
        lambda g: {},
        lambda k: "Your entire response must be in English and in capital letters only.",
    ),
    "length_constraints:number_words": (
        lambda g: {
            "relation": str(g.choice(["at least", "less than"])),
            "num_words": int(g.integers(3, 40)) * 10,
        },
        lambda k: f"Answer with {k['relation']} {k['num_words']} words.",
    ),
    "length_constraints:number_sentences": (
        _sentences_kwargs,
        lambda k: f"Your response should contain {k['relation']} {k['num_sentences']} sentences.",
    ),
    "length_constraints:number_paragraphs": (
        lambda g: {"num_paragraphs": int(g.integers(2, 5))},
        lambda k: (
            f"There should be exactly {k['num_paragraphs']} paragraphs, separated by the markdown divider ***."
        ),
    ),
    "detectable_format:number_bullet_lists": (
        lambda g: {"num_bullets": int(g.integers(2, 7))},
        lambda k: (
            f"Your answer must contain exactly {k['num_bullets']} bullet points in markdown, like:\n* point one"
        ),
    ),
    "detectable_format:number_highlighted_sections": (
        lambda g: {"num_highlights": int(g.integers(1, 5))},
        lambda k: (
            f"Highlight at least {k['num_highlights']} sections with markdown, i.e. *highlighted section*."
        ),
    ),
    "detectable_format:title": (
        lambda g: {},
        lambda k: "Give your answer a title wrapped in double angular brackets, like <<my title>>.",
    ),
    "detectable_format:json_format": (lambda g: {}, lambda k: "Wrap your entire output in JSON format."),
    "detectable_content:postscript": (
        lambda g: {"postscript_marker": str(g.choice(["P.S.", "P.P.S"]))},
        lambda k: f"At the end of your response, add a postscript starting with {k['postscript_marker']}",
    ),
    "detectable_content:number_placeholders": (
        lambda g: {"num_placeholders": int(g.integers(1, 5))},
        lambda k: (
            f"Include at least {k['num_placeholders']} placeholders in square brackets, such as [address]."
        ),
    ),
    "keywords:existence": (
        lambda g: {"keywords": [str(x) for x in g.choice(KEYWORDS, size=2, replace=False)]},
        lambda k: f"Include the keywords {', '.join(k['keywords'])} in the response.",
    ),
    "keywords:forbidden_words": (
        lambda g: {"forbidden_words": [str(x) for x in g.choice(KEYWORDS, size=2, replace=False)]},
        lambda k: f"Do not include the words {', '.join(k['forbidden_words'])} in the response.",
    ),
    "keywords:frequency": (
        lambda g: {
            "keyword": str(g.choice(KEYWORDS)),
            "relation": str(g.choice(["at least", "less than"])),
            "frequency": int(g.integers(1, 5)),
        },
        lambda k: (
            f"In your response, the word {k['keyword']} should appear {k['relation']} {k['frequency']} times."
        ),
    ),
    "startend:end_checker": (
        lambda g: {
            "end_phrase": str(g.choice(["Is there anything else I can help with?", "Any other questions?"]))
        },
        lambda k: (
            f"Finish your response with this exact phrase: {k['end_phrase']}. No other words should follow it."
        ),
    ),
    "startend:quotation": (lambda g: {}, lambda k: "Wrap your entire response with double quotation marks."),
    "combination:two_responses": (
        lambda g: {},
        lambda k: "Give two different responses, separated by 6 asterisk symbols: ******.",
    ),
}
# Pairs that cannot both be satisfied.
_CONFLICTS = {
    frozenset({"change_case:english_lowercase", "change_case:english_capital"}),
    frozenset({"detectable_format:json_format", "startend:quotation"}),
    frozenset({"detectable_format:json_format", "detectable_content:postscript"}),
    frozenset({"detectable_format:json_format", "startend:end_checker"}),
    frozenset({"detectable_format:json_format", "detectable_format:title"}),
    frozenset({"detectable_format:json_format", "combination:two_responses"}),
    frozenset({"detectable_format:json_format", "detectable_format:number_bullet_lists"}),
    frozenset({"detectable_format:json_format", "length_constraints:number_paragraphs"}),
    frozenset({"startend:quotation", "startend:end_checker"}),
    frozenset({"startend:quotation", "combination:two_responses"}),
    frozenset({"combination:two_responses", "length_constraints:number_paragraphs"}),  # ****** splits as ***
    frozenset({"keywords:existence", "keywords:forbidden_words"}),
    frozenset({"keywords:frequency", "keywords:forbidden_words"}),
}


def make_prompt(rng: np.random.Generator) -> dict[str, Any]:
    """A writing request with 1-3 compatible constraints and their IFEval ids/kwargs."""
    ids: list[str] = []
    want = int(rng.integers(1, 4))
    names = sorted(_SPECS)
    while len(ids) < want:
        cand = str(rng.choice(names))
        if cand not in ids and not any(frozenset({cand, i}) in _CONFLICTS for i in ids):
            ids.append(cand)
    kwargs = [_SPECS[i][0](rng) for i in ids]
    request = str(rng.choice(FORMS)).format(t=str(rng.choice(TOPICS)))
    prompt = " ".join([request, *(_SPECS[i][1](k) for i, k in zip(ids, kwargs, strict=True))])
    return {"prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


class VerifyIFEnv(AgentEnv):
    """Single-turn instruction following with code-checked constraints.

    Args:
        strict_all: reward = 1.0 only when all constraints hold (default: the fraction that hold).
        loose: use IFEval's loose criterion (also accept the answer without first/last line or asterisks).
        **kwargs: :class:`~agentrl.envs.AgentEnv` arguments.
    """

    instructions = INSTRUCTIONS
    eval_dataset = "ifeval"
    single_turn = True
    default_limits = EnvLimits(max_turns=1, max_tool_calls=0)

    def __init__(self, *, strict_all: bool = False, loose: bool = False, **kwargs: Any) -> None:
        frac, all_ = IFEvalScore(loose=loose), IFEvalScore(all_=True, loose=loose)
        kwargs.setdefault(
            "rubric", Rubric([(frac, 0.0 if strict_all else 1.0), (all_, 1.0 if strict_all else 0.0)])
        )
        super().__init__(**kwargs)

    @classmethod
    def generate_task(cls, rng: np.random.Generator, split: str = "train") -> dict[str, Any]:
        return {"id": f"gen-{int(rng.integers(1 << 31))}", **make_prompt(rng)}

    @classmethod
    def load_tasks(cls, path: str) -> list[dict[str, Any]]:
        return load_ifeval(path)

    @staticmethod
    def hub_tasks(repo: str = "google/IFEval", split: str = "train") -> list[dict[str, Any]]:
        """IFEval prompts from the HF hub; needs network."""
        return [ifeval_row_to_task(r, i) for i, r in enumerate(load_hf_rows(repo, split))]
