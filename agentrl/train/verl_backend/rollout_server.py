"""verl's ``agentrl`` rollout, server side: the replica verl launches and the server its agent loops call.

verl's ``LLMServerManager`` creates one :class:`AgentrlReplica` per hybrid-engine worker
(``rollout.name=agentrl`` has one GPU per replica) and calls ``init_hybrid(worker_group)``;
:meth:`AgentrlReplica.launch_servers` then starts one :class:`AgentrlRolloutServer` Ray actor on the
worker's node. verl's load balancer hands that actor to ``LLMServerClient``, which awaits
``server.generate.remote(prompt_ids=..., sampling_params=..., request_id=...)`` -> ``TokenOutput`` for every
turn of every episode; the trainer's ``sleep``/``wake_up`` reach the worker through the replica.

The server micro-batches: concurrent requests with the same sampling settings (other than their token
limit) become one batch, run on the worker by
:meth:`agentrl.train.verl_backend.rollout.AgentrlRollout.generate_batch` through Ray's ``__ray_call__``;
requests that arrive meanwhile (e.g. episodes back from a tool call) join the next batch. The server
holds no weights and no GPU memory, and serves no HTTP: its ``server_address`` is a label
(``agentrl-replica-<rank>``) for verl's load balancer.

``TokenOutput``: ``token_ids``; ``log_probs`` when the request asks (``logprobs``); ``routed_experts``
``[tokens, layers, top_k]`` int when ``rollout.enable_rollout_routing_replay``; ``stop_reason``
``completed`` (or ``aborted`` for a request dropped by ``abort_all_requests``);
``extra_fields["global_steps"]``: the step of the weights that sampled it. The token limit of a request
is its ``max_tokens``, else ``min(response_length, prompt_length + response_length - len(prompt))``
like verl's vLLM server, capped by ``max_model_len``; requests without ``stop_token_ids`` stop at the
model's EOS ids (none with ``rollout.ignore_eos``). Image, video and audio inputs raise ValueError.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from agentrl.engines.base import Completion, SamplingParams
from agentrl.train.verl_backend.rollout import call_local
from agentrl.train.verl_backend.rollout_backend import ROLLOUT_NAME
from agentrl.train.verl_backend.sampling import to_sampling

logger = logging.getLogger("agentrl.verl")

WorkerCall = Callable[..., Awaitable[Any]]
"""``await call(method, *args)`` runs ``AgentrlRollout.<method>(*args)`` on the replica's worker."""


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future


def _batch_key(s: SamplingParams) -> tuple:
    return (s.temperature, s.top_p, s.top_k, tuple(s.stop_token_ids), s.seed)


