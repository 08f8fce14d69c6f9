"""``jobs``: answer questions about a professional network by searching postings and calling its HTTP API.

The env starts the jobs service (:mod:`.service`) on a free loopback port (shared by the envs of a process,
stopped with the last of them; or uses one you pass), turns its
OpenAPI spec into tools with :class:`~agentrl.envs.tools.openapi.OpenAPIToolset` (list/get companies, people,
postings, with filters and pagination) and adds a local BM25 ``search_postings`` tool. Tasks are generated
from the same seeded dataset, so every answer is computed from the data and the reward is exact.

Reward components: ``exact_match`` (weight 1) and ``tool_calls_in_analysis`` (function calls written in the
analysis channel, weight -0.1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentrl.envs.builtin.jobs.data import CITIES, SENIORITY, SKILLS, Dataset, make_dataset
from agentrl.envs.builtin.jobs.service import JobsService, acquire_shared, release_shared
from agentrl.envs.env import AgentEnv, EnvLimits
from agentrl.envs.rewards import ExactMatch, Rubric
from agentrl.envs.rewards.common import ChannelToolCallCount
from agentrl.envs.tools.base import Tool
from agentrl.envs.tools.openapi import OpenAPIToolset
from agentrl.envs.tools.search import BM25Index, SearchTool

INSTRUCTIONS = (
    "You assist users of a professional network. Look facts up with the tools: the API lists and fetches "
    "companies, people and job postings (lists are filtered and paginated, at most 20 items per page) and "
    "search_postings finds postings by keywords. Never guess. Give only the requested value (an id or a "
    "number) as your final answer."
)


_LIMITS = (100, 250, 500, 1000)


def _in_split(index: int, split: str) -> bool:
    return (index % 5 == 0) == (split == "test")


def make_task(data: Dataset, rng: np.random.Generator, split: str = "train") -> dict[str, Any]:
    """One question about ``data`` with its exact answer, computed over the whole dataset. The questions' subjects
    (a company, a person, a (skill, size) or (city, seniority) pair) are split 80/20 into train/test."""
    for _ in range(100):
        kind = int(rng.integers(0, 5))
        if kind == 0:
            s, li = int(rng.integers(len(SKILLS))), int(rng.integers(len(_LIMITS)))
            if not _in_split(s * len(_LIMITS) + li, split):  # the question's parameters decide the split
                continue
            skill, limit = SKILLS[s], _LIMITS[li]
            cands = [
                p
                for p in data.postings
                if p["remote"] and skill in p["skills"] and data.company(p["company_id"])["employees"] < limit
            ]
            if not cands:
                continue
            best = max(cands, key=lambda p: p["salary_max"])
            if sum(p["salary_max"] == best["salary_max"] for p in cands) > 1:
                continue
            prompt = (
                f"Find the highest-paid remote {skill} posting (by maximum salary) at a company with fewer than "
                f"{limit} employees. Answer with its posting id."
            )
            return {"prompt": prompt, "answer": best["id"], "kind": "top_paid"}
        if kind == 1:
            i = int(rng.integers(len(data.companies)))
            if not _in_split(i, split):
                continue
            c = data.companies[i]
            n = sum(p["company_id"] == c["id"] for p in data.postings)
            return {
                "prompt": f"How many job postings does {c['name']} have open? Answer with a number.",
                "answer": str(n),
                "kind": "company_postings",
            }
        if kind == 2:
            i = int(rng.integers(len(data.people)))
            if not _in_split(i, split):
                continue
            person = data.people[i]
            return {
                "prompt": f"Which company does {person['name']} work for? Answer with the company id.",
                "answer": person["company_id"],
                "kind": "person_company",
            }
        if kind == 3:
            city, level = str(rng.choice(CITIES)), str(rng.choice(SENIORITY))
            cands = [p for p in data.postings if p["city"] == city and p["seniority"] == level]
            if not cands or not _in_split(
                CITIES.index(city) * len(SENIORITY) + SENIORITY.index(level), split
            ):
                continue
            newest = max(p["posted"] for p in cands)
            top = [p for p in cands if p["posted"] == newest]
            if len(top) != 1:
                continue
            return {
                "prompt": f"What is the id of the most recently posted {level} posting located in {city}?",
                "answer": top[0]["id"],
                "kind": "newest_in_city",
            }
        i = int(rng.integers(len(data.people)))
        if not _in_split(i, split):
            continue
        person = data.people[i]
        n = sum(q["company_id"] == person["company_id"] for q in data.people) - 1
        return {
            "prompt": f"How many other people in the network work at the same company as {person['name']}? "
            "Answer with a number.",
            "answer": str(n),
            "kind": "colleagues",
        }
    raise RuntimeError("could not draw a jobs task in 100 tries; the dataset is too small")


class JobsEnv(AgentEnv):
    """Multi-step tool use over a real HTTP service.

    Args:
        service: ``None`` (the process-wide service for ``data_seed``, started by the first env that needs it
            and stopped when the last one closes), a :class:`JobsService` (started if needed, never stopped by
            the env), or the base URL of a running jobs service.
        data_seed: seed of the synthetic dataset; must match the service's when one is passed.
        http_timeout_s / retries: the OpenAPI client's per-request timeout and retry count.
        **kwargs: :class:`~agentrl.envs.AgentEnv` arguments.
    """

    instructions = INSTRUCTIONS
    default_limits = EnvLimits(max_turns=12, max_tool_calls=12, max_total_tokens=32768, tool_timeout_s=20.0)
    rubric = Rubric([(ExactMatch(), 1.0), (ChannelToolCallCount("analysis"), -0.1)])

    def __init__(
        self,
        *,
        service: JobsService | str | None = None,
        data_seed: int = 0,
        http_timeout_s: float = 10.0,
        retries: int = 2,
        **kwargs: Any,
    ) -> None:
        self.data_seed = data_seed
        self.data = make_dataset(data_seed)
        self._shared_service: JobsService | None = None
        if service is None:
            service = self._shared_service = acquire_shared(data_seed)
        if isinstance(service, JobsService):
            url = service.start()
        else:
            url = service.rstrip("/")
        try:
            self.toolset = OpenAPIToolset.from_url(
                f"{url}/openapi.json",
                timeout_s=http_timeout_s,
                retries=retries,
                exclude=("search", "flaky", "slow"),
            )
            self.search_tool = SearchTool(
                BM25Index.build(self.data.postings, text_fields=("title", "description")),
                name="search_postings",
                description="Keyword search over job postings; returns posting ids, titles and snippets.",
            )
            super().__init__(**kwargs)
        except BaseException:
            self._release_service()
            raise
        self.service_url = url

    def make_tools(self) -> list[Tool]:
        return [*self.toolset.tools, self.search_tool]

    @classmethod
    def generate_task(
        cls, rng: np.random.Generator, split: str = "train", data_seed: int = 0
    ) -> dict[str, Any]:
        return {"id": f"gen-{int(rng.integers(1 << 31))}", **make_task(make_dataset(data_seed), rng, split)}

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        return self.generate_task(rng, data_seed=self.data_seed)

    async def aclose_resources(self) -> None:
        self._release_service()

    def close(self) -> None:
        super().close()
        self._release_service()  # close() may only have scheduled aclose on a running loop

    def _release_service(self) -> None:
        if self._shared_service is not None:
            service, self._shared_service = self._shared_service, None
            release_shared(service)
