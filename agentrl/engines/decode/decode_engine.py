"""The decode engine: continuous batching over a slot KV cache, sampling on the device, CUDA-graph decode steps.

:class:`DecodeEngine` implements the :class:`~agentrl.engines.base.RolloutEngine` contract of
:class:`~agentrl.engines.transformers_engine.TransformersEngine` (``generate``, ``generate_sync``,
``stats``, ``reseed``, ``abort``, ``record_routing``) for the model families
:mod:`~agentrl.engines.decode.decoder` supports (Llama, Qwen2/3, GPT-OSS), plus :meth:`DecodeEngine.release`
(free the cache between rollouts) and :meth:`DecodeEngine.client` (per-episode sampling keys and the
deterministic mode). Pick it through :func:`agentrl.engines.factory.make_engine`.

How a request runs: ``generate`` queues one job per prompt; a worker coroutine runs
:meth:`Scheduler.step <agentrl.engines.decode.scheduler.Scheduler.step>` in a thread (admit waiting jobs into free
rows, prefill them reusing cached prefixes, decode a chunk of steps for every running row) and resolves the
callers whose jobs finished. The event loop stays free meanwhile, so tool calls of other episodes run, and
an episode whose tool returned joins the running batch at the next chunk, not after the batch drains.

**Log-probs** (the same contract as the transformers engine): ``Completion.logprobs[i]`` is the natural-log
probability of the sampled id under ``softmax(logits / temperature)`` (``temperature == 0``: greedy, under
``softmax(logits)``); top-k/top-p change which ids can be drawn, not the reported log-prob.

**Sampling keys and determinism.** The randomness of token ``j`` of a request is a pure function of the
request's key and ``j`` (:mod:`agentrl.engines.decode.sampling`), never of batch composition or arrival order.
The key hashes the engine seed (:meth:`reseed`), then, in order of precedence: the client's seed and the
prompt's length (:meth:`client`: one client per episode, whose turns have strictly growing prompts);
``SamplingParams.seed`` and the prompt's length; or the prompt's tokens and how many identical prompts were
submitted since the last reseed. The position in the call's prompt list is hashed in too.
With ``deterministic=True`` the batches themselves are reproducible: before every step the engine waits
until each open client has a request waiting or running (or is closed), then admits waiting requests
sorted by key. Batch formation then depends only on what the clients asked, not on timing, so a re-run
with the same seeds and the same clients gives the same batches and, on the same machine, bit-identical
tokens and log-probs. It costs overlap: decoding pauses while any open client is between requests.

**LoRA.** A model carrying the trainer's adapter (:func:`agentrl.models.lora.apply_lora`: attention
projections and GPT-OSS's fused experts, or a Llama's projections) decodes exactly through it, unmerged: base
output plus ``s (x A^T) B^T`` per projection and per expert (:mod:`agentrl.engines.decode.lora_delta`), inside the
CUDA graphs. The engine reads the adapter's live parameters. Updating the adapter is therefore an in-place
write into those parameters, by either route:

- sharing the trainer's model (what the trainer does): its optimizer step writes them; nothing else to call;
- a separate rollout copy of the model (e.g. asynchronous rollouts): :meth:`DecodeEngine.update_lora` copies
  an :func:`agentrl.models.lora.adapter_state_dict` into it.

Either way there is no merge and no graph recapture; the next scheduler step notices the write (parameter
versions), forgets cached prefixes of idle sequences (their keys came from the old adapter) and decodes with
the new adapter. Rows already running continue with their cached keys, so an update lands between
rollouts unless the caller accepts mixed-policy rows. Replacing a parameter tensor (new storage), or
enabling, disabling or merging the adapter, makes the engine recapture its graphs.

**Weight updates while requests run** (asynchronous rollouts): :meth:`update_weights` (every trainable tensor of
a separate rollout copy) and :meth:`update_lora` (its adapter) take the engine's lock, so they land between two
scheduler steps, never inside one; with ``version=`` they also set :attr:`policy_version`. Once it is set, every
sampled token records the version current when its step ran (``Completion.policy_versions``; None for a request
with a token sampled before). Running rows keep their KV cache:
the keys and values of tokens already fed stay those the older weights computed, and the new weights compute
the rest (no recompute). The behaviour log-prob each token records is the probability it was really drawn
with, so a decoupled PPO correction (:mod:`agentrl.train.algorithms.decoupled`) stays exact; recomputing the
cache would cost a prefill of every running row per update and change no recorded quantity's meaning.

**Memory.** The cache grows as requests need it and stays allocated, with finished sequences kept for
reuse by the next turn, until :meth:`release` (the trainer calls it after each rollout so that the update
gets the memory).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.engines.base import Completion, EngineAborted, SamplingParams, checked_parameters
from agentrl.engines.decode.runner import ModelRunner, RowSampling
from agentrl.engines.decode.sampling import request_key
from agentrl.engines.decode.scheduler import Job, Scheduler
from agentrl.engines.decode.tuning import DecodeTuning


@dataclass
class _Call:
    """One ``generate`` call: its jobs (in prompt order), who to tell, streaming callback."""

    jobs: list[Job]
    future: asyncio.Future | None
    on_token: Callable[[int, int], None] | None
    client: EngineClient | None = None
    left: int = 0
    errors: list[BaseException] = field(default_factory=list)


class EngineClient:
    """One episode's handle on a :class:`DecodeEngine`: ``generate`` like the engine's, with sampling keys
    derived from ``seed``; :meth:`close` it when the episode ends (the deterministic mode waits for open
    clients). Also an async context manager."""

    def __init__(self, engine: DecodeEngine, seed: int) -> None:
        self.engine, self.seed = engine, int(seed)
        self.pending = 0
        self.open = True

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                       on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        if not self.open:
            raise RuntimeError("this engine client is closed")
        return await self.engine.generate(prompts, sampling, on_token=on_token, client=self)

    def close(self) -> None:
        self.engine._close_client(self)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class DecodeEngine:
    """See the module docstring.

    - ``model``: a supported transformers causal LM on its device (:func:`agentrl.engines.decode.decoder.unsupported_reason`).
    - ``max_batch_size``: most sequences decoding at once.
    - ``seed``: the engine seed of the sampling keys (:meth:`reseed` changes it).
    - ``record_routing``: return each completion's MoE routing (``[L, n, k]`` int64 over the ``n`` tokens
      fed: the prompt, then the completion but its last token).
    - ``share_prefix``: reuse cached prefixes (shared prompts, earlier turns); exact either way.
    - ``deterministic``: reproducible batches (see the module docstring).
    - Tuning: ``chunk_steps``, ``cuda_graphs``, ``attention``, ``fused``, ``max_slots``, ``min_length``,
      ``prefill_tokens``, each ``None`` for its device's default (:class:`~agentrl.engines.decode.tuning.
      DecodeTuning`); :attr:`tuning` holds what the engine runs with.
    """

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 64, seed: int = 0,
                 record_routing: bool = False, share_prefix: bool = True, deterministic: bool = False,
                 chunk_steps: int | None = None, cuda_graphs: bool | None = None, attention: str | None = None,
                 fused: bool | None = None, max_slots: int | None = None, min_length: int | None = None,
                 prefill_tokens: int | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.device = next(model.parameters()).device
        self.record_routing = record_routing
        self.deterministic = deterministic
        self.tuning = tune = DecodeTuning(
            chunk_steps=chunk_steps, cuda_graphs=cuda_graphs, attention=attention, fused=fused, max_slots=max_slots,
            min_length=min_length, prefill_tokens=prefill_tokens).resolve(model, max_batch_size)
        self.runner = ModelRunner(
            model, chunk_steps=tune.chunk_steps, cuda_graphs=tune.cuda_graphs, attention=tune.attention,
            fused=tune.fused, record_routing=record_routing, prefill_tokens=tune.prefill_tokens)
        self.scheduler = Scheduler(
            self.runner, max_rows=max_batch_size, max_slots=tune.max_slots,
            chunk_steps=self.runner.chunk_steps, share_prefix=share_prefix, canonical_order=deterministic,
            min_length=tune.min_length)
        self.seed = int(seed)
        #: The policy version stamped on the tokens sampled from now on (see the module docstring); None (the
        #: default, for an engine whose owner does not count versions): no versions are recorded.
        self.policy_version: int | None = None
        #: ``generate_s``: seconds spent in scheduler steps (prefill, decode, host reads: the engine busy);
        #: ``generated_tokens``: tokens of finished requests; ``batches``: steps that admitted requests
        #: (prefill batches); ``decode_chunks``: decode chunks of up to ``chunk_steps`` steps.
        self.stats: dict[str, float] = {"generate_s": 0.0, "generated_tokens": 0, "batches": 0, "decode_chunks": 0}
        self._occurrences: dict[int, int] = {}
        self._clients: set[EngineClient] = set()
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ control
    def reseed(self, seed: int) -> None:
        """New engine seed for the sampling keys of requests submitted from now on."""
        self.seed = int(seed)
        self._occurrences.clear()

    def abort(self) -> None:
        """Stop all generation at the next decode step (:class:`EngineAborted`); the engine stays unusable."""
        self.runner.aborted.set()

    def release(self) -> None:
        """Free the KV cache, decode state and captured graphs (a no-op while requests run)."""
        with self._lock:
            if not self.scheduler.has_work():
                self.scheduler.release()

    def update_lora(self, state: dict[str, torch.Tensor], *, version: int | None = None) -> None:
        """Copy the adapter tensors ``state`` (PEFT's names, as :func:`agentrl.models.lora.adapter_state_dict`
        gives them) into the engine's model in place, between scheduler steps; see the module docstring.
        ``version``: the new :attr:`policy_version` (unchanged when None). ValueError (from
        :func:`agentrl.models.lora.load_adapter_state`) when the model has no adapter or ``state`` does not fit it."""
        from agentrl.models.lora import has_lora, load_adapter_state

        if not has_lora(self.model):
            raise ValueError("update_lora: the engine's model carries no LoRA adapter")
        with self._lock:
            load_adapter_state(self.model, state, source="update_lora")
            if version is not None:
                self.policy_version = int(version)

    @torch.no_grad()
    def update_weights(self, state: dict[str, torch.Tensor], *, version: int | None = None) -> None:
        """Copy ``state`` (parameter names of the engine's model, as ``named_parameters`` gives them; any subset)
        into the model's parameters in place, between scheduler steps (see the module docstring). ``version``: the
        new :attr:`policy_version`. ValueError naming the key for a name the model lacks or a shape that differs;
        nothing is copied then."""
        params = checked_parameters(self.model, state)
        with self._lock:
            for name, value in state.items():
                params[name].copy_(value)
            if version is not None:
                self.policy_version = int(version)

    def client(self, seed: int) -> EngineClient:
        """A client whose requests' sampling keys derive from ``seed`` (see the module docstring)."""
        client = EngineClient(self, seed)
        self._clients.add(client)
        return client

    def _close_client(self, client: EngineClient) -> None:
        client.open = False
        self._clients.discard(client)
        self.scheduler.owner_done(client)
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # ------------------------------------------------------------------ jobs
    def _key(self, prompt: list[int], sampling: SamplingParams, client: EngineClient | None, index: int) -> int:
        if client is not None:
            return request_key("client", self.seed, client.seed, len(prompt), index)
        if sampling.seed is not None:
            return request_key("seed", self.seed, int(sampling.seed), len(prompt), index)
        content = hash(tuple(prompt))
        seen = self._occurrences.get(content, 0)
        self._occurrences[content] = seen + 1
        return request_key("auto", self.seed, content, seen, index)

    def _jobs(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, client: EngineClient | None) -> list[Job]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if self.runner.aborted.is_set():
            raise EngineAborted("generation aborted: the engine is shutting down")
        jobs = []
        for i, p in enumerate(prompts):
            prompt = [int(t) for t in p]
            key = self._key(prompt, sampling, client, i)
            row = RowSampling(int(sampling.max_new_tokens), float(sampling.temperature), int(sampling.top_k or 0),
                              float(sampling.top_p), key, tuple(sorted({int(s) for s in sampling.stop_token_ids})))
            jobs.append(Job(prompt, row, order=(key, i), owner=client))
        return jobs

    @staticmethod
    def _completion(job: Job) -> Completion:
        versions = list(job.versions) if len(job.versions) == len(job.tokens) else None  # every token's, or none
        return Completion(token_ids=list(job.tokens), logprobs=list(job.logprobs), finish_reason=job.finish or "length",
                          routing=job.routing, policy_versions=versions)

    def _step(self) -> tuple[list[Job], list[Job]]:
        with self._lock:
            if self.runner.aborted.is_set():
                raise EngineAborted("generation aborted: the engine is shutting down")
            t0 = time.perf_counter()
            sched = self.scheduler
            admissions, chunks = sched.admissions, sched.chunks
            advanced, finished = sched.step()
            if self.policy_version is not None:  # the tokens this step sampled, under the weights it held
                for job in (*advanced, *finished):
                    job.versions.extend([self.policy_version] * (len(job.tokens) - len(job.versions)))
            self.stats["generate_s"] += time.perf_counter() - t0
            self.stats["batches"] += sched.admissions - admissions
            self.stats["decode_chunks"] += sched.chunks - chunks
            self.stats["generated_tokens"] += sum(len(j.tokens) for j in finished)
            return advanced, finished

    # ------------------------------------------------------------------ async API
    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                       on_token: Callable[[int, int], None] | None = None,
                       client: EngineClient | None = None) -> list[Completion]:
        """One :class:`Completion` per prompt, in order; safe from many coroutines at once.
        ``on_token(prompt_index, token_id)`` is called on the event loop as tokens are sampled (every
        ``chunk_steps`` steps), before this returns."""
        if not prompts:
            return []
        jobs = self._jobs(prompts, sampling, client)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first call, or a new event loop (another asyncio.run)
            self._loop, self._changed, self._worker = loop, asyncio.Event(), None
        call = _Call(jobs, loop.create_future(), on_token, client, left=len(jobs))
        for i, job in enumerate(jobs):
            job.tag = (call, i)
            self.scheduler.submit(job)
        if client is not None:
            client.pending += 1
        self._notify()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        return await call.future

    async def _settled(self) -> None:
        """Deterministic mode: wait until no open client is between requests."""
        while any(c.open and c.pending == 0 for c in self._clients):
            self._changed.clear()
            await self._changed.wait()

    async def _work(self) -> None:
        while self.scheduler.has_work():
            try:
                if self.deterministic:
                    await self._settled()
                advanced, finished = await asyncio.to_thread(self._step)
            except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the failure
                with self._lock:
                    failed = self.scheduler.fail_all(exc)
                self._deliver([], failed)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self._deliver(advanced, finished)
            await asyncio.sleep(0)  # let callers that just got results (or were waiting) submit

    def _deliver(self, advanced: list[Job], finished: list[Job]) -> None:
        """Stream the new tokens of ``advanced`` and ``finished`` jobs, then settle the finished ones' calls."""
        for job in (*advanced, *finished):
            call, index = job.tag
            if call.on_token is not None and job.error is None:
                for token in job.tokens[job.emitted :]:
                    call.on_token(index, token)
                job.emitted = len(job.tokens)
        for job in finished:
            call = job.tag[0]
            if job.error is not None:
                call.errors.append(job.error)
            call.left -= 1
            if call.left == 0:
                self._resolve(call)

    def _resolve(self, call: _Call) -> None:
        if call.client is not None:
            call.client.pending -= 1
            self._notify()
        if call.future is None or call.future.done():
            return
        if call.errors:
            call.future.set_exception(call.errors[0])
        else:
            call.future.set_result([self._completion(j) for j in call.jobs])

    # ------------------------------------------------------------------ sync API
    def generate_sync(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                      on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Blocking :meth:`generate` for callers without an event loop (do not mix with concurrent async
        use). ``on_token(prompt_index, token_id)`` is called in this thread."""
        if not prompts:
            return []
        jobs = self._jobs(prompts, sampling, None)
        call = _Call(jobs, None, on_token, left=len(jobs))
        for i, job in enumerate(jobs):
            job.tag = (call, i)
            self.scheduler.submit(job)
        try:
            while call.left:
                advanced, finished = self._step()
                self._deliver(advanced, finished)
        except BaseException as exc:
            with self._lock:
                self.scheduler.fail_all(exc)
            raise
        if call.errors:
            raise call.errors[0]
        return [self._completion(j) for j in jobs]
