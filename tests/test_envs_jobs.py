"""Search tools, the OpenAPI adapter and the jobs env, against the real jobs service over HTTP."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from gymnasium.utils.env_checker import check_env

from agentrl.envs.builtin.jobs.data import make_dataset
from agentrl.envs.builtin.jobs.env import JobsEnv, make_task
from agentrl.envs.builtin.jobs.service import JobsService
from agentrl.envs.tools import Sessions, ToolBox, ToolError, ToolInfrastructureError
from agentrl.envs.tools.openapi import OpenAPIToolset, resolve_refs, to_json_schema
from agentrl.envs.tools.search import BM25Index, HttpSearchTool, SearchTool
from agentrl.harmony import default_format
from agentrl.harmony.types import Message, ToolCall


@pytest.fixture(scope="module")
def service():
    with JobsService(faults=True) as s:
        yield s


@pytest.fixture(scope="module")
def spec(service):
    return httpx.get(f"{service.url}/openapi.json").json()


def call(name, args, channel="commentary"):
    return default_format().render_completion(
        [
            Message(
                "assistant",
                json.dumps(args),
                channel=channel,
                recipient=f"functions.{name}",
                content_type="json",
            )
        ]
    )


def final(text):
    return default_format().render_completion([Message("assistant", text, channel="final")])


def tc(name, args):
    return ToolCall(f"functions.{name}", name, args, json.dumps(args))


# ----------------------------------------------------------------------------- search
async def test_bm25_index_build_save_load_and_tool(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    docs = [
        {"id": "a", "title": "Rust jobs", "text": "Remote Rust engineer wanted for a systems team. " * 5},
        {"id": "b", "title": "Tea", "text": "How to brew green tea at the right temperature."},
        {"id": "c", "title": "Gardening", "text": "Plant tomatoes in spring."},
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    index = BM25Index.build(corpus)
    assert [d["id"] for d, _ in index.search("rust engineer", k=5)] == ["a"]
    index.save(tmp_path / "idx")
    loaded = BM25Index.load(tmp_path / "idx")
    assert [d["id"] for d, _ in loaded.search("green tea", k=2)] == ["b"]
    tool = SearchTool(loaded, snippet_chars=30)
    out = await tool.call({"query": "remote rust", "k": 1})
    assert out.startswith("[1] a | Rust jobs") and out.endswith(" ...") and len(out.splitlines()[1]) <= 40
    assert await tool.call({"query": "zebra"}) == "No results."
    with pytest.raises(FileNotFoundError, match="no agentrl BM25 index"):
        BM25Index.load(tmp_path)


async def test_http_search_tool_against_real_service(service):
    tool = HttpSearchTool(f"{service.url}/search", id_key="id", snippet_chars=50, headers={"X-Key": "s3cret"})
    out = await tool.call({"query": "remote Rust", "k": 3})
    assert out.startswith("[1] j") and len([ln for ln in out.splitlines() if ln.startswith("[")]) == 3
    assert "s3cret" not in repr(tool)
    await tool.aclose()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/search"
    with pytest.raises(ToolInfrastructureError, match="unreachable"):  # the service's failure, not the model's
        await HttpSearchTool(dead).call({"query": "x"})


# ----------------------------------------------------------------------------- OpenAPI adapter
def test_schema_helpers():
    spec = {
        "components": {
            "schemas": {"N": {"type": "object", "properties": {"next": {"$ref": "#/components/schemas/N"}}}}
        }
    }
    node = resolve_refs({"$ref": "#/components/schemas/N"}, spec)
    assert node["type"] == "object" and node["properties"]["next"] == {"type": "object"}  # cycle cut
    assert to_json_schema({"type": "string", "nullable": True, "title": "X"}) == {"type": ["string", "null"]}


async def test_openapi_tools_from_jobs_spec(service, spec):
    ts = OpenAPIToolset(spec, base_url=service.url, retries=2, backoff_s=0.01, timeout_s=1.0)
    tools = {t.name: t for t in ts.tools}
    assert {
        "list_companies",
        "get_company",
        "list_postings",
        "get_posting",
        "list_people",
        "search",
        "flaky",
        "slow",
    } <= set(tools)
    lp = tools["list_postings"].parameters
    assert lp["properties"]["skill"]["type"] == "string" and lp["properties"]["page_size"]["maximum"] == 20
    assert tools["get_posting"].parameters["required"] == ["posting_id"]
    box = ToolBox(ts.tools, max_result_chars=100_000)
    s = Sessions()
    rec = await box.call(
        tc("list_postings", {"skill": "Rust", "remote": True, "sort": "salary_desc", "page_size": 3}), s
    )
    body = json.loads(rec.result)
    assert rec.error is None and len(body["items"]) == 3 and all(i["remote"] for i in body["items"])
    rec = await box.call(tc("get_posting", {"posting_id": "j9999"}), s)  # 404 -> observation
    assert rec.error is None and rec.result.startswith("HTTP 404") and "j9999" in rec.result
    rec = await box.call(tc("list_postings", {"page_size": 100}), s)  # schema violation caught before HTTP
    assert rec.error == "bad_arguments" and "page_size" in rec.result
    out = await tools["list_postings"].call({"page": 0})  # bypass validation: the server answers 422
    assert out.error == "bad_arguments" and out.content.startswith("HTTP 422")
    rec = await box.call(tc("flaky", {"key": "once", "failures": 1}), s)  # 500, retried, then 200
    assert rec.error is None and json.loads(rec.result) == {"ok": True, "attempts": 2}
    rec = await box.call(tc("flaky", {"key": "always", "failures": 10}), s)
    assert rec.error == "tool_exception" and "after 3 attempts" in rec.result and "HTTP 500" in rec.result
    rec = await box.call(tc("slow", {"seconds": 5}), s)
    assert rec.error == "tool_timeout" and "timed out" in rec.result
    await ts.aclose()


async def test_openapi_bounds_retries_connection_errors_and_secrets(service, spec, monkeypatch):
    small = OpenAPIToolset(spec, base_url=service.url, max_response_bytes=200, include=["list_companies"])
    out = await small.tools[0].call({"page_size": 20})
    assert out.content.endswith("[... response cut at 200 bytes]")
    await small.aclose()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("JOBS_URL", dead)
    monkeypatch.setenv("JOBS_TOKEN", "Bearer top-secret")
    ts = OpenAPIToolset(
        spec,
        base_url_env="JOBS_URL",
        headers_env={"Authorization": "JOBS_TOKEN"},
        retries=1,
        backoff_s=0.01,
        include=["get_company"],
    )
    assert "top-secret" not in repr(ts) and "Authorization" in repr(ts)
    with pytest.raises(ToolError, match="after 2 attempts: connection error") as e:
        await ts.tools[0].call({"company_id": "c001"})
    assert "top-secret" not in str(e.value)
    await ts.aclose()
    with pytest.raises(ValueError, match="NOPE_TOKEN"):
        OpenAPIToolset(spec, base_url=dead, headers_env={"Authorization": "NOPE_TOKEN"})
    with pytest.raises(ValueError, match="base URL"):
        OpenAPIToolset({**spec, "servers": []})
    with pytest.raises(ValueError, match="OpenAPI 3"):
        OpenAPIToolset({"swagger": "2.0"}, base_url=dead)


# ----------------------------------------------------------------------------- jobs env
def test_jobs_tasks_are_computed_from_data():
    data = make_dataset(0)
    tasks = JobsEnv.tasks(n=60, seed=0)
    assert {t["kind"] for t in tasks} == {
        "top_paid",
        "company_postings",
        "person_company",
        "newest_in_city",
        "colleagues",
    }
    for t in tasks:
        if t["kind"] == "person_company":
            name = t["prompt"].split("does ")[1].split(" work")[0]
            assert next(p for p in data.people if p["name"] == name)["company_id"] == t["answer"]
    assert JobsEnv.tasks(n=5, seed=3) == JobsEnv.tasks(n=5, seed=3)
    assert not {t["prompt"] for t in JobsEnv.tasks("test", n=50)} & {
        t["prompt"] for t in tasks if t["kind"] != "top_paid"
    }


async def test_jobs_episode_over_real_http(service):
    import numpy as np

    env = JobsEnv(service=service)
    rng = np.random.default_rng(0)
    task = next(t for t in (make_task(env.data, rng) for _ in range(50)) if t["kind"] == "top_paid")
    skill = task["prompt"].split("remote ")[1].split(" posting")[0]
    limit = int(task["prompt"].split("fewer than ")[1].split(" ")[0])
    obs, info = await env.areset(options={"task": task})
    assert "list_postings" in default_format().decode(obs["tokens"])
    args = {
        "skill": skill,
        "remote": True,
        "max_company_employees": limit - 1,
        "sort": "salary_desc",
        "page_size": 1,
    }
    obs, r, term, trunc, info = await env.astep(call("list_postings", args))
    best = json.loads(obs["messages"][0].content)["items"][0]["id"]
    assert not term and info["errors"] == [] and best == task["answer"]
    obs, *_, info = await env.astep(call("get_posting", {"posting_id": "j9999"}))
    assert obs["messages"][0].content.startswith("HTTP 404") and info["errors"] == []
    obs, *_, info = await env.astep(call("list_postings", {"page_size": 500}))
    assert info["errors"] == ["bad_arguments"]
    obs, *_, info = await env.astep(call("search_postings", {"query": f"remote {skill}", "k": 2}))
    assert obs["messages"][0].content.startswith("[1] j")
    obs, *_, info = await env.astep(call("get_company", {"company_id": "c001"}, channel="analysis"))
    assert info["errors"] == ["parse_error"]
    obs, *_, info = await env.astep(call("fire_everyone", {}))
    assert info["errors"] == ["unknown_tool"]
    fmt = default_format()
    bad_json = fmt.render_completion(
        [
            Message(
                "assistant",
                '{"skill": ',
                channel="commentary",
                recipient="functions.list_postings",
                content_type="json",
            )
        ]
    )
    for ids, kind in [(bad_json, "bad_arguments"), (fmt.encode("I will now call"), "truncation")]:
        obs, r, term, trunc, info = await env.astep(ids)
        assert kind in info["errors"] and not (term or trunc) and len(obs["tokens"]) > 0
    obs, r, term, trunc, info = await env.astep(final(best))
    assert term and info["reward_components"] == {"exact_match": 1.0, "tool_calls_in_analysis": 1.0}
    assert r == pytest.approx(0.9)
    await env.areset(options={"task": task})
    _, r, term, *_ = await env.astep(final("j0001" if best != "j0001" else "j0002"))
    assert term and r == 0.0
    await env.aclose()
    assert httpx.get(f"{service.url}/companies/c001").status_code == 200  # a shared service is not stopped


def test_jobs_envs_share_a_service_stopped_by_the_last():
    a, b = JobsEnv(), JobsEnv()
    url = a.service_url
    assert b.service_url == url and httpx.get(f"{url}/postings/j0001").json()["id"] == "j0001"
    check_env(a, skip_render_check=True, skip_close_check=True)
    a.close()
    assert httpx.get(f"{url}/postings/j0001").status_code == 200  # b still uses it
    b.close()
    b.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/postings/j0001", timeout=2)


def _solve(env_step, task):
    """A scripted agent that answers each kind of jobs task through the HTTP API (several calls each)."""
    p = task["prompt"]

    def api(op, /, **args):
        obs = env_step(call(op, args))
        return json.loads(obs["messages"][0].content)

    if task["kind"] == "top_paid":
        skill = p.split("remote ")[1].split(" posting")[0]
        limit = int(p.split("fewer than ")[1].split(" ")[0])
        f = {"skill": skill, "remote": True, "max_company_employees": limit - 1, "sort": "salary_desc"}
        return api("list_postings", **f, page_size=1)["items"][0]["id"]
    if task["kind"] == "company_postings":
        name = p.split("does ")[1].split(" have open")[0]
        cid = next(
            c["id"] for c in api("list_companies", name=name, page_size=20)["items"] if c["name"] == name
        )
        return str(api("get_company", company_id=cid)["open_postings"])
    if task["kind"] == "person_company":
        name = p.split("does ")[1].split(" work")[0]
        return api("list_people", name=name)["items"][0]["company_id"]
    if task["kind"] == "newest_in_city":
        level, city = p.split("posted ")[1].split(" posting")[0], p.split("located in ")[1].rstrip("?")
        return api("list_postings", city=city, seniority=level, sort="posted_desc", page_size=1)["items"][0][
            "id"
        ]
    name = p.split("same company as ")[1].split("?")[0]
    cid = api("list_people", name=name)["items"][0]["company_id"]
    return str(api("list_people", company_id=cid, page_size=1)["total"] - 1)


def test_every_jobs_task_kind_is_solvable_through_the_api(service):
    env = JobsEnv(service=service)
    tasks = JobsEnv.tasks(n=20, seed=5) + JobsEnv.tasks("test", n=10, seed=5)
    assert len({t["kind"] for t in tasks}) == 5
    for task in tasks:
        env.reset(options={"task": task})
        answer = _solve(lambda ids: env.step(ids)[0], task)
        _, r, term, trunc, info = env.step(final(answer))
        assert (r, term) == (1.0, True), (task, answer)
        assert info["trajectory"].errors == {}
    env.close()
