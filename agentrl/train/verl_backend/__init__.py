"""Run agentrl envs, fixes and kernels inside verl (Ray, FSDP/Megatron, vLLM/SGLang/agentrl rollout).

Modules, one job each:

- :mod:`.plugin`: what ``import verl`` loads through the ``verl.plugins`` entry point (agent loop,
  policy losses, sink attention, the ``agentrl`` rollout) in the driver and in every Ray worker.
- :mod:`.rollout_backend`: ``verl.rollout`` (vllm / sglang / agentrl / auto) and the registration of the
  ``agentrl`` rollout in verl's rollout registries; :mod:`.rollout`: its worker-side adapter (agentrl's
  transformers engine in verl's hybrid-engine worker, weight sync); :mod:`.rollout_server`: its replica
  and the Ray server the agent loops call; :mod:`.sampling`: verl's sampling dict -> ours.
- :mod:`.agent_loop`: the ``agentrl`` verl agent loop, driving any ``AgentEnv`` token-in-token-out.
- :mod:`.http_client`: a verl ``LLMServerClient`` that talks to an OpenAI-compatible token server.
- :mod:`.ulysses`: sink attention under Ulysses sequence parallelism (sinks sliced with the heads).
- :mod:`.dataset`: the parquet rows verl's dataloader reads (``agent_name`` + env/task spec).
- :mod:`.config_map`: our config -> verl Hydra overrides; :mod:`.validate`: compose and check them
  with verl's own config and validators.
- :mod:`.launch`: ``agentrl train backend=verl ...``: dataset, config, ``--dry-run``, launch.

Importing this package imports nothing heavy; verl is imported by the modules that need it.
"""
