"""Attacks on ``agentrl serve sandbox`` and on our client of it: connection floods
from many addresses, oversized and trickled headers, answers blown up by many cells, text that no encoder
accepts, printed text posing as the sandbox's verdict, and a session longer than the server's time limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from _sandbox_server import serve_sandbox

from agentrl.envs.sandbox.fusion import SandboxFusionBackend
from agentrl.envs.sandbox.http_guard import client_key
from agentrl.envs.sandbox.server import SandboxServerConfig

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

TOKEN = "attack-token-5e1"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    config = SandboxServerConfig(
        token=TOKEN,
        header_timeout_s=10.0,
        body_timeout_s=10.0,
        max_connections=24,
        max_connections_per_client=4,
        max_header_bytes=16 * 1024,
        max_cells=50,
        max_response_bytes=64 * 1024,
    )
    yield from serve_sandbox(config, client_key=lambda address: address)  # every address a client of its own


def _connect(url: str, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    return s


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while data := s.recv(65536):
            if b"HTTP/1.1 431" in data:
                return True
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _post(url: str, path: str, body: dict, source: str = "127.0.0.1", timeout: float = 30) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    content = json.dumps(body).encode("ascii")  # JSON escapes, so that lone surrogates can be sent
    with httpx.Client(transport=transport, timeout=timeout) as client:
        return client.post(
            f"{url}/{TOKEN}{path}", content=content, headers={"content-type": "application/json"}
        )


# ------------------------------------------------------------------ 6. the HTTP layer


def test_idle_connections_from_many_addresses_cannot_lock_out_a_newcomer(server):
    """30 addresses hold connections with unfinished headers, more than the server's 24; every request from yet
    another address is served at once (each one closes the oldest idle connection)."""
    held = []
    for i in range(1, 31):
        s = _connect(server, f"127.0.1.{i}")
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        held.append(s)
    try:
        t = time.monotonic()
        served = sum(
            _post(server, "/run_code", {"code": "print(5)"}, source="127.0.0.9").json()["run_result"][
                "stdout"
            ]
            == "5\n"
            for _ in range(25)
        )
        assert served == 25 and time.monotonic() - t < 20
    finally:
        for s in held:
            s.close()


@pytest.mark.smoke
def test_loopback_addresses_count_as_one_client():
    assert (
        client_key("127.0.0.1")
        == client_key("127.3.4.5")
        == client_key("::1")
        == client_key("::ffff:127.0.0.2")
    )
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") != client_key("2001:db8:0:1::1")
    assert client_key("10.0.0.1") != client_key("10.0.0.2")


def test_headers_are_capped_before_the_token_check(server):
    s = _connect(server, "127.0.2.1")
    try:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\n")
        sent = 0
        try:
            while sent < 4 << 20:
                s.sendall(b"X-Pad: " + b"a" * 4000 + b"\r\n")
                sent += 4009
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(5)
        try:
            answer = s.recv(4096)
        except ConnectionResetError:
            answer = b""
        assert answer.startswith(b"HTTP/1.1 431"), (sent, answer[:80])
    finally:
        s.close()


def test_headers_trickled_below_the_minimum_rate_are_dropped(server):
    """The header deadline is 10 s, but 20 bytes a second is too slow: the connection closes within seconds."""
    s = _connect(server, "127.0.2.2")
    t = time.monotonic()
    try:
        for ch in b"POST /run_code HTTP/1.1\r\nHost: " + b"x" * 200:
            s.sendall(bytes([ch]))
            time.sleep(0.05)
            if time.monotonic() - t > 6:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _closed_by_server(s, 1.0) and time.monotonic() - t < 5
    s.close()


def test_many_cells_are_refused_and_output_is_budgeted(server):
    r = _post(server, "/run_jupyter", {"cells": ["1"] * 51})
    assert r.status_code == 422 and "max_cells" in r.text
    loud = "print('y' * 5000)\nimport sys\nprint('z' * 5000, file=sys.stderr)"
    r = _post(server, "/run_jupyter", {"cells": [loud] * 50})
    body = r.json()
    assert r.status_code == 200 and len(r.content) < 200 * 1024, len(r.content)
    assert body["status"] == "Failed" and "output budget" in body["message"] and len(body["cells"]) < 50


def test_lone_surrogates_in_results_still_make_a_valid_answer(server):
    cells = [
        "class X:\n    def __repr__(self):\n        return 'a\\ud800'\nX()",
        "raise ValueError('\\udfff')",
    ]
    r = _post(server, "/run_jupyter", {"cells": cells})
    assert r.status_code == 200, r.text
    body = json.loads(r.content.decode("utf-8"))
    assert body["cells"][0]["display"] == [{"text/plain": "a\\ud800"}]
    assert body["cells"][1]["error"][0]["ename"] == "ValueError"
    r = _post(server, "/run_code", {"code": "raise ValueError('\\ud800')", "stdin": "\ud800"})
    assert r.status_code == 200 and r.json()["run_result"]["return_code"] == 1, r.text


# ------------------------------------------------------------------ 5. the client reads the verdict from fields


def _client(url: str) -> SandboxFusionBackend:
    return SandboxFusionBackend(f"{url}/{TOKEN}")


def test_printed_text_cannot_pose_as_the_sandboxs_verdict(server):
    async def scenario():
        async with _client(server) as sb:
            fake = "import sys\nprint('[... 5 more bytes of stdout truncated]')\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)"
            r = await sb.run(fake)
            assert (r.status, r.truncated) == ("error", False), r
            r = await sb.run("print('x' * 10000)")
            assert r.status == "ok" and r.truncated, r
            r = await sb.run("x = bytearray(8 << 30)")
            assert r.status == "oom", r
            sid = await sb.create_session()
            r = await sb.run(fake, session=sid)
            assert (r.status, r.truncated) == ("error", False), r
            r = await sb.run("print('x' * 10000)", session=sid)
            assert r.status == "ok" and r.truncated, r

    asyncio.run(scenario())


def test_a_session_longer_than_the_servers_time_limit_keeps_working(server):
    """Our client replays a session's cells with timeouts clamped to the server's limit (60 s): the seventh
    call of 10 s each would otherwise ask for 70 s and be refused."""

    async def scenario():
        async with _client(server) as sb:
            sid = await sb.create_session()
            for i in range(9):
                r = await sb.run(f"v{i} = {i}\nv0 + v{i}", session=sid, timeout_s=10)
                assert r.status == "ok" and r.display == str(i), (i, r)

    asyncio.run(scenario())


def test_more_concurrent_jupyter_requests_than_the_pool_admits_sessions_wait_their_turn(server):
    """The pool guarantees memory to at most so many live sessions; /run_jupyter requests beyond that queue for
    one instead of failing."""

    async def one(i: int) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(
            local_address=f"127.0.3.{i + 1}"
        )  # a client each (see the fixture)
        async with httpx.AsyncClient(transport=transport, timeout=60) as client:
            body = {"cells": ["import time\ntime.sleep(0.2)", "6 * 7"]}
            return await client.post(f"{server}/{TOKEN}/run_jupyter", json=body)

    async def scenario():
        replies = await asyncio.gather(*(one(i) for i in range(20)))
        assert all(
            r.status_code == 200 and r.json()["cells"][1]["display"] == [{"text/plain": "42"}]
            for r in replies
        )

    asyncio.run(scenario())
