"""The one sandbox-server fixture body: ``agentrl serve sandbox``'s app over real HTTP on loopback.

``serve_sandbox(config)`` starts a uvicorn server on a free port, in a daemon thread, in front of a fresh local
pool (2 workers, 4 KiB output limit), waits until ``/v1/ping`` answers, yields the base URL and stops the server
when the generator is closed. Module-scoped fixtures ``yield from`` it with their own limits.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from agentrl.envs.sandbox import make_backend
from agentrl.envs.sandbox.server import SandboxServerConfig, create_app, uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_sandbox(settings: SandboxServerConfig, client_key=None) -> Iterator[str]:
    """The server's base URL while the generator runs (see the module docstring)."""
    backend = make_backend("local", workers=2, output_limit_bytes=4096)
    settings.port = free_port()
    settings.log_level = "warning"
    server = uvicorn.Server(uvicorn_config(create_app(backend, settings), settings, client_key))
    port = settings.port
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if (
                httpx.get(f"{url}/v1/ping", headers={"Authorization": f"Bearer {settings.token}"}).status_code
                == 200
            ):
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        raise RuntimeError("server did not start")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
