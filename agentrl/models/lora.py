"""LoRA adapters through PEFT, injected in place into a transformers causal LM.

The model stays the ``*ForCausalLM`` object the trainer already handles (``.model.layers``, ``.lm_head``,
``generate``, the MoE routers that routing replay patches, FSDP2's per-layer sharding): PEFT's
:func:`peft.inject_adapter_in_model` replaces the targeted layers by LoRA layers inside its module tree, and
no ``PeftModel`` wrapper sits around it. So chunked log-probs, routing record/replay, sink attention and the
on-policy ratio run on a LoRA model exactly as on a full one.

- :class:`LoraSpec`: rank, alpha, dropout and target names (``actor.lora.*``); rank 0 is no LoRA.
- Targets (:func:`resolve_targets`): a name is a linear layer (``q_proj``: PEFT's ``target_modules``) or a
  weight parameter (GPT-OSS's fused MoE experts ``gate_up_proj`` / ``down_proj``, 3-D ``[experts, in, out]``:
  PEFT's ``target_parameters``). Defaults per architecture (:func:`default_targets`): Llama-family models the
  attention and MLP projections; GPT-OSS its attention projections and both expert tensors.
- :func:`apply_lora`: inject the adapters (initialised from ``seed`` alone, so every FSDP rank builds the same
  ones), freeze everything else. GPT-OSS's wrapped experts then run :mod:`agentrl.models.expert_lora`'s unmerged
  grouped forward (base plus each expert's low-rank delta, from the same adapter parameters) instead of PEFT's,
  which builds ``W + s B A`` for every expert on each call; :func:`attach_adapter` does the same.
- :func:`adapters_disabled`: the base model, for the KL reference, with no second copy. Its log-probs equal
  the model's before :func:`apply_lora` bit for bit (a disabled LoRA layer returns its base layer's output).
- :func:`adapter_state_dict` / :func:`load_adapter_state`: the adapter tensors only, under PEFT's file names
  (``base_model.model.<module>.lora_A.weight``: :func:`adapter_key`, from the parameter name alone), copied
  exactly; :func:`save_adapter` / :func:`read_adapter` write and read PEFT's directory format
  (``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained`` and vLLM
  load too.
- :func:`attach_adapter` (inject from a config + load tensors: e.g. a LoRA weight sync), :func:`load_adapter` (the
  same from a directory) and :func:`merge_lora` (fold ``W + s B A`` into the base weights and drop the LoRA
  layers, to serve a trained run as a plain model).

Adapters take the dtype of the weights they adapt (as verl's FSDP workers do: FSDP2 shards uniform dtypes).
"""

from __future__ import annotations

import copy
import json
import math
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from agentrl.models import expert_lora

ADAPTER_NAME = "default"
"""The PEFT adapter name agentrl uses (PEFT's default, so saved adapters load anywhere)."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""Prefix of adapter keys in PEFT's files (a ``PeftModel`` wraps the HF model as ``base_model.model``)."""

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE_MLP = ["gate_proj", "up_proj", "down_proj"]
GPT_OSS_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MIN_PEFT_FOR_PARAMETERS = (0, 17)
"""PEFT 0.17 added ``target_parameters`` (LoRA on bare ``nn.Parameter`` tensors such as fused experts)."""


@dataclass
class LoraSpec:
    """What to adapt (the ``actor.lora`` keys). ``rank``: 0 disables LoRA. ``alpha``: the scale numerator
    (``alpha / rank`` multiplies ``B A``); None means ``2 * rank``. ``dropout``: on the adapters' input (linear
    layers only: PEFT's parameter targeting cannot apply it). ``target_modules``: layer or parameter names
    (suffixes of the module tree, see :func:`resolve_targets`); empty means :func:`default_targets`;
    ``["all-linear"]`` is PEFT's every-linear-layer-but-the-LM-head."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


def default_targets(model: nn.Module) -> list[str]:
    """The names LoRA adapts when ``target_modules`` is empty: GPT-OSS's attention projections and fused
    expert tensors; the attention and MLP projections of models that have them (Llama, Qwen, Mistral, ...);
    otherwise ``["all-linear"]``."""
    if _model_type(model) == "gpt_oss":
        return ATTENTION + GPT_OSS_EXPERTS
    names = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    known = [n for n in ATTENTION + DENSE_MLP if n in names]
    return known or ["all-linear"]


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _weight_parameters(model: nn.Module) -> list[str]:
    """Names of 2-D/3-D weight parameters held directly by a module that is not a linear layer, an embedding
    or a router (e.g. fused MoE experts): what PEFT's ``target_parameters`` can adapt."""
    out = []
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or module_name.endswith("router"):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() in (2, 3) and "bias" not in param_name:
                out.append(f"{module_name}.{param_name}" if module_name else param_name)
    return out


