"""E2B backend through the real ``e2b-code-interpreter`` SDK with its HTTP layer FAKED.

E2B is a paid cloud service that needs an API key and the network, so this test replaces the SDK's httpx
transport with ``httpx.MockTransport``: a small in-test emulation of E2B's REST API (create / kill sandbox)
and of the sandbox's Jupyter server (contexts, ``/execute`` streaming NDJSON). Everything above the transport
(request building, response parsing, error mapping, our backend) is the real code.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import traceback
import uuid

import httpx
import pytest

pytest.importorskip("e2b_code_interpreter")

import e2b.api.client_async as e2b_api_client  # noqa: E402
import e2b_code_interpreter.code_interpreter_async as e2b_ci  # noqa: E402

from agentrl.envs.sandbox import SandboxUnavailable, make_backend  # noqa: E402


class FakeE2B:
    """The E2B control plane and a sandbox's Jupyter server, answering httpx requests in-process."""

    def __init__(self) -> None:
        self.contexts: dict[str, dict] = {}
        self.sandboxes: set[str] = set()
        self.killed: list[str] = []
        self.api_keys: list[str | None] = []
        self.unhandled: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if method == "POST" and path == "/v2/sandboxes":
            self.api_keys.append(request.headers.get("X-API-Key"))
            sid = "sbx" + uuid.uuid4().hex[:8]
            self.sandboxes.add(sid)
            body = {
                "templateID": "code-interpreter-v1",
                "sandboxID": sid,
                "clientID": "c1",
                "envdVersion": "0.2.4",
                "envdAccessToken": "envd-token",
                "domain": "e2b.app",
            }
            return httpx.Response(201, json=body)
        if method == "DELETE" and path.startswith("/sandboxes/"):
            self.killed.append(path.rsplit("/", 1)[1])
            return httpx.Response(204)
        if method == "POST" and path == "/contexts":
            cid = uuid.uuid4().hex
            self.contexts[cid] = {"__name__": "__main__"}
            return httpx.Response(200, json={"id": cid, "language": "python", "cwd": "/home/user"})
        if method == "DELETE" and path.startswith("/contexts/"):
            self.contexts.pop(path.rsplit("/", 1)[1], None)
            return httpx.Response(204)
        if method == "POST" and path == "/execute":
            return self.execute(request, json.loads(request.content))
        self.unhandled.append(f"{method} {request.url}")
        return httpx.Response(404, text="not found")

    def execute(self, request: httpx.Request, body: dict) -> httpx.Response:
        code = body["code"]
        if "while True" in code:  # what the SDK sees when an execution outlives its timeout
            raise httpx.ReadTimeout("timed out", request=request)
        ns = self.contexts[body["context_id"]]
        out, err, lines = io.StringIO(), io.StringIO(), []
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                *head, last = code.rstrip().split("\n")
                exec("\n".join(head), ns)
                try:
                    value = eval(last, ns)
                except SyntaxError:
                    exec(last, ns)
                    value = None
            except Exception as exc:  # shown to the client as a Jupyter error
                tb = "".join(traceback.format_exception(exc))
                lines.append(
                    {"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": tb}
                )
                value = None
        if out.getvalue():
            lines.insert(0, {"type": "stdout", "text": out.getvalue(), "timestamp": 1})
        if err.getvalue():
            lines.insert(0, {"type": "stderr", "text": err.getvalue(), "timestamp": 1})
        if value is not None:
            lines.append({"type": "result", "text": repr(value), "is_main_result": True})
        lines.append({"type": "end_of_execution"})
        return httpx.Response(200, content="\n".join(json.dumps(x) for x in lines).encode())


@pytest.fixture
def fake(monkeypatch):
    fake = FakeE2B()
    transport = httpx.MockTransport(fake.handler)
    monkeypatch.setattr(e2b_api_client, "get_transport", lambda *a, **k: transport)
    monkeypatch.setattr(e2b_ci, "get_transport", lambda *a, **k: transport)
    return fake


def test_needs_api_key(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxUnavailable, match="E2B_API_KEY"):
        make_backend("e2b")


def test_e2b_backend_through_faked_http(fake):
    async def scenario():
        async with make_backend("e2b", api_key="e2b_test_key") as sb:
            r = await sb.run("print(6 * 7)")
            assert r.status == "ok" and r.stdout == "42\n", r
            r = await sb.run("import sys\nprint(sys.stdin.read().upper())", stdin="abc")
            assert r.stdout == "ABC\n", r
            r = await sb.run("1 / 0")
            assert r.status == "error" and "ZeroDivisionError" in r.stderr, r
            r = await sb.run("while True: pass", timeout_s=1)
            assert r.status == "timeout", r
            sid = await sb.create_session()
            assert (await sb.run("x = 20", session=sid)).ok
            r = await sb.run("x * 2", session=sid)
            assert r.display == "40", r
            r = await sb.run("'x' in globals()")
            assert r.display == "False", r  # stateless runs get a fresh context
            await sb.release_session(sid)
            assert sid not in fake.contexts
        assert fake.api_keys == ["e2b_test_key"]
        assert len(fake.sandboxes) == 1 and fake.killed == sorted(fake.sandboxes)
        assert fake.contexts == {} and fake.unhandled == []

    asyncio.run(scenario())


def test_e2b_api_failure_is_a_sandbox_error(monkeypatch):
    transport = httpx.MockTransport(
        lambda req: httpx.Response(401, json={"code": 401, "message": "Invalid API key"})
    )
    monkeypatch.setattr(e2b_api_client, "get_transport", lambda *a, **k: transport)

    async def scenario():
        async with make_backend("e2b", api_key="bad") as sb:
            r = await sb.run("print(1)")
            assert r.status == "sandbox_error" and "E2B failed" in r.message, r

    asyncio.run(scenario())
