"""verl's ``agentrl`` rollout, worker side: agentrl's local engine (``agentrl.engines.factory.make_engine``)
as a verl server adapter.

verl's hybrid-engine worker (the Ray actor holding the FSDP actor on one GPU) builds its rollout with
``get_rollout_class(rollout.name, "async")(config=RolloutConfig, model_config=HFModelConfig,
device_mesh=...)``; for ``rollout.name=agentrl`` that is :class:`AgentrlRollout`, so the engine lives in
the same process and on the same device as the actor. One replica per worker: tensor, data and pipeline
parallel sizes of the rollout must be 1.

Contract with verl (``verl.workers.rollout.base.BaseRollout``):

- ``update_weights(weights, global_steps=None, wire_format="named_tensors", peft_config=None, ...)``:
  ``weights`` yields ``(name, tensor)`` with the actor's full tensors (FSDP ``get_per_tensor_param``:
  HF state-dict names; Qwen-style packed MoE experts arrive split per expert and are packed back). Each
  tensor is copied into the engine's model (cast to its dtype). Every parameter must be written, else
  ValueError naming the ones missing; an unknown name is a KeyError. The ``delta_flush`` wire format is
  refused (NotImplementedError).
- LoRA (``actor_rollout_ref.model.lora_rank > 0`` without ``lora.merge``): verl first syncs the base weights
  (``peft_config`` set, ``base_sync_done=False``; PEFT's ``.base_layer`` is stripped from their names), then,
  at every step, the adapter alone (``base_sync_done=True``: PEFT's ``lora_A``/``lora_B`` tensors), which
  :func:`agentrl.models.lora.attach_adapter` injects into the rollout model (the first time, with verl's
  ``peft_config``) and copies exactly; an adapter whose settings or tensors do not fit is a ValueError. The
  rollout samples from base + adapter only once both have arrived. With ``lora.merge=true`` verl sends
  merged full weights instead (the plain path).
- ``release()`` (verl calls it through the replica's ``sleep`` before training): with
  ``rollout.free_cache_engine`` the weights' device memory is freed (verl's vLLM "level 2" sleep: the
  next ``update_weights`` restores them), otherwise nothing; the engine's KV cache is freed either way. A
  LoRA rollout keeps its base weights through sleep (verl's "level 1": it syncs them only once).
  ``resume(tags)``: ``"weights"`` allocates the weights again (contents undefined until the next update);
  ``"kv_cache"`` is a no-op (the engine allocates its cache when it next generates).
- Sampling refuses to run on weights that are not the actor's: before the first update when
  ``rollout.load_format`` is ``dummy`` (verl's default: verl syncs before the first rollout), after a
  ``release``/``resume`` without an update, or during an update (RuntimeError in each case).

The replica's server (:mod:`agentrl.train.verl_backend.rollout_server`) runs batches here through
:func:`call_local` (Ray's ``__ray_call__`` on the worker actor), one at a time on the worker's event loop,
so a batch never overlaps a weight update. The model is built from verl's ``HFModelConfig.hf_config``,
i.e. with the actor's ``override_config`` including ``attn_implementation``: rollout and training run the
same attention kernel (``agentrl_sink`` for GPT-OSS by default), in ``rollout.dtype``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout

from agentrl.engines.base import Completion, SamplingParams
from agentrl.engines.factory import make_engine

_LOCAL: dict[int, AgentrlRollout] = {}
"""The adapters living in this process, by replica rank (one per hybrid-engine worker)."""

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

_ADAPTER_NAME_IN_KEY = re.compile(r"\.(lora_[AB])\.default\.")
"""An adapter key that still names PEFT's adapter (``...lora_A.default.weight``): PEFT's files drop it."""

_SPLIT_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def local_rollout(replica_rank: int) -> AgentrlRollout:
    """The adapter of ``replica_rank`` built in this process (KeyError when there is none)."""
    if replica_rank not in _LOCAL:
        raise KeyError(
            f"no agentrl rollout for replica {replica_rank} in this process (have {sorted(_LOCAL)}); "
            "the hybrid-engine worker builds it when actor_rollout_ref.rollout.name=agentrl"
        )
    return _LOCAL[replica_rank]


def call_local(_actor: Any, replica_rank: int, method: str, *args: Any) -> Any:
    """``worker.__ray_call__.remote(call_local, rank, method, *args)``: run ``method`` of this process's
    adapter synchronously (the worker's event loop waits for it)."""
    return getattr(local_rollout(replica_rank), method)(*args)


def _device() -> torch.device:
    """The worker's current accelerator (verl has set it), or the CPU when there is none."""
    from verl.utils.device import get_device_name

    name = get_device_name()
    backend = getattr(torch, name, None)
    if name == "cpu" or backend is None or not backend.is_available():
        return torch.device("cpu")
    return torch.device(name, backend.current_device())


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={name!r} is not supported; use bfloat16, float16 or float32")
    return _DTYPES[key]


def _eos_ids(model_config: Any) -> list[int]:
    """EOS ids a request without ``stop_token_ids`` stops at: generation config, else model config."""
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "hf_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])})
    return []


class AgentrlRollout(BaseRollout):
    """verl server adapter backed by the engine :func:`~agentrl.engines.factory.make_engine` picks
    (see module docstring). ``replica_rank=-1`` takes it from the worker's ``RANK`` (one replica per rank)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1, **_: Any):
        super().__init__(config, model_config, device_mesh)
        sizes = {
            "tensor_model_parallel_size": self.config.tensor_model_parallel_size,
            "data_parallel_size": self.config.data_parallel_size,
            "pipeline_model_parallel_size": self.config.pipeline_model_parallel_size,
        }
        bad = {k: v for k, v in sizes.items() if int(v) != 1}
        if bad:
            raise ValueError(
                f"rollout.name=agentrl runs one engine per GPU; got {bad}. Set them to 1 (verl.tensor_parallel=1), "
                "or use vllm/sglang for models that need several GPUs per replica"
            )
        self.replica_rank = int(os.environ.get("RANK", 0)) if replica_rank == -1 else int(replica_rank)
        self.device = _device()
        self.dtype = _dtype(self.config.dtype)
        self.model = self._build_model()
        self.attn_implementation = str(getattr(self.model.config, "_attn_implementation", None))
        tokenizer = getattr(self.model_config, "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        self.engine = make_engine(
            self.model,
            pad_token_id=int(pad or 0),
            max_batch_size=max(1, int(self.config.max_num_seqs)),
            seed=int(self.config.seed) + self.replica_rank,
            # prefix sharing pads between prefix and suffix: only for attention that takes any 4-D mask
            share_prefix=self.attn_implementation in ("eager", "sdpa"),
            record_routing=bool(self.config.enable_rollout_routing_replay),
        )
        self.eos_token_ids = _eos_ids(self.model_config)
        self.global_steps: int | None = None
        self.synced = "dummy" not in str(self.config.load_format)
        self.base_synced = self.synced  # the base weights are the actor's (loaded, or synced once)
        self.updating = False
        self._released: list[tuple[torch.nn.Parameter, torch.Size]] = []
        _LOCAL[self.replica_rank] = self

    @property
    def is_leader_rank(self) -> bool:
        return True

    def _build_model(self) -> Any:
        from transformers import AutoModelForCausalLM

        hf_config = self.model_config.hf_config
        attn = getattr(hf_config, "_attn_implementation", None)
        if "dummy" in str(self.config.load_format):  # verl syncs the actor's weights before the first rollout
            with self.device:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=self.dtype, attn_implementation=attn)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_config.local_path, config=hf_config, dtype=self.dtype, attn_implementation=attn
            ).to(self.device)
        return model.eval().requires_grad_(False)

    def describe(self) -> dict[str, Any]:
        """What this replica serves (logged by the replica, used by its server)."""
        return {
            "replica_rank": self.replica_rank,
            "model": type(self.model).__name__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attn_implementation": self.attn_implementation,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "eos_token_ids": list(self.eos_token_ids),
            "record_routing": self.engine.record_routing,
        }

    # ------------------------------------------------------------------ sampling (run by the server)
    def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, limits: Sequence[int]
    ) -> tuple[list[Completion], int | None]:
        """Sample one completion per prompt; row ``i`` is cut to at most ``limits[i]`` new tokens (the
        batch samples up to ``max(limits)``; a row's first ``limits[i]`` tokens are distributed exactly
        as with that limit). Returns the completions and the weights' ``global_steps``."""
        if self.updating:
            raise RuntimeError("agentrl rollout: a batch was requested during a weight update; "
                               "verl must not generate while it syncs weights")
        if self._released or not self.synced:
            raise RuntimeError(
                "agentrl rollout: the weights are not the actor's (never synced with load_format=dummy, or "
                "released by sleep and not re-synced); verl's update_weights must run before generation"
            )
        if len(limits) != len(prompts) or any(int(n) < 1 for n in limits):
            raise ValueError("generate_batch needs one limit >= 1 per prompt")
        out = self.engine.generate_sync(prompts, replace(sampling, max_new_tokens=max(int(n) for n in limits)))
        return [_cut(c, len(p), int(n)) for c, p, n in zip(out, prompts, limits, strict=True)], self.global_steps

    # ------------------------------------------------------------------ weight sync (verl's interface)
    async def update_weights(
        self,
        weights: Any,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"rollout.name=agentrl takes full tensors (wire_format='named_tensors'), got {wire_format!r}; "
                "use checkpoint_engine.backend=naive"
            )
        adapter_only = peft_config is not None and bool(kwargs.get("base_sync_done", True))
        if self._released:
            self.resume_memory(["weights"])
        self.updating = True
        self.synced = False
        try:
            if adapter_only:
                await self._load_adapter(weights, peft_config)
            else:
                loader = WeightLoader(self.model)
                async for name, tensor in ensure_async_iterator(weights):
                    loader.write(name, tensor)
                loader.finish()
                self.base_synced = True
        finally:
            self.updating = False
        # a LoRA base sync alone is not the actor's policy yet: its adapter follows
        self.synced = peft_config is None or adapter_only
        self.global_steps = global_steps

    async def _load_adapter(self, weights: Any, peft_config: Any) -> None:
        """A LoRA sync: the adapter tensors (PEFT's names) into the rollout model, injected the first time."""
        from verl.workers.rollout.utils import ensure_async_iterator

        from agentrl.models.lora import PEFT_PREFIX, attach_adapter

        if not self.base_synced:
            raise RuntimeError(
                "agentrl rollout: a LoRA adapter sync arrived before the base weights (load_format=dummy and no base "
                "sync); verl syncs the base first, so check actor_rollout_ref.rollout.load_format"
            )
        state = {}
        async for name, tensor in ensure_async_iterator(weights):
            name = _ADAPTER_NAME_IN_KEY.sub(r".\1.", name)
            state[name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name] = tensor
        config = peft_config if isinstance(peft_config, dict) or not hasattr(peft_config, "to_dict") else peft_config.to_dict()
        attach_adapter(self.model, config, state, source="agentrl rollout: the actor's LoRA adapter")
        self.model.requires_grad_(False)

    # ------------------------------------------------------------------ memory (verl's sleep / wake-up)
    def release_memory(self) -> None:
        """Free the engine's KV cache, and the weights' device memory (with ``free_cache_engine``; not a LoRA
        rollout's); see module docstring."""
        from agentrl.models.lora import has_lora

        release = getattr(self.engine, "release", None)
        if release is not None:
            release()
        if not self.config.free_cache_engine or self._released or has_lora(self.model):
            return  # a LoRA rollout keeps its base weights: verl syncs them only once
        for param in self.model.parameters():
            self._released.append((param, param.shape))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Allocate released weights again (``"weights"``); the next update fills them."""
        if "weights" in tags and self._released:
            for param, shape in self._released:
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
            self._released = []
            self.synced = False

    async def resume(self, tags: list[str]) -> None:
        self.resume_memory(tags)

    async def release(self) -> None:
        self.release_memory()


class WeightLoader:
    """Copies named full tensors from verl's actor into ``model`` (see module docstring for the names it
    takes). ``write`` each ``(name, tensor)``, then ``finish()`` checks every parameter was written."""

    def __init__(self, model: Any):
        self.model = model
        # detached aliases of the parameters' current storage, under their plain names (a LoRA model's base
        # weights without PEFT's ``.base_layer``); adapter tensors come through the adapter sync instead
        self.targets = {_plain(n): t for n, t in model.state_dict().items() if ".lora_" not in n}
        self.written: dict[int, int] = {}

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        name = _plain(name)
        if name not in self.targets:
            name = self._checkpoint_name(name)
        if name in self.targets:
            target = view = self.targets[name]
        else:
            split = _SPLIT_EXPERT.match(name)
            packed = split and (split["base"] + (".down_proj" if split["part"] == "down_proj" else ".gate_up_proj"))
            if not packed or packed not in self.targets:
                raise KeyError(f"agentrl rollout: the actor sent weight {name!r}, which the rollout model has not")
            target = self.targets[packed]
            view = target[int(split["expert"])]
            if split["part"] != "down_proj":  # verl splits gate_up_proj [E, 2I, H] in halves along dim 1
                half = view.shape[0] // 2
                view = view.narrow(0, 0 if split["part"] == "gate_proj" else half, half)
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"agentrl rollout: weight {name!r} has shape {tuple(tensor.shape)} from the actor, "
                             f"{tuple(view.shape)} in the rollout model")
        view.copy_(tensor)
        self.written[target.data_ptr()] = self.written.get(target.data_ptr(), 0) + view.numel()

    def finish(self) -> None:
        missing = [n for n, p in self.model.named_parameters()
                   if ".lora_" not in n and self.written.get(p.data_ptr(), 0) < p.numel()]
        if missing:
            raise ValueError(
                f"agentrl rollout: the weight update did not cover {len(missing)} parameter(s), e.g. "
                f"{missing[:5]}; the actor and rollout models differ (check actor_rollout_ref.model)"
            )

    def _checkpoint_name(self, name: str) -> str:
        """verl reverses transformers' ``_checkpoint_conversion_mapping`` on the actor's keys; apply it."""
        for pattern, replacement in (getattr(self.model, "_checkpoint_conversion_mapping", None) or {}).items():
            renamed, n = re.subn(pattern, replacement, name)
            if n:
                return renamed
        return name


def _plain(name: str) -> str:
    """A weight's name without PEFT's ``.base_layer`` (verl's base sync of a LoRA actor keeps it on the
    targeted linear layers; nested parameter-targeting wrappers may add several)."""
    return name.replace(".base_layer", "")


def _cut(c: Completion, prompt_len: int, limit: int) -> Completion:
    """``c`` limited to ``limit`` new tokens (``length`` when cut); its routing to the tokens fed."""
    if len(c.token_ids) <= limit:
        return c
    routing = None if c.routing is None else c.routing[:, : prompt_len + limit]
    return Completion(token_ids=c.token_ids[:limit], logprobs=c.logprobs[:limit], finish_reason="length",
                      routing=routing)
