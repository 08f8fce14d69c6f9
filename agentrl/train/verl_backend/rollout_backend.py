"""Which rollout engine verl uses (``verl.rollout``), and how the ``agentrl`` engine plugs into verl.

verl 0.9.1 rolls out through inference servers that it looks up by ``actor_rollout_ref.rollout.name`` in
two registries:

- ``verl.workers.rollout.base._ROLLOUT_REGISTRY``: ``(name, "async")`` -> the ``BaseRollout`` "server
  adapter" that lives in each hybrid-engine worker (the process holding the FSDP actor) and receives the
  actor's weights after every step (``update_weights``). It lists only vllm, sglang and trtllm and has no
  register function, so :func:`register_rollout` adds our entry to the dict (verl imports the class from
  the dotted path we give, only when a worker asks for it).
- ``verl.workers.rollout.replica.RolloutReplicaRegistry``: ``name`` -> the ``RolloutReplica`` that
  launches the servers the agent loops talk to; this one has a public ``register(name, loader)``.

``verl.rollout`` (our config key, mapped to ``actor_rollout_ref.rollout.name``):

- ``vllm`` / ``sglang``: verl's own servers. The choice for large models (tensor parallelism, paged
  KV cache, CUDA graphs); they must be installed on every node.
- ``agentrl``: agentrl's transformers engine (:mod:`agentrl.train.verl_backend.rollout`) inside verl's
  hybrid-engine workers, one replica per GPU: KV-cached sampling, exact per-token log-probs, MoE
  routing capture, the same attention implementation as the actor (sink attention for GPT-OSS), and
  weights copied in-process from the FSDP actor through verl's weight-sync call. Needs only torch and
  transformers: small models, CI-sized GPU runs, debugging, machines without vLLM/SGLang.
- ``auto`` (default): vllm if installed here, else sglang if installed, else vllm (the dry run then
  says that neither is installed; launching stops with a message suggesting ``verl.rollout=agentrl``).
  agentrl is never chosen silently: it is far slower than vLLM on large models.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from agentrl.train.config import VERL_ROLLOUTS as ROLLOUT_CHOICES

ROLLOUT_NAME = ROLLOUT_CHOICES[-1]
"""The name our rollout registers under in verl (``actor_rollout_ref.rollout.name=agentrl``)."""

SERVER_ENGINES = ROLLOUT_CHOICES[1:-1]

ADAPTER_PATH = "agentrl.train.verl_backend.rollout.AgentrlRollout"
"""Dotted path verl imports the server adapter from (``get_rollout_class``)."""

REPLICA_PATH = "agentrl.train.verl_backend.rollout_server.AgentrlReplica"
"""Dotted path of our ``RolloutReplica``, imported when verl first asks for it (like the adapter, by name:
this registering module never imports the implementations it registers)."""


def installed_version(package: str) -> str | None:
    """Version of ``package`` if it is importable here (found without importing it), else None."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown version"


@dataclass(frozen=True)
class RolloutChoice:
    """``name``: verl's ``rollout.name``. ``reason``: one line saying why. ``installed``: whether what
    it needs is importable on this machine (always True for ``agentrl``)."""

    name: str
    reason: str
    installed: bool

    def missing_message(self) -> str:
        """The error for launching with an engine that is not installed here."""
        return (
            f"{self.reason}. verl serves rollouts with {self.name} on every node: install it (pip install "
            f"{self.name}), or set verl.rollout=agentrl to roll out with agentrl's transformers engine inside "
            "verl's training workers (any machine with torch; right for small models, slow for large ones)."
        )


def choose_rollout(requested: str) -> RolloutChoice:
    """Resolve ``verl.rollout`` (one of :data:`ROLLOUT_CHOICES`) on this machine; ValueError otherwise."""
    if requested not in ROLLOUT_CHOICES:
        raise ValueError(f"verl.rollout={requested!r} is not valid; use one of {', '.join(ROLLOUT_CHOICES)}")
    if requested == ROLLOUT_NAME:
        return RolloutChoice(
            ROLLOUT_NAME,
            "verl.rollout=agentrl: agentrl's transformers engine in verl's hybrid-engine workers (one replica "
            "per GPU), weights synced in-process from the FSDP actor after each step",
            True,
        )
    if requested in SERVER_ENGINES:
        found = installed_version(requested)
        state = f"{requested} {found} is installed here" if found else f"{requested} is NOT installed here"
        return RolloutChoice(requested, f"verl.rollout={requested}: {state}", found is not None)
    for engine in SERVER_ENGINES:
        found = installed_version(engine)
        if found:
            return RolloutChoice(engine, f"verl.rollout=auto: {engine} {found} is installed here", True)
    return RolloutChoice(
        "vllm",
        "verl.rollout=auto: neither vllm nor sglang is installed here, so it stays vllm",
        False,
    )


def _load_replica() -> type:
    module, _, name = REPLICA_PATH.rpartition(".")
    return getattr(importlib.import_module(module), name)


def register_rollout() -> list[str]:
    """Register ``agentrl`` in both of verl's rollout registries (idempotent); returns ``[ROLLOUT_NAME]``.
    Imports nothing heavy: verl resolves both entries lazily."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    return [ROLLOUT_NAME]