def _matches(full: str, name: str) -> bool:
    return full == name or full.endswith("." + name)


def _check_target_name(name: str) -> None:
    """ValueError for a target LoRA must not adapt: the MoE router, the LM head, the embeddings."""
    if "router" in name.split("."):
        raise ValueError(
            f"actor.lora.target_modules: {name!r} is the MoE router, which LoRA does not adapt here (routing "
            "replay forces its choices and the on-policy fix needs its plain logits); drop it"
        )
    if name.split(".")[-1] in ("lm_head", "embed_tokens"):
        raise ValueError(
            f"actor.lora.target_modules: {name!r}: the trainer scores tokens with the LM head's and embeddings' "
            "own weights (chunked log-probs), which an adapter there would bypass; target the decoder layers"
        )


def split_target_names(names: list[str], *, gpt_oss: bool) -> tuple[list[str] | str, list[str]]:
    """``(target_modules, target_parameters)`` from target names alone, without the model (e.g. for verl's
    config): :func:`resolve_targets`'s split by name. Empty ``names``: GPT-OSS's attention projections and fused
    experts, else ``"all-linear"`` (every decoder linear layer: what the default names cover in Llama-family
    models). A parameter target is a name with an ``experts`` component or, in GPT-OSS (whose only MLP weights
    are the fused experts), one ending in ``gate_up_proj`` / ``down_proj``. ValueError as resolve_targets."""
    names = list(names) or (ATTENTION + GPT_OSS_EXPERTS if gpt_oss else ["all-linear"])
    if names == ["all-linear"]:
        return "all-linear", []
    modules: list[str] = []
    parameters: list[str] = []
    for name in names:
        _check_target_name(name)
        parts = name.split(".")
        expert = "experts" in parts or (gpt_oss and parts[-1] in ("gate_up_proj", "down_proj"))
        (parameters if expert else modules).append(name)
    return modules, parameters


def resolve_targets(model: nn.Module, names: list[str]) -> tuple[list[str] | str, list[str]]:
    """``(target_modules, target_parameters)`` for PEFT from ``names`` (empty: :func:`default_targets`).

    A name that ends a linear layer's qualified name (``q_proj``, ``self_attn.o_proj``) is a module target;
    else one that ends a weight parameter's name (``gate_up_proj``, ``mlp.experts.down_proj``) is a parameter
    target. ``all-linear`` passes through to PEFT. Raises ValueError for a name that matches neither (listing
    what this model has), for the MoE router (routing replay and the router's softmax need it plain) and for
    the LM head and embeddings (chunked log-probs read their weights directly)."""
    names = list(names) or default_targets(model)
    if names == ["all-linear"]:
        return "all-linear", []
    linear, params = _linear_names(model), _weight_parameters(model)
    modules: list[str] = []
    parameters: list[str] = []
    for name in names:
        _check_target_name(name)
        if any(_matches(n, name) for n in linear):
            modules.append(name)
        elif any(_matches(p, name) for p in params):
            parameters.append(name)
        else:
            have = sorted(({n.rpartition(".")[2] for n in linear} | {p.rpartition(".")[2] for p in params}) - {"lm_head"})
            raise ValueError(
                f"actor.lora.target_modules: {name!r} matches no linear layer or weight parameter of "
                f"{type(model).__name__}; names here: {', '.join(have)} (or all-linear, or [] for the default)"
            )
    return modules, parameters


def _peft_version() -> tuple[int, int]:
    import peft

    major, minor, *_ = (int(x) if x.isdigit() else 0 for x in peft.__version__.split("."))
    return major, minor