class AgentrlRolloutServer:
    """One replica's request server (see module docstring). ``call``: how to reach the worker's adapter
    (Ray's ``__ray_call__`` on ``workers[0]`` unless given). ``engine_info``: the adapter's ``describe()``."""

    def __init__(
        self,
        config: Any,
        replica_rank: int,
        workers: list[Any],
        engine_info: dict[str, Any],
        call: WorkerCall | None = None,
    ):
        self.config = config
        self.replica_rank = int(replica_rank)
        self.workers = list(workers)
        self.engine_info = dict(engine_info)
        self._call = call or self._ray_call
        self.max_batch_size = max(1, int(config.max_num_seqs))
        self.prompt_length = int(config.prompt_length)
        self.response_length = int(config.response_length)
        self.max_model_len = int(config.max_model_len or self.prompt_length + self.response_length)
        self.default_stop = [] if config.ignore_eos else list(engine_info.get("eos_token_ids") or [])
        self.global_steps: int | None = None
        self._queue: list[_Request] = []
        self._drainer: asyncio.Task | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._rejecting = False

    async def _ray_call(self, method: str, *args: Any) -> Any:
        return await self.workers[0].__ray_call__.remote(call_local, self.replica_rank, method, *args)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("rollout.name=agentrl serves text only (no image, video or audio data); use vllm")
        from verl.utils.tokenizer import normalize_token_ids

        prompt = [int(t) for t in normalize_token_ids(prompt_ids)]
        room = self.max_model_len - len(prompt)
        if not prompt or room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len} (rollout.prompt_length + response_length)")
        default = min(self.response_length, self.prompt_length + self.response_length - len(prompt))
        sampling = to_sampling(sampling_params, default, self.default_stop)
        sampling = replace(sampling, max_new_tokens=max(1, min(sampling.max_new_tokens, room)))
        if not self._open.is_set():
            if self._rejecting:
                return self._aborted()
            await self._open.wait()
        result = await self._submit(prompt, sampling)
        if result is None:
            return self._aborted()
        completion, steps = result
        routed = None
        if completion.routing is not None:  # [L, n, k] -> verl's [n, L, k]
            routed = completion.routing.permute(1, 0, 2).cpu().numpy()
        return TokenOutput(
            token_ids=list(completion.token_ids),
            log_probs=list(completion.logprobs) if sampling_params.get("logprobs") else None,
            routed_experts=routed,
            stop_reason="completed",
            extra_fields={"global_steps": steps},
        )

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    async def _submit(self, prompt: list[int], sampling: SamplingParams) -> tuple[Completion, int | None] | None:
        request = _Request(prompt, sampling, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # requests that are ready this tick join the batch
            key = _batch_key(self._queue[0].sampling)
            batch = [r for r in self._queue if _batch_key(r.sampling) == key][: self.max_batch_size]
            for r in batch:
                self._queue.remove(r)
            try:
                completions, steps = await self._call(
                    "generate_batch", [r.prompt for r in batch], batch[0].sampling,
                    [r.sampling.max_new_tokens for r in batch],
                )
            except Exception as exc:  # every waiting request gets the failure
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            self.global_steps = steps
            for r, c in zip(batch, completions, strict=True):
                if not r.future.done():
                    r.future.set_result((c, steps))

    # ------------------------------------------------------------------ lifecycle verl drives
    async def sleep(self) -> None:
        """Free the worker's rollout weights (``rollout.free_cache_engine``) while the actor trains."""
        await self.wait_for_requests_to_drain()
        await self._call("release_memory")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("resume_memory", list(tags or ["weights", "kv_cache"]))

    async def wait_for_requests_to_drain(self) -> None:
        while self._drainer is not None and not self._drainer.done():
            await asyncio.shield(self._drainer)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Answer queued requests ``aborted`` and hold new ones until :meth:`resume_generation` (or answer
        them ``aborted`` too with ``reject_request``); a batch already running completes."""
        self._open.clear()
        self._rejecting = bool(reject_request)
        dropped, self._queue = self._queue, []
        for r in dropped:
            if not r.future.done():
                r.future.set_result(None)
        return {"aborted_count": len(dropped), "request_ids": []}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._open.set()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # The engine keeps KV caches only within a batch and has no profiler hooks: nothing to do.
    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


class AgentrlReplica(RolloutReplica):
    """verl ``RolloutReplica`` for ``rollout.name=agentrl``: one hybrid-engine worker, one server."""

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                "rollout.name=agentrl runs inside verl's hybrid engine only (actor_rollout_ref.hybrid_engine=true, "
                "no standalone or colocated rollout pools, no reward-model or teacher servers); use vllm or sglang"
            )
        if self.world_size != 1 or len(self.workers) != 1:
            raise ValueError(f"rollout.name=agentrl serves each replica from one GPU; got world size {self.world_size}")
        worker = self.workers[0]
        info, node_id = await asyncio.gather(
            worker.__ray_call__.remote(call_local, self.replica_rank, "describe"),
            worker.__ray_call__.remote(_node_id),
        )
        logger.info("agentrl rollout replica %d: %s", self.replica_rank, info)
        server = (
            ray.remote(AgentrlRolloutServer)
            .options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id,
                                                                                                   soft=False),
                name=f"{ROLLOUT_NAME}_server_{self.replica_rank}{self.name_suffix}",
                max_concurrency=self.max_concurrency,
                num_cpus=0,
            )
            .remote(self.config, self.replica_rank, self.workers, info)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}-replica-{self.replica_rank}"
