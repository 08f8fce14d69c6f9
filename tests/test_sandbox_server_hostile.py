"""``agentrl serve sandbox`` against hostile clients and hostile code: slow and half-open connections, connection
floods from many loopback addresses, forged result frames, and the official client authenticating with a token in the path."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import sandbox_fusion as sf
from _sandbox_server import serve_sandbox

from agentrl.cli_args import UsageError, declarations
from agentrl.envs.sandbox.server import SandboxServerConfig, parse_args

pytestmark = pytest.mark.sandbox_attacks  # the attacks tier; its smoke cases stay in the default tier

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

TOKEN = "path-token-9f3c"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    config = SandboxServerConfig(
        token=TOKEN,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=24,
        max_connections_per_client=4,
        max_timeout_s=60.0,
    )
    yield from serve_sandbox(config)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", _port(url)))
    s.settimeout(5)
    return s


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _ok(url: str, source: str = "127.0.0.1") -> bool:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=10) as client:
        r = client.post(f"{url}/{TOKEN}/run_code", json={"code": "print(7)", "language": "python"})
    return r.status_code == 200 and r.json()["run_result"]["stdout"] == "7\n"


def test_half_open_connections_hold_up_only_their_own_client_until_their_deadline(server):
    """A client holding its cap (4) of connections with partial headers gets its next connection served once
    the header deadline (1 s here) closes them: the new one waits, unread, and never cuts off one of the
    client's own requests that may still be arriving (a burst of requests lost its first ones that way)."""
    held = []
    for _ in range(4):
        s = _connect(server, "127.0.0.2")
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-")  # never finished
        held.append(s)
    assert _ok(server, "127.0.0.2")  # waited for room, then served
    assert all(_closed_by_server(s, 3.0) for s in held)  # the 1 s header deadline, not forever
    assert _ok(server, "127.0.0.2")


def test_idle_connection_without_a_byte_is_closed(server):
    s = _connect(server, "127.0.0.4")
    assert _closed_by_server(s, 3.0)


def test_slow_body_is_closed_and_never_runs(server):
    s = _connect(server, "127.0.0.5")
    code = b'{"code": "open(\\"/tmp/ran\\", \\"w\\")", "language": "python"}'
    s.sendall(
        b"POST /" + TOKEN.encode() + b"/run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(code) + 100).encode() + b"\r\n\r\n" + code
    )
    assert _closed_by_server(s, 3.0)


