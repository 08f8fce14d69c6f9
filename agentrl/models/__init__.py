"""agentrl.models: the torch model plumbing that both the engines (sampling, serving) and the trainer use.

- :mod:`agentrl.models.loading`: load a causal LM by name (built-ins, a directory, a hub id, or a training
  run directory, which resolves to its latest checkpoint and chat format).
- :mod:`agentrl.models.tiny`: random-init tiny GPT-OSS models for tests and benchmarks.
- :mod:`agentrl.models.gpt_oss_20b`: GPT-OSS-20B's exact architecture with random weights, built through the meta
  device on the target device (``model=gpt-oss-20b-random``).
- :mod:`agentrl.models.lora`: LoRA adapters through PEFT, injected in place (targets per architecture, the
  adapters-off reference, adapter-only state, merge for serving).
- :mod:`agentrl.models.expert_lora`: the trainer's forward of GPT-OSS's LoRA-wrapped experts, unmerged and grouped
  (base plus each expert's low-rank delta, from PEFT's adapter parameters).
- :mod:`agentrl.models.routing`: MoE routing record (at sampling) and replay (in the training forward).

Where a run keeps its checkpoints is :mod:`agentrl.rundir` (torch-free). Nothing is imported here.
"""
