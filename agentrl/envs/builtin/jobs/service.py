"""The jobs HTTP service: a FastAPI app over a :class:`~.data.Dataset`, and a runner on a free loopback port.

Endpoints (all GET, JSON, OpenAPI spec at ``/openapi.json``): ``/companies``, ``/companies/{company_id}``,
``/postings``, ``/postings/{posting_id}``, ``/people``, ``/people/{person_id}``, ``/search`` (BM25 over postings).
Lists are paginated (``page`` from 1, ``page_size`` at most 20) and answer ``{items, page, page_size, total}``.
Unknown ids answer 404 with a ``detail`` message. ``faults=True`` adds two operations for testing clients:
``/debug/flaky`` (HTTP 500 for the first ``failures`` calls per ``key``) and ``/debug/slow`` (sleeps).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Query

from agentrl.envs.builtin.jobs.data import Dataset, make_dataset

MAX_PAGE_SIZE = 20


def _one(table: dict[str, dict[str, Any]], kind: str, key: str) -> dict[str, Any]:
    """The record ``key`` of ``table``, or a 404 naming the ``kind`` of record."""
    if key not in table:
        raise HTTPException(404, f"no {kind} with id {key!r}")
    return table[key]


def _page(items: list[dict[str, Any]], page: int, page_size: int) -> dict[str, Any]:
    start = (page - 1) * page_size
    return {
        "items": items[start : start + page_size],
        "page": page,
        "page_size": page_size,
        "total": len(items),
    }


def _summary(p: dict[str, Any]) -> dict[str, Any]:
    keys = ("id", "title", "company_id", "city", "remote", "seniority", "salary_max", "posted")
    return {k: p[k] for k in keys}


def create_app(data: Dataset, *, faults: bool = False) -> FastAPI:
    """The FastAPI app serving ``data``; operation ids are the route function names."""
    from agentrl.envs.tools.search import BM25Index

    app = FastAPI(
        title="Jobs network API",
        version="1.0",
        description="Companies, people and job postings of a professional network.",
        generate_unique_id_function=lambda route: route.name,
    )
    companies = {c["id"]: c for c in data.companies}
    postings = {p["id"]: p for p in data.postings}
    people = {p["id"]: p for p in data.people}
    index = BM25Index.build(data.postings, text_fields=("title", "description"))
    Page = Query(1, ge=1, description="page number, from 1")
    Size = Query(10, ge=1, le=MAX_PAGE_SIZE, description=f"items per page (max {MAX_PAGE_SIZE})")

    @app.get("/companies", summary="List companies, filtered; paginated.")
    def list_companies(
        name: str | None = Query(None, description="case-insensitive substring of the company name"),
        industry: str | None = None,
        city: str | None = Query(None, description="headquarters city"),
        min_employees: int | None = Query(None, ge=0),
        max_employees: int | None = Query(None, ge=0),
        page: int = Page,
        page_size: int = Size,
    ) -> dict[str, Any]:
        out = [
            c
            for c in data.companies
            if (name is None or name.lower() in c["name"].lower())
            and (industry is None or c["industry"] == industry.lower())
            and (city is None or c["hq_city"].lower() == city.lower())
            and (min_employees is None or c["employees"] >= min_employees)
            and (max_employees is None or c["employees"] <= max_employees)
        ]
        return _page(out, page, page_size)

    @app.get("/companies/{company_id}", summary="One company, with its number of open postings.")
    def get_company(company_id: str) -> dict[str, Any]:
        n = sum(1 for p in data.postings if p["company_id"] == company_id)
        return {**_one(companies, "company", company_id), "open_postings": n}

    @app.get("/postings", summary="List job postings (summaries), filtered and sorted; paginated.")
    def list_postings(
        skill: str | None = Query(None, description="required skill, e.g. Rust"),
        remote: bool | None = None,
        city: str | None = None,
        company_id: str | None = None,
        seniority: Literal["junior", "mid", "senior", "staff"] | None = None,
        min_salary: int | None = Query(None, description="minimum of salary_max"),
        max_company_employees: int | None = Query(
            None, ge=0, description="only companies with at most this many employees"
        ),
        sort: Literal["salary_desc", "salary_asc", "posted_desc", "id"] = "id",
        page: int = Page,
        page_size: int = Size,
    ) -> dict[str, Any]:
        out = [
            p
            for p in data.postings
            if (skill is None or skill.lower() in (s.lower() for s in p["skills"]))
            and (remote is None or p["remote"] == remote)
            and (city is None or p["city"].lower() == city.lower())
            and (company_id is None or p["company_id"] == company_id)
            and (seniority is None or p["seniority"] == seniority)
            and (min_salary is None or p["salary_max"] >= min_salary)
            and (
                max_company_employees is None
                or companies[p["company_id"]]["employees"] <= max_company_employees
            )
        ]
        if sort == "salary_desc":
            out.sort(key=lambda p: (-p["salary_max"], p["id"]))
        elif sort == "salary_asc":
            out.sort(key=lambda p: (p["salary_max"], p["id"]))
        elif sort == "posted_desc":
            out.sort(key=lambda p: (p["posted"], p["id"]), reverse=True)
        return _page([_summary(p) for p in out], page, page_size)

    @app.get("/postings/{posting_id}", summary="Full details of one posting.")
    def get_posting(posting_id: str) -> dict[str, Any]:
        return _one(postings, "posting", posting_id)

    @app.get("/people", summary="List people, filtered; paginated.")
    def list_people(
        name: str | None = Query(None, description="case-insensitive substring of the person's name"),
        company_id: str | None = None,
        skill: str | None = None,
        city: str | None = None,
        page: int = Page,
        page_size: int = Size,
    ) -> dict[str, Any]:
        out = [
            p
            for p in data.people
            if (name is None or name.lower() in p["name"].lower())
            and (company_id is None or p["company_id"] == company_id)
            and (skill is None or skill.lower() in (s.lower() for s in p["skills"]))
            and (city is None or p["city"].lower() == city.lower())
        ]
        return _page(out, page, page_size)

    @app.get("/people/{person_id}", summary="One person's profile.")
    def get_person(person_id: str) -> dict[str, Any]:
        return _one(people, "person", person_id)

    @app.get("/search", summary="Keyword search over postings (BM25).")
    def search(
        q: str = Query(..., min_length=1), k: int = Query(5, ge=1, le=MAX_PAGE_SIZE)
    ) -> dict[str, Any]:
        hits = index.search(q, k)
        return {
            "results": [
                {"id": d["id"], "title": d["title"], "snippet": d["description"], "score": s} for d, s in hits
            ]
        }

    if faults:
        calls: Counter[str] = Counter()

        @app.get("/debug/flaky", summary="Fails with HTTP 500 for the first `failures` calls per key.")
        def flaky(key: str, failures: int = Query(1, ge=0)) -> dict[str, Any]:
            calls[key] += 1
            if calls[key] <= failures:
                raise HTTPException(500, f"transient failure {calls[key]} of {failures}")
            return {"ok": True, "attempts": calls[key]}

        @app.get("/debug/slow", summary="Answers after `seconds` seconds.")
        async def slow(seconds: float = Query(..., ge=0, le=30)) -> dict[str, Any]:
            await asyncio.sleep(seconds)
            return {"ok": True}

    return app


class JobsService:
    """Runs the jobs app with uvicorn on a free ``127.0.0.1`` port in a background thread.

    Use as a context manager or call :meth:`start`/:meth:`stop` (both idempotent). ``url`` is the base URL.
    """

    def __init__(self, seed: int = 0, *, faults: bool = False, data: Dataset | None = None) -> None:
        self.data = data if data is not None else make_dataset(seed)
        self.faults = faults
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving and return the base URL once the server accepts connections."""
        if self._thread is not None:
            return self.url  # type: ignore[return-value]
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.data, faults=self.faults), log_level="warning", lifespan="off", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"jobs-service-{port}"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"the jobs service did not start within {timeout_s:g} s on 127.0.0.1:{port}")
        self.url = f"http://127.0.0.1:{port}"
        self._sock = sock
        return self.url

    def stop(self) -> None:
        """Stop the server and wait for its thread to end."""
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._thread = None
        if getattr(self, "_sock", None) is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> JobsService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_shared_lock = threading.Lock()
_shared: dict[int, list[Any]] = {}  # data seed -> [service, number of users]


def acquire_shared(seed: int = 0) -> JobsService:
    """The process-wide service for dataset ``seed``, started on first use; pair with :func:`release_shared`."""
    with _shared_lock:
        entry = _shared.get(seed)
        if entry is None:
            service = JobsService(seed)
            service.start()
            entry = _shared[seed] = [service, 0]
        entry[1] += 1
        return entry[0]


def release_shared(service: JobsService) -> None:
    """Give back a service from :func:`acquire_shared`; the last user stops it."""
    with _shared_lock:
        for seed, entry in list(_shared.items()):
            if entry[0] is service:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _shared[seed]
                    service.stop()
                return