def test_trickled_headers_do_not_extend_the_deadline(server):
    s = _connect(server, "127.0.0.6")
    t = time.monotonic()
    closed = False
    for ch in b"POST /run_code HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx":
        try:
            s.sendall(bytes([ch]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.1)
    assert closed or _closed_by_server(s, 2.0)
    assert time.monotonic() - t < 4.0


#: Posts print(7) to the server at argv[1] (its port) and argv[2] (the token); prints the answer's stdout.
_POST_AS_ANOTHER_USER = """
import http.client, json, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
conn.request("POST", f"/{sys.argv[2]}/run_code", json.dumps({"code": "print(7)"}), {"Content-Type": "application/json"})
print(json.loads(conn.getresponse().read())["run_result"]["stdout"], end="")
"""


def test_connection_flood_from_many_loopback_addresses_holds_up_only_its_own_user(server):
    """28 connections without a byte from as many loopback addresses are one client, one local user: at most 4
    of them are read at a time and the rest wait (up to 24, the server's total cap), unread, until the header
    deadline (1 s) has closed the ones before them; another local user is served meanwhile, and this one once
    the flood is gone."""
    socks = [_connect(server, f"127.0.1.{i}") for i in range(1, 29)]
    try:
        if os.getuid() == 0:
            other = subprocess.run(
                ["/usr/bin/python3", "-c", _POST_AS_ANOTHER_USER, str(_port(server)), TOKEN],
                user=65534,
                cwd="/",
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert other.stdout == "7\n", other
            assert not _closed_by_server(socks[-1], 0.05)  # served while the flood still held its connections
        assert all(_closed_by_server(s, 30.0) for s in socks)
        assert _ok(server, "127.0.0.7")
    finally:
        for s in socks:
            s.close()


def test_official_client_with_the_token_in_the_path(server):
    req = sf.RunCodeRequest(code="print(6 * 7)", language="python")
    resp = sf.run_code(req, endpoint=f"{server}/{TOKEN}", max_attempts=1)
    assert resp.status == sf.RunStatus.Success and resp.run_result.stdout == "42\n"
    jupyter = sf.run_jupyter(
        sf.RunJupyterRequest(cells=["x = 2", "x * 21"]), endpoint=f"{server}/{TOKEN}", max_attempts=1
    )
    assert jupyter.cells[1].display[0]["text/plain"] == "42"
    with pytest.raises(Exception, match="401"):  # the client raises a bare Exception naming the status
        sf.run_code(req, endpoint=f"{server}/wrong-token", max_attempts=1)
    with pytest.raises(Exception, match="401"):
        sf.run_code(req, endpoint=server, max_attempts=1)
    assert httpx.get(f"{server}/{TOKEN}/v1/ping").json() == "pong"
    assert httpx.post(f"{server}/{TOKEN}x/run_code", json={"code": "1"}).status_code == 401
    assert httpx.post(f"{server}/x{TOKEN}/run_code", json={"code": "1"}).status_code == 401


def test_token_never_reaches_the_logs(server, caplog):
    caplog.set_level(logging.DEBUG)
    sf.run_code(
        sf.RunCodeRequest(code="print(1)", language="python"), endpoint=f"{server}/{TOKEN}", max_attempts=1
    )
    httpx.get(f"{server}/{TOKEN}/nowhere")
    server_side = [r for r in caplog.records if r.name.startswith(("agentrl", "uvicorn", "fastapi"))]
    assert server_side and not any(TOKEN in r.getMessage() for r in server_side)  # the clients' own logs may


FORGERIES = {
    "wrong types": 'b\'{"exit_code": "0", "kind": "ok", "display": 5, "error": [1], "files": {"a": 7}}\'',
    "extra fields": 'b\'{"exit_code": 0, "kind": "ok", "display": null, "error": null, "files": {}, "status": "sandbox_error", "stdout": "FORGED"}\'',
    "files never asked for": 'b\'{"exit_code": 0, "kind": "ok", "display": null, "error": null, "files": {"/etc/shadow": "Zm9yZ2Vk"}}\'',
    "huge exit code": "b'S99999999999999999999 ok'",
    "bad kind": "b'S0 timeout'",
    "trailing garbage": "b'S0 ok' + b'\\\\x00' * 3",
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_result_frames_cannot_change_the_answer(server, forgery):
    """The code writes its own result frame on the worker's channel (fd 3); the answer stays well-typed and says
    the channel was corrupted."""
    code = (
        "import os, struct\n"
        f"body = {FORGERIES[forgery]}\n"
        "os.write(3, struct.pack('>I', len(body) - (3 if body.endswith(b'\\x00' * 3) else 0)) + body)\n"
        "os._exit(0)\n"
    )
    r = httpx.post(
        f"{server}/{TOKEN}/run_code", json={"code": code, "language": "python", "fetch_files": ["a"]}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert body["status"] == "Failed" and "corrupted" in body["message"], body
    assert (
        body["files"] == {}
        and body["run_result"]["stdout"] == ""
        and body["run_result"]["return_code"] is None
    )


def test_forged_traceback_in_a_jupyter_cell_is_not_an_error(server):
    code = (
        "import sys\nprint('Traceback (most recent call last):\\nZeroDivisionError: forged', file=sys.stderr)"
    )
    r = httpx.post(f"{server}/{TOKEN}/run_jupyter", json={"cells": [code, "1/0"]})
    cells = r.json()["cells"]
    assert cells[0]["error"] == [] and "forged" in cells[0]["stderr"]
    assert cells[1]["error"][0]["ename"] == "ZeroDivisionError"


@pytest.mark.smoke
def test_config_dataclass_drives_the_command_line():
    declared = declarations(SandboxServerConfig)
    assert set(declared) == set(SandboxServerConfig.__dataclass_fields__)
    assert all(meta.get("doc") for meta in declared.values())  # every key says what it is (--help shows it)
    a = parse_args(["--port", "9001", "--max-timeout-s", "5", "--unsafe-no-isolation"])
    b = parse_args(["port=9001", "max_timeout_s=5", "unsafe_no_isolation=true"])
    assert a == b and a.port == 9001 and a.max_timeout_s == 5.0 and a.unsafe_no_isolation
    with pytest.raises(UsageError, match="max_timeout_s must be a finite number, got nan"):
        parse_args(["max_timeout_s=nan"])
    with pytest.raises(UsageError, match="max_timeout_s must be a positive number"):
        parse_args(["max_timeout_s=-1"])
    with pytest.raises(UsageError, match="token must be"):
        parse_args(["token=a/b"])
    assert parse_args(["--max-timeout", "7"]).max_timeout_s == 7.0  # the flag's old name still works
    os.environ["AGENTRL_SANDBOX_TOKEN"] = "from-env"
    try:
        assert parse_args([]).token == "from-env"
    finally:
        del os.environ["AGENTRL_SANDBOX_TOKEN"]
