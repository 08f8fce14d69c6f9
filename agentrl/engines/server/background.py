"""Run an ASGI app with uvicorn in a daemon thread: for tests, benchmarks and in-process endpoints."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class BackgroundServer:
    """Run an ASGI app with uvicorn in a daemon thread on ``127.0.0.1`` and a free port.

    ``with BackgroundServer(app) as srv: srv.base_url`` (``http://127.0.0.1:PORT/v1``). Startup waits
    until the server accepts requests (or raises ``RuntimeError`` after ``start_timeout_s``); leaving
    the block stops it and joins the thread.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        import uvicorn

        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without
        # it, keep-alive responses written in two parts wait ~40 ms for a delayed ACK (Nagle)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.base_url = f"{self.url}/v1"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._start_timeout_s = start_timeout_s
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundServer:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for the thread, close the socket. Idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._sock.close()