def peft_config(model: nn.Module, spec: LoraSpec) -> Any:
    """The ``peft.LoraConfig`` for ``spec`` on ``model``; ValueError/ImportError say what to change."""
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ImportError(f"LoRA needs the peft package: pip install 'peft>=0.17' ({exc})") from None
    if spec.rank < 1:
        raise ValueError(f"actor.lora.rank must be >= 1 to train LoRA adapters, got {spec.rank}")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"actor.lora.dropout must be in [0, 1), got {spec.dropout}")
    modules, parameters = resolve_targets(model, spec.target_modules)
    if parameters:
        if _peft_version() < MIN_PEFT_FOR_PARAMETERS:
            import peft

            raise ImportError(
                f"LoRA on {parameters} (fused MoE experts) needs PEFT's target_parameters, added in peft 0.17; "
                f"this is peft {peft.__version__}: pip install 'peft>=0.17', or set actor.lora.target_modules "
                f"to linear layers only (e.g. {ATTENTION})"
            )
        if spec.dropout:
            raise ValueError(
                f"actor.lora.dropout={spec.dropout}: PEFT cannot apply dropout to adapters on parameters "
                f"({parameters}); set actor.lora.dropout=0, or target linear layers only"
            )
    return LoraConfig(
        r=int(spec.rank),
        lora_alpha=spec.scale_alpha,
        lora_dropout=float(spec.dropout),
        target_modules=modules,
        target_parameters=parameters or None,
        bias="none",
    )


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """Every PEFT tuner layer in ``model`` (nested ``ParamWrapper`` layers included)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    """True when ``model`` carries agentrl's (PEFT) adapter."""
    return ADAPTER_NAME in (getattr(model, "peft_config", None) or {})


def _check_experts_are_plain(model: nn.Module, parameters: list[str]) -> None:
    """Parameter targets must be real ``nn.Parameter`` tensors (not MXFP4 kernel tensors)."""
    names = {n for n, _ in model.named_parameters()}
    for target in parameters:
        if not any(_matches(n, target) for n in names):
            raise ValueError(
                f"LoRA target {target!r} is not a trainable parameter of this model (quantised MXFP4 experts?); "
                "load the model with its experts dequantised to bf16 (agentrl's loader does)"
            )


def apply_lora(model: nn.Module, spec: LoraSpec, *, seed: int = 0) -> dict[str, int]:
    """Inject ``spec``'s adapters into ``model`` in place and freeze every other parameter.

    The adapters are initialised from ``seed`` and each adapter's parameter name alone (PEFT's init: ``A``
    Kaiming-uniform, ``B`` zero, so the model's output is unchanged; see :func:`_init_adapters`), whatever the
    global RNG state, the device and the order in which the installed PEFT version creates the adapters: every
    FSDP rank, and every PEFT version, builds identical adapters, and the global RNG is left as it was.
    Returns ``{"trainable": adapter elements, "total": all elements}``. Raises ValueError for a model that
    already has an adapter or a spec PEFT cannot apply."""
    from peft import inject_adapter_in_model

    if has_lora(model):
        raise ValueError("the model already carries a LoRA adapter; apply_lora once per model")
    config = peft_config(model, spec)
    _check_experts_are_plain(model, list(config.target_parameters or []))
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    _init_adapters(model, seed)
    expert_lora.install(model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return {
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in model.parameters()),
    }


