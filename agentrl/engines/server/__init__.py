"""``agentrl serve model``: an OpenAI-compatible model server. This package gathers the public names; each
job lives in its own module:

- :mod:`agentrl.engines.server.openai_api`: pydantic request/response models, OpenAI <-> agentrl translation;
- :mod:`agentrl.engines.server.app`: the FastAPI app (:func:`create_app`);
- :mod:`agentrl.engines.server.chat_stream`: incremental SSE deltas of streamed chat completions;
- :mod:`agentrl.engines.server.served_format`: how the server describes its chat format to clients;
- :mod:`agentrl.engines.server.background`: :class:`BackgroundServer` (uvicorn in a thread);
- :mod:`agentrl.engines.server.serve_cli`: the command line;
- here: :func:`load_local_engine`, a local model in the engine :func:`agentrl.engines.factory.make_engine`
  picks, with its format.
"""

from __future__ import annotations

from agentrl.engines.base import RolloutEngine
from agentrl.engines.server.app import create_app
from agentrl.engines.server.background import BackgroundServer
from agentrl.engines.server.openai_api import (
    RequestError,
    openai_to_messages,
    openai_to_tools,
    turn_to_message,
)
from agentrl.harmony.format import ChatFormat

__all__ = [
    "BackgroundServer",
    "RequestError",
    "create_app",
    "load_local_engine",
    "openai_to_messages",
    "openai_to_tools",
    "turn_to_message",
]


def load_local_engine(
    model: str,
    *,
    format: str = "auto",
    device: str | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_batch_size: int = 64,
    engine: str = "auto",
) -> tuple[RolloutEngine, ChatFormat, str]:
    """Load a local model (a built-in name such as ``tiny-gpt-oss`` / ``smollm2-135m``, a directory
    with ``config.json``, a training run directory, or a hub id; :func:`agentrl.models.loading.load_model`)
    into the engine ``engine`` names (:func:`agentrl.engines.factory.make_engine`: ``auto`` | ``decode`` |
    ``transformers``), with the ChatFormat that fits it (``format="auto"``: Harmony for GPT-OSS,
    the HF chat template otherwise, a run's own format). Imports torch.
    Returns ``(engine, format, model name)``."""
    from agentrl.engines.factory import make_engine
    from agentrl.models.loading import load_model

    loaded = load_model(model, device=device or "cpu", dtype=dtype, seed=seed)
    loaded.model.eval()
    fmt = loaded.chat_format(format)
    pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
    local = make_engine(
        loaded.model, kind=engine, pad_token_id=int(pad if pad is not None else 0), max_batch_size=max_batch_size,
        seed=seed,
    )
    return local, fmt, model.rstrip("/").rsplit("/", 1)[-1]
