"""The decode engine: :class:`~agentrl.engines.decode.decode_engine.DecodeEngine` and the modules it is made of.

- :mod:`~agentrl.engines.decode.decode_engine`: the :class:`~agentrl.engines.base.RolloutEngine` (queue,
  clients, weight updates), driving
- :mod:`~agentrl.engines.decode.scheduler` (host side: continuous batching, which request runs in which slot;
  prefix reuse through :mod:`~agentrl.engines.decode.prefix_index`) and
- :mod:`~agentrl.engines.decode.runner` (device side: the slot cache, prefill, captured decode steps, sampling
  keyed per request, :mod:`~agentrl.engines.decode.sampling`);
- :mod:`~agentrl.engines.decode.decoder`: the model's forward pass over the slot cache
  (:mod:`~agentrl.engines.decode.slot_cache`, :mod:`~agentrl.engines.decode.slot_attention`), with GPT-OSS's
  experts (:mod:`~agentrl.engines.decode.moe`) and unmerged LoRA (:mod:`~agentrl.engines.decode.lora_delta`);
- :mod:`~agentrl.engines.decode.tuning`: how the engine runs on its device, and the defaults by device;
- Triton kernels of the GPU path: :mod:`~agentrl.engines.decode.decode_attention`,
  :mod:`~agentrl.engines.decode.fused_ops`.

Every module here imports torch; pick the engine through :func:`agentrl.engines.factory.make_engine`.
"""
