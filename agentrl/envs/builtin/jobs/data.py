"""A seeded synthetic professional network: companies, people and job postings.

``make_dataset(seed)`` is deterministic in ``seed`` (numpy's PCG64), so answers computed from it are exact and
reproducible. Sizes are small enough to build in milliseconds yet need filtering and pagination to navigate.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

SKILLS = (
    "Rust",
    "Python",
    "Go",
    "TypeScript",
    "Java",
    "Kotlin",
    "SQL",
    "Kubernetes",
    "React",
    "C++",
    "Terraform",
    "PyTorch",
    "Spark",
    "Swift",
    "Elixir",
)
CITIES = (
    "Berlin",
    "Lisbon",
    "Toronto",
    "Austin",
    "Singapore",
    "Nairobi",
    "Warsaw",
    "Melbourne",
    "Dublin",
    "Osaka",
)
INDUSTRIES = ("fintech", "healthcare", "logistics", "gaming", "energy", "education", "retail", "security")
SENIORITY = ("junior", "mid", "senior", "staff")
ROLES = ("Engineer", "Developer", "Data Engineer", "Platform Engineer", "ML Engineer", "Backend Engineer")
_SYL = (
    "ka",
    "lo",
    "mi",
    "ra",
    "ven",
    "tor",
    "quin",
    "sel",
    "dar",
    "nex",
    "ly",
    "po",
    "zu",
    "bri",
    "sto",
    "fen",
)
_FIRST = (
    "Ada",
    "Bruno",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yara",
    "Zane",
)
_LAST = (
    "Okafor",
    "Novak",
    "Silva",
    "Tanaka",
    "Müller",
    "Haddad",
    "Kowalski",
    "Nguyen",
    "Osei",
    "Larsen",
    "Rossi",
    "Petrov",
    "Moreau",
    "Kaur",
    "Ibrahim",
    "Costa",
    "Fischer",
    "Sato",
    "Walsh",
    "Mensah",
)
_PERKS = (
    "flexible hours",
    "a learning budget",
    "equity",
    "four-day weeks in summer",
    "a home-office stipend",
    "parental leave",
    "an on-call bonus",
    "relocation support",
)


@dataclass(frozen=True)
class Dataset:
    companies: tuple[dict[str, Any], ...]
    people: tuple[dict[str, Any], ...]
    postings: tuple[dict[str, Any], ...]

    def company(self, company_id: str) -> dict[str, Any]:
        return next(c for c in self.companies if c["id"] == company_id)


def _name(rng: np.random.Generator, used: set[str]) -> str:
    while True:
        n = "".join(str(rng.choice(_SYL)) for _ in range(int(rng.integers(2, 4)))).capitalize()
        n += str(rng.choice(["", " Labs", " Systems", " Works", " AI", " Group"]))
        if n not in used:
            used.add(n)
            return n


@lru_cache(maxsize=8)
def make_dataset(seed: int = 0, n_companies: int = 60, n_people: int = 240, n_postings: int = 480) -> Dataset:
    """The synthetic network for ``seed`` (cached; treat the result as read-only)."""
    rng = np.random.default_rng(seed)
    used: set[str] = set()
    companies = []
    for i in range(n_companies):
        companies.append(
            {
                "id": f"c{i + 1:03d}",
                "name": _name(rng, used),
                "industry": str(rng.choice(INDUSTRIES)),
                "employees": int(np.clip(rng.lognormal(5.5, 1.3), 5, 50_000)),
                "hq_city": str(rng.choice(CITIES)),
                "founded": int(rng.integers(1985, 2024)),
            }
        )
    people = []
    names: set[str] = set()
    for i in range(n_people):
        while (full := f"{rng.choice(_FIRST)} {rng.choice(_LAST)}") in names:
            pass
        names.add(full)
        c = companies[int(rng.integers(n_companies))]
        people.append(
            {
                "id": f"p{i + 1:03d}",
                "name": full,
                "title": f"{rng.choice(SENIORITY).capitalize()} {rng.choice(ROLES)}",
                "company_id": c["id"],
                "city": str(rng.choice(CITIES)),
                "skills": sorted(
                    {str(s) for s in rng.choice(SKILLS, size=int(rng.integers(2, 5)), replace=False)}
                ),
            }
        )
    postings = []
    start = dt.date(2026, 1, 1)
    for i in range(n_postings):
        c = companies[int(rng.integers(n_companies))]
        seniority = str(rng.choice(SENIORITY))
        skills = [str(s) for s in rng.choice(SKILLS, size=int(rng.integers(1, 4)), replace=False)]
        base = {"junior": 55, "mid": 80, "senior": 110, "staff": 140}[seniority] * 1000
        low = int(base + rng.integers(-10, 30) * 1000)
        high = low + int(rng.integers(10, 60)) * 1000 + int(rng.integers(0, 1000))
        remote = bool(rng.random() < 0.4)
        role = str(rng.choice(ROLES))
        perks = ", ".join(str(p) for p in rng.choice(_PERKS, size=2, replace=False))
        postings.append(
            {
                "id": f"j{i + 1:04d}",
                "title": f"{seniority.capitalize()} {skills[0]} {role}",
                "company_id": c["id"],
                "city": c["hq_city"] if not remote else "Remote",
                "remote": remote,
                "seniority": seniority,
                "skills": skills,
                "salary_min": low,
                "salary_max": high,
                "posted": (start + dt.timedelta(days=int(rng.integers(0, 300)))).isoformat(),
                "description": (
                    f"{c['name']} ({c['industry']}, {c['employees']} employees) is hiring a {seniority} {role.lower()} "
                    f"to work with {', '.join(skills)}. {'Fully remote.' if remote else 'Based in ' + c['hq_city'] + '.'} "
                    f"We offer {perks}."
                ),
            }
        )
    return Dataset(tuple(companies), tuple(people), tuple(postings))
