"""``agentrl serve model``: serve a local model over the OpenAI-compatible API of :mod:`agentrl.engines.server.app`.

Once the socket accepts requests it prints one line, ``ready: http://HOST:PORT/v1 model=NAME
format=FORMAT``, on stdout. SIGTERM or Ctrl-C stops it promptly: generation in progress is aborted
(its request gets an error), open connections get ``timeout_graceful_shutdown_s`` to finish.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.cli_args import CommandSpec, UsageError, key, run
from agentrl.engines.factory import KINDS as ENGINE_KINDS

FORMATS = ("auto", "harmony", "chat_template")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ServeModelConfig:
    """The keys of ``agentrl serve model``, each declared once (:func:`agentrl.cli_args.key`)."""

    model: str = key(doc="a built-in name (tiny-gpt-oss, smollm2-135m), a model directory, a run directory or a hub id")
    format: str = key("auto", "chat format: auto (Harmony for GPT-OSS, else the model's chat template)", choices=FORMATS)
    host: str = key("127.0.0.1", "address to bind (0.0.0.0 serves other machines; then set api_key)")
    port: int = key(8000, "TCP port (0: any free port, printed in the ready line)", min=0, max=65535)
    served_model_name: str | None = key(None, "model id reported by /v1/models (default: the model's name)")
    api_key: str | None = key(None, "require `Authorization: Bearer KEY` (default: $AGENTRL_API_KEY if set)")
    max_tokens: int = key(1024, "default completion limit of chat requests that set none", min=1)
    device: str | None = key(None, "cpu or cuda (default: cpu)", choices=DEVICES)
    dtype: str = key("float32", "weights dtype", choices=DTYPES)
    seed: int = key(0, "seed of the sampler (requests may pass their own seed)")
    max_batch_size: int = key(64, "most sequences sampled in one batch", min=1)
    engine: str = key("auto", "local engine: auto (decode on CUDA where it supports the model, else transformers)",
                      choices=ENGINE_KINDS)
    timeout_graceful_shutdown_s: float = key(2.0, "seconds open connections get to finish after SIGTERM", min=0)


SPEC = CommandSpec(
    prog="agentrl serve model",
    schema=ServeModelConfig,
    usage="agentrl serve model model=NAME_OR_DIR [port=8000] [key=value ...]",
    examples={"model": "model=smollm2-135m"},
    notes=(
        "Serves /v1/completions (token ids in, token ids + log-probs out), /v1/chat/completions (tools,\n"
        "streaming as tokens are sampled) and /v1/agentrl/format (the chat format, which `agentrl eval`\n"
        "reads so that model=http://HOST:PORT/v1 needs no format=). --port 8000 style works too."
    ),
)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another port=N") from None
    return sock


def serve(app: Any, sock: socket.socket, *, ready_line: str, on_exit: Any = None, grace_s: float = 2.0) -> None:
    """Run ``app`` on ``sock`` until SIGTERM/SIGINT; print ``ready_line`` once it accepts requests and call
    ``on_exit()`` as soon as a signal arrives (e.g. to abort generation)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)
            # a requested stop: exit normally (status 0) instead of uvicorn re-raising the signal at the end
            self._captured_signals.clear()

    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=max(0.1, grace_s)
    )
    server = Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(ready_line, flush=True)
        await task

    asyncio.run(main())


def _serve(cfg: Any) -> int:
    import os

    from agentrl.engines.server import load_local_engine
    from agentrl.engines.server.app import create_app

    sock = _bind(cfg.host, cfg.port)  # before the (slow) model load: a busy port fails at once
    try:
        engine, fmt, name = load_local_engine(
            cfg.model, format=cfg.format, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
            max_batch_size=cfg.max_batch_size, engine=cfg.engine,
        )
    except (ValueError, FileNotFoundError, OSError, RuntimeError, KeyError) as exc:
        sock.close()
        raise UsageError(f"cannot load model={cfg.model}: {exc}") from None
    name = cfg.served_model_name or name
    app = create_app(
        engine, fmt, model_name=name, api_key=cfg.api_key or os.environ.get("AGENTRL_API_KEY"),
        default_max_tokens=cfg.max_tokens,
    )
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    port = sock.getsockname()[1]
    ready = f"ready: http://{host}:{port}/v1 model={name} format={fmt.name}"
    serve(app, sock, ready_line=ready, on_exit=getattr(engine, "abort", None), grace_s=cfg.timeout_graceful_shutdown_s)
    print("agentrl serve model: stopped", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl serve model``."""
    return run(SPEC, argv, _serve)