def _init_adapters(model: nn.Module, seed: int) -> None:
    """Re-draw every ``lora_A`` as PEFT does (``kaiming_uniform_(a=sqrt(5))``) from a CPU generator seeded by
    ``seed`` and the adapter's file key (:func:`adapter_key`), and zero every ``lora_B``. PEFT draws the ``A``
    factors from the global RNG in the order it creates them, which changed between versions (0.22 creates the
    GPT-OSS expert adapters before the attention ones), so a seeded run would start elsewhere under another
    PEFT."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.zero_()
            elif "lora_A" in name:
                key_seed = (seed * 1_000_003 + zlib.crc32(adapter_key(name).encode())) % 2**63
                draw = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(draw, a=math.sqrt(5), generator=torch.Generator().manual_seed(key_seed))
                param.copy_(draw)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base model inside the context (every LoRA layer returns its base layer's output);
    each layer's previous state is restored on exit, also on error. A no-op for a model without LoRA."""
    layers = lora_layers(model) if has_lora(model) else []
    before = [layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, was_disabled in zip(layers, before, strict=True):
            layer.enable_adapters(not was_disabled)


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the adapter's tensors, in ``named_parameters`` order (what the optimizer
    trains)."""
    suffix = f".{ADAPTER_NAME}."
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n and suffix in n]


def adapter_key(name: str) -> str:
    """The key in PEFT's adapter file of the adapter parameter ``name``: ``base_model.model.`` + ``name`` without
    the adapter name after its ``lora_A`` / ``lora_B`` component, e.g. ``model.layers.0.self_attn.q_proj.lora_A.
    default.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (nested ``ParamWrapper``
    targets keep their ``base_layer``: ``...mlp.experts.base_layer.lora_B.weight``).

    This is the naming of PEFT's LoRA files (what ``PeftModel.save_pretrained`` writes and ``from_pretrained`` and
    vLLM read), defined here from the name alone: it needs no PEFT call and no tensor, so it is the same under every
    PEFT version and for FSDP2 shards (peft 0.22's ``get_peft_model_state_dict`` gathers DTensors into new tensors,
    a collective, where earlier versions returned the parameters themselves)."""
    parts = name.split(".")
    keep = [part for i, part in enumerate(parts)
            if not (part == ADAPTER_NAME and i > 0 and parts[i - 1].startswith("lora_"))]
    return PEFT_PREFIX + ".".join(keep)


def adapter_keys(model: nn.Module) -> dict[str, str]:
    """``{parameter name: key in PEFT's adapter file}`` (:func:`adapter_key`) for the adapter's tensors, in
    :func:`adapter_parameters` order. Reads names only: no collective, also on a model sharded by FSDP2.
    Raises ValueError for a model without the adapter."""
    if not has_lora(model):
        raise ValueError("the model carries no LoRA adapter (apply_lora or load_adapter first)")
    return {name: adapter_key(name) for name, _ in adapter_parameters(model)}


def adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's file names (:func:`adapter_keys`), detached.

    ``state``: the tensors by parameter name to take them from (e.g. gathered from FSDP shards; only the
    adapter's entries are read); default: the model's own parameters."""
    keys = adapter_keys(model)
    source = state if state is not None else dict(adapter_parameters(model))
    return {key: source[name].detach() for name, key in keys.items()}


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], *, source: str = "adapter") -> None:
    """Copy ``state`` (PEFT's names, as :func:`adapter_state_dict` gives) into the adapter exactly. Parameters
    sharded by FSDP2 (DTensors) receive their shard (every rank must call this, with the same full ``state``).

    Raises ValueError naming the keys when ``state`` lacks an adapter tensor of this model or has one this
    model lacks (another rank, other targets), or a shape differs."""
    keys = adapter_keys(model)
    missing, unexpected = sorted(set(keys.values()) - set(state)), sorted(set(state) - set(keys.values()))
    if missing or unexpected:
        raise ValueError(
            f"{source}: its LoRA tensors do not fit this model's adapter (missing: {missing[:3] or 'none'}; "
            f"unexpected: {unexpected[:3] or 'none'}); use the actor.lora settings the adapter was trained with"
        )
    for name, param in adapter_parameters(model):
        value = state[keys[name]]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{source}: {keys[name]} has shape {tuple(value.shape)}, the model's adapter "
                             f"{tuple(param.shape)}; use the actor.lora settings the adapter was trained with")
        value = value.to(device=param.device, dtype=param.dtype)
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:  # an FSDP2 shard: this rank's part of the full tensor
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, mesh, param.placements)
        param.copy_(value)


