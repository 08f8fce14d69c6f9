"""``agentrl serve sandbox`` over real HTTP on loopback: the official ``sandbox-fusion`` client and our own
httpx client against a uvicorn server running the isolated local pool."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from collections.abc import Iterator

import httpx
import pytest
import sandbox_fusion as sf
from _sandbox_server import free_port, serve_sandbox

from agentrl.envs.sandbox.fusion import SandboxFusionBackend
from agentrl.envs.sandbox.server import SandboxServerConfig, main

if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install bubblewrap (apt-get install bubblewrap python3-seccomp)")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    yield from serve_sandbox(SandboxServerConfig(max_body_bytes=64 * 1024, max_timeout_s=60.0, max_concurrency=8))


@pytest.fixture(scope="module")
def token_url() -> Iterator[str]:
    yield from serve_sandbox(SandboxServerConfig(token=TOKEN))


def test_ping(url):
    r = httpx.get(f"{url}/v1/ping")
    assert r.status_code == 200 and r.json() == "pong"


def test_official_client_run_code(url):
    resp = sf.run_code(
        sf.RunCodeRequest(code="print(1 + 1)", language="python"), endpoint=url, max_attempts=1
    )
    assert resp.status == sf.RunStatus.Success
    assert resp.run_result.stdout == "2\n" and resp.run_result.return_code == 0
    assert resp.run_result.status == sf.CommandRunStatus.Finished


def test_official_client_stdin_and_failure(url):
    req = sf.RunCodeRequest(
        code="import sys\nx = sys.stdin.read()\nprint(x.upper())\nraise SystemExit(3)",
        language="python",
        stdin="abc",
    )
    resp = sf.run_code(req, endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Failed
    assert resp.run_result.stdout == "ABC\n" and resp.run_result.return_code == 3


def test_official_client_timeout(url):
    req = sf.RunCodeRequest(code="while True:\n    pass", language="python", run_timeout=0.5)
    resp = sf.run_code(req, endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Failed
    assert resp.run_result.status == sf.CommandRunStatus.TimeLimitExceeded


@pytest.mark.parametrize(
    "field, value",
    [
        ("run_timeout", "NaN"),
        ("run_timeout", "Infinity"),
        ("run_timeout", "-1"),
        ("run_timeout", "0"),
        ("run_timeout", "1000"),
        ("run_timeout", '"soon"'),
        ("compile_timeout", "-5"),
        ("compile_timeout", "NaN"),
        ("memory_limit_MB", "-7"),
    ],
)
def test_bad_timeouts_get_422_naming_the_field(url, field, value):
    body = f'{{"code": "print(1)", "language": "python", "{field}": {value}}}'.encode()
    r = httpx.post(f"{url}/run_code", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and field in r.text, (r.status_code, r.text)


@pytest.mark.parametrize(
    "field, value",
    [
        ("total_timeout", "NaN"),
        ("total_timeout", "-1"),
        ("total_timeout", "61"),
        ("cell_timeout", "-0.5"),
        ("cell_timeout", "1e9"),
    ],
)
def test_bad_jupyter_timeouts_get_422(url, field, value):
    body = f'{{"cells": ["1"], "{field}": {value}}}'.encode()
    r = httpx.post(f"{url}/run_jupyter", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and field in r.text, (r.status_code, r.text)


def test_official_client_files_roundtrip(url):
    req = sf.RunCodeRequest(
        code="data = open('in.txt').read()\nopen('out.txt', 'w').write(data[::-1])",
        language="python",
        files={"in.txt": base64.b64encode(b"hello").decode()},
        fetch_files=["out.txt"],
    )
    resp = sf.run_code(req, endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Success, resp
    assert base64.b64decode(resp.files["out.txt"]) == b"olleh"


def test_unsupported_language_is_a_clear_sandbox_error(url):
    with pytest.raises(Exception, match="not supported"):
        sf.run_code(sf.RunCodeRequest(code="int main(){}", language="cpp"), endpoint=url, max_attempts=1)


def test_official_client_run_jupyter(url):
    cells = [
        "a = 123",
        "a",
        "print(a)",
        "import sys; sys.stderr.write('stderr message')",
        "raise RuntimeError('error message')",
    ]
    resp = sf.run_jupyter(sf.RunJupyterRequest(cells=cells), endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Success
    # like Jupyter, a trailing expression shows its value: sys.stderr.write returns 14
    assert [c.display for c in resp.cells] == [[], [{"text/plain": "123"}], [], [{"text/plain": "14"}], []]
    assert resp.cells[2].stdout == "123\n"
    assert resp.cells[3].stderr == "stderr message"
    assert (
        resp.cells[4].error[0]["ename"] == "RuntimeError"
        and resp.cells[4].error[0]["evalue"] == "error message"
    )


def test_jupyter_cell_timeout(url):
    req = sf.RunJupyterRequest(cells=["x = 1", "while True: pass", "x"], cell_timeout=0.5, total_timeout=5)
    resp = sf.run_jupyter(req, endpoint=url, max_attempts=1)
    assert resp.driver.status == sf.CommandRunStatus.TimeLimitExceeded
    assert len(resp.cells) == 2


def test_malformed_json(url):
    r = httpx.post(
        f"{url}/run_code",
        content=b'{"code": "print(1)", "language": ',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert "json" in r.text.lower()


def test_missing_field(url):
    r = httpx.post(f"{url}/run_code", json={"language": "python"})
    assert r.status_code == 422 and "code" in r.text


def test_oversize_code(url):
    r = httpx.post(f"{url}/run_code", json={"code": "x = 1\n" * 20000, "language": "python"})
    assert r.status_code == 413 and "exceeds" in r.json()["detail"]


def test_oversize_code_streamed_without_length(url):
    def body():
        for _ in range(20):
            yield b" " * 8192

    r = httpx.post(f"{url}/run_code", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_verl_style_payload_with_extra_fields(url):
    payload = {
        "compile_timeout": 10,
        "run_timeout": 5,
        "code": "print(input())",
        "stdin": "7",
        "memory_limit_MB": 1024,
        "language": "python",
        "files": {},
        "fetch_files": [],
    }
    r = httpx.post(f"{url}/run_code", json=payload)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "7\n"


def test_memory_limit_mb_is_honoured(url):
    payload = {"code": "x = bytearray(300 * 1024**2)", "language": "python", "memory_limit_MB": 200}
    body = httpx.post(f"{url}/run_code", json=payload).json()
    assert body["status"] == "Failed" and "MemoryError" in body["run_result"]["stderr"], body


def test_concurrent_load_200_requests_16_clients(url):
    kwargs = [
        {
            "request": sf.RunCodeRequest(code=f"print({i} * {i})", language="python"),
            "endpoint": url,
            "max_attempts": 1,
        }
        for i in range(200)
    ]
    results = sf.run_concurrent(sf.run_code, kwargs=kwargs, concurrency=16)
    assert len(results) == 200
    for i, resp in enumerate(results):
        assert resp.status == sf.RunStatus.Success, resp
        assert resp.run_result.stdout == f"{i * i}\n"


def test_bearer_token(token_url):
    assert httpx.get(f"{token_url}/v1/ping").status_code == 200  # health checks need no token
    assert (
        httpx.post(f"{token_url}/run_code", json={"code": "print(1)", "language": "python"}).status_code
        == 401
    )
    bad = httpx.post(
        f"{token_url}/run_code",
        json={"code": "print(1)", "language": "python"},
        headers={"Authorization": "Bearer nope"},
    )
    assert bad.status_code == 401
    ok = httpx.post(
        f"{token_url}/run_code",
        json={"code": "print(1)", "language": "python"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "1\n"


def test_our_client_against_our_server(token_url):
    async def scenario():
        async with SandboxFusionBackend(token_url, token=TOKEN) as sb:
            assert await sb.ping()
            r = await sb.run("print(6 * 7)")
            assert r.ok and r.stdout == "42\n"
            r = await sb.run("import sys; print(sys.stdin.read()[::-1])", stdin="abc")
            assert r.stdout == "cba\n"
            r = await sb.run("1/0")
            assert r.status == "error" and "ZeroDivisionError" in r.stderr and r.exit_code == 1
            r = await sb.run("while True: pass", timeout_s=0.5)
            assert r.status == "timeout"
            r = await sb.run("import ctypes; ctypes.string_at(0)")
            assert r.status == "killed" and r.exit_code == -11
            sid = await sb.create_session()
            assert (await sb.run("x = 20", session=sid)).ok
            r = await sb.run("x * 2", session=sid)
            assert r.display == "40"
            assert (await sb.run("undefined_name", session=sid)).status == "error"
            assert (await sb.run("x + 1", session=sid)).display == "21"
            await sb.release_session(sid)
            results = await asyncio.gather(*(sb.run(f"print({i})") for i in range(32)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(32)]

    asyncio.run(scenario())


def test_our_client_reports_unreachable_server():
    async def scenario():
        async with SandboxFusionBackend(f"http://127.0.0.1:{free_port()}", retries=0) as sb:
            r = await sb.run("print(1)")
            assert r.status == "sandbox_error" and "failed" in r.message

    asyncio.run(scenario())


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "SandboxFusion" in out and "max_timeout_s = 60.0" in out


def test_verl_sandbox_fusion_client(url):
    """verl's own SandboxFusion caller (used by its reward scoring and tools) against our server."""
    verl_sf = pytest.importorskip("verl.utils.reward_score.sandbox_fusion.utils")
    resp, err = verl_sf.call_sandbox_api(
        f"{url}/run_code", "print(int(input()) * 2)", "21", 10, 5, 1024, "python"
    )
    assert err is None and resp["status"] == "Success" and resp["run_result"]["stdout"] == "42\n"
    resp, err = verl_sf.call_sandbox_api(f"{url}/run_code", "while True: pass", "", 10, 1, 1024, "python")
    assert err is None and resp["run_result"]["status"] == "TimeLimitExceeded"


def test_bounded_queue_answers_503_when_full():
    gen = serve_sandbox(SandboxServerConfig(max_concurrency=1, max_queue=1))
    url = next(gen)
    try:

        async def burst():
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"code": "import time; time.sleep(0.5)", "language": "python"}
                return await asyncio.gather(*(client.post(f"{url}/run_code", json=body) for _ in range(6)))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes.count(200) >= 2 and 503 in codes, codes  # one running, one queued, the rest refused
        busy = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert "busy" in busy.json()["detail"]
    finally:
        gen.close()
