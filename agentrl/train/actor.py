"""The policy a run trains and what samples from it: model, KL reference, optimizers, engine.

:func:`build_actor` loads ``cfg.model`` (:func:`agentrl.models.loading.load_model`), injects the LoRA
adapters (``actor.lora``) or freezes the ``actor.freeze`` groups, shards it with the run's parallel strategy,
builds the RL AdamW over the trainable parameters and the rollout engine that samples from the very same
weights (so a rollout always sees the latest update; :func:`agentrl.engines.factory.make_engine`,
``rollout.engine`` / ``rollout.deterministic``). :meth:`Actor.sft_optimizer` is the cold start's own AdamW
(``sft.*``; dropped before RL).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from agentrl.engines.factory import make_engine
from agentrl.models.loading import LoadedModel, load_model


@dataclass
class Actor:
    """``model`` (trained in place), ``ref_model`` (the frozen KL reference, ``model`` itself for a LoRA run,
    or None), ``optimizer`` (RL's
    AdamW), ``engine`` (samples from ``model``), ``format`` (the run's ChatFormat), ``pad_token_id``,
    ``load_s`` (seconds the model took to load)."""

    loaded: LoadedModel
    model: Any
    ref_model: Any | None
    optimizer: torch.optim.Optimizer
    engine: Any
    format: Any
    pad_token_id: int
    load_s: float
    cfg: DictConfig

    def sft_optimizer(self) -> torch.optim.Optimizer:
        """A fresh AdamW for the SFT stage (``sft.lr``, ``sft.weight_decay``, ``actor.betas``)."""
        sft = self.cfg.sft
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=sft.lr, betas=tuple(self.cfg.actor.betas), weight_decay=sft.weight_decay)


def lora_spec(cfg: DictConfig) -> Any:
    """The run's :class:`~agentrl.models.lora.LoraSpec` (``actor.lora``), or None when ``actor.lora.rank`` is 0."""
    section = cfg.actor.lora
    if not section.rank:
        return None
    from agentrl.models.lora import LoraSpec

    return LoraSpec(rank=int(section.rank), alpha=None if section.alpha is None else float(section.alpha),
                    dropout=float(section.dropout), target_modules=[str(t) for t in section.target_modules])


def build_actor(cfg: DictConfig, parallel: Any) -> Actor:
    """Load the model, inject the LoRA adapters (``actor.lora.rank > 0``: every base weight frozen), freeze the
    ``actor.freeze`` groups, shard it, take the KL reference (a copy of the initial weights, before any
    checkpoint is loaded; with LoRA the model itself, run with its adapters disabled), build the optimizer over
    the trainable parameters (the adapters only with LoRA) and the engine. Raises ValueError for a config that
    leaves nothing to train, LoRA targets the model lacks, or routing replay of a dense model."""
    t0 = time.perf_counter()
    loaded = load_model(
        cfg.model, device=cfg.device, dtype=cfg.dtype, attn_implementation=cfg.attn_implementation, seed=cfg.seed,
        model_kwargs=OmegaConf.to_container(cfg.model_kwargs),
    )
    load_s = time.perf_counter() - t0
    model = loaded.model
    lora = lora_spec(cfg)
    if lora is not None:  # before gradient checkpointing and sharding: they see the LoRA layers
        from agentrl.models.lora import apply_lora

        apply_lora(model, lora, seed=cfg.seed)
    ref_model = None
    if cfg.actor.use_kl_loss:  # a LoRA model is its own reference: its base with the adapters disabled
        ref_model = model if lora is not None else copy.deepcopy(model).eval()
        if lora is None:
            ref_model.requires_grad_(False)
    if cfg.actor.freeze:
        from agentrl.train.freeze import freeze

        freeze(model, list(cfg.actor.freeze))
    if cfg.actor.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    parallel.wrap(model)  # before the optimizer: it holds the (sharded) parameters
    if ref_model is not None and ref_model is not model:
        parallel.wrap(ref_model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"actor.freeze={list(cfg.actor.freeze)} froze every parameter; nothing to train")
    optimizer = torch.optim.AdamW(
        params, lr=cfg.actor.lr, betas=tuple(cfg.actor.betas), weight_decay=cfg.actor.weight_decay
    )
    pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
    pad_token_id = int(pad if pad is not None else 0)
    if cfg.actor.routing_replay:
        from agentrl.models.routing import find_routers

        find_routers(model)  # raises a clear error for dense models
    engine = make_engine(
        model, kind=cfg.rollout.engine, pad_token_id=pad_token_id, max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.seed, record_routing=cfg.actor.routing_replay, deterministic=cfg.rollout.deterministic,
    )
    return Actor(loaded, model, ref_model, optimizer, engine, loaded.chat_format(cfg.format), pad_token_id, load_s, cfg)