def save_adapter(directory: str, state: dict[str, torch.Tensor], config: Any) -> list[str]:
    """Write PEFT's adapter directory: ``adapter_config.json`` (``config``: the model's ``peft.LoraConfig``) and
    ``adapter_model.safetensors`` (``state`` from :func:`adapter_state_dict`, moved to the CPU). Returns the
    paths written (the caller fsyncs them for atomic checkpoints). The config's sets (PEFT keeps
    ``target_modules`` as one) are written sorted: PEFT would write them in an order that depends on the hash
    seed, so the same run would give different files."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    written = copy.copy(config)
    for name, value in vars(config).items():
        if isinstance(value, (set, frozenset)):
            setattr(written, name, sorted(value))
    written.save_pretrained(directory)
    weights = os.path.join(directory, WEIGHTS_FILE)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, weights, metadata={"format": "pt"})
    return [os.path.join(directory, CONFIG_FILE), weights]


@dataclass
class AdapterWeights:
    """What a LoRA checkpoint holds of the model: the adapter tensors under PEFT's names (``state``) and the
    model's ``peft.LoraConfig`` (``config``)."""

    state: dict[str, torch.Tensor]
    config: Any

    @classmethod
    def of(cls, model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> AdapterWeights:
        """``model``'s adapter; ``state`` as for :func:`adapter_state_dict`."""
        return cls(adapter_state_dict(model, state), model.peft_config[ADAPTER_NAME])

    def save(self, directory: str) -> list[str]:
        """:func:`save_adapter` into ``directory``; returns the paths written."""
        return save_adapter(directory, self.state, self.config)


def is_adapter_dir(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, CONFIG_FILE)) and os.path.isfile(os.path.join(directory, WEIGHTS_FILE))


def read_adapter(directory: str, device: str | torch.device = "cpu") -> tuple[Any, dict[str, torch.Tensor]]:
    """``(peft.LoraConfig, state)`` of an adapter directory written by :func:`save_adapter` (or by PEFT)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    if not is_adapter_dir(directory):
        raise ValueError(f"{directory} is not a LoRA adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = LoraConfig.from_pretrained(directory)
    state = load_file(os.path.join(directory, WEIGHTS_FILE), device=str(device))
    keys = {k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k: v for k, v in state.items()}
    return config, keys


def spec_of(config: Any) -> dict[str, Any]:
    """The adapter settings of a ``peft.LoraConfig`` that must match to resume or load it, as plain values."""
    modules = config.target_modules
    modules = sorted(modules) if isinstance(modules, (set, list, tuple)) else modules
    return {
        "r": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "target_modules": modules,
        "target_parameters": sorted(config.target_parameters or []),
    }


def attach_adapter(model: nn.Module, config: Any, state: dict[str, torch.Tensor], *, source: str = "adapter") -> None:
    """Give ``model`` the adapter ``config`` (a ``peft.LoraConfig`` or its ``to_dict()``, e.g. the ``peft_config``
    verl sends with a LoRA weight sync) unless it already has one with the same settings, and load ``state``
    (PEFT's names) into it exactly. Raises ValueError when the settings or tensors differ."""
    from peft import LoraConfig, inject_adapter_in_model

    if isinstance(config, dict):
        known = set(LoraConfig.__dataclass_fields__)
        config = LoraConfig(**{k: v for k, v in config.items() if k in known})
    if has_lora(model):
        mine = spec_of(model.peft_config[ADAPTER_NAME])
        if mine != spec_of(config):
            raise ValueError(
                f"{source}: adapter settings {json.dumps(spec_of(config))} differ from this model's "
                f"{json.dumps(mine)}; use the actor.lora settings the adapter was trained with"
            )
    else:
        config.inference_mode = False
        with torch.random.fork_rng(devices=[]):  # the init is overwritten by ``state``; leave the RNG alone
            inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
        expert_lora.install(model)
    load_adapter_state(model, state, source=source)


def load_adapter(model: nn.Module, directory: str) -> None:
    """:func:`attach_adapter` of the adapter saved in ``directory`` (by :func:`save_adapter` or by PEFT)."""
    config, state = read_adapter(directory, next(model.parameters()).device)
    attach_adapter(model, config, state, source=directory)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapter into the base weights (``W + alpha/r * B A``) and put the base layers back in place
    of the LoRA layers; ``model`` is then a plain model again (no ``peft_config``). Returns ``model``."""
    layers = {id(m) for m in lora_layers(model)}
    tuner_names = [name for name, m in model.named_modules() if id(m) in layers]
    top = [n for n in tuner_names if not any(n.startswith(t + ".") for t in tuner_names)]
    for name in top:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child)
        if hasattr(layer, "unload_and_optionally_merge_module"):  # nested ParamWrappers merge all the way down
            base = layer.unload_and_optionally_merge_module(merge=True, safe_merge=True, adapter_names=None)
        else:
            layer.merge(safe_merge=True)
            base = layer.get_base_layer()
        setattr(parent, child, base)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model
