"""Local transformers :class:`~agentrl.engines.base.RolloutEngine`: batched KV-cache sampling on CPU or one GPU.

Concurrent callers (one coroutine per episode) are micro-batched: each ``await engine.generate(...)``
joins a queue, and a single worker coroutine drains the queue into one batched forward loop that runs
in a worker thread. The event loop stays free while the model samples, so tool calls of other
episodes run meanwhile, and episodes whose tool returned join the next batch.

Every batch runs on the same thread, the engine's own (not one of asyncio's default executor, which has
several): glibc's malloc gives each thread that allocates an arena of its own and keeps freed chunks there, so
KV caches freed on a thread stay resident until that thread allocates again. On one thread each batch reuses the
last one's memory; spread over the default executor's threads, the process held up to a batch's worth per
thread, more or less depending on which threads ran the batches.

Log-probs: ``Completion.logprobs[i]`` is the natural-log probability of the sampled id under
``softmax(logits / temperature)`` of the model (``temperature == 0`` means greedy decoding, and the
log-prob is then taken under ``softmax(logits)``). This is the distribution the trainer recomputes
(it uses the same temperature), so the rollout-vs-train gap measures numerical/engine mismatch only.
Top-k/top-p truncation changes which ids can be drawn but not the reported log-prob.

**Weight updates while requests run** (asynchronous rollouts on a separate rollout copy of the model), as in
:class:`~agentrl.engines.decode.decode_engine.DecodeEngine`: :meth:`TransformersEngine.update_weights` (trainable
tensors) and :meth:`TransformersEngine.update_lora` (the adapter) take the engine's lock, which every decode
step (one forward and its sampling) holds, so an update lands between two decode steps, never inside one; with
``version=`` they also set :attr:`~TransformersEngine.policy_version`. Once it is set, every sampled token
records the version whose weights computed its logits (``Completion.policy_versions``; None for a row with a
token sampled before a version was set). Rows in flight keep their KV cache: the keys and values of tokens
already fed stay those the older weights computed (no recompute), and each token's log-prob is the
probability it was really drawn with, which is what the decoupled PPO correction needs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.engines.base import Completion, EngineAborted, SamplingParams, checked_parameters
from agentrl.engines.kv_cache import growing_cache_for


@dataclass
class _Request:
    prompts: list[list[int]]
    sampling: SamplingParams
    future: asyncio.Future
    on_token: Callable[[int, int], None] | None = None


def _sampling_key(s: SamplingParams) -> tuple:
    return (s.max_new_tokens, s.temperature, s.top_p, s.top_k, tuple(s.stop_token_ids), s.seed)


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) ids outside the top-k / nucleus top-p set. ``logits``: [B, V] float32."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop an id when the mass strictly before it already reaches top_p (the top id is always kept)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class TransformersEngine:
    """Samples from a causal LM held in this process.

    - ``model``: a transformers ``*ForCausalLM`` (any dtype) already on ``device``.
    - ``pad_token_id``: id used for left padding (never attended to, any valid id works).
    - ``max_batch_size``: most sequences in one batched forward loop; larger requests are split.
    - ``share_prefix``: run the token prefix common to a batch's prompts (system prompt, tool docs)
      once and copy its KV cache to every row; numerically the same model, less compute. Off
      automatically for sliding-window models.
    - ``record_routing``: record each token's MoE experts (``agentrl.models.routing``) and return
      them in ``Completion.routing`` as ``[L, n, k]`` int64 for the ``n`` tokens fed to the model
      (prompt, then the completion except possibly its last token), for routing replay in training.
      Needs an MoE model; disables prefix sharing and finished-row pruning (fixed batch layout).
    - ``seed``: seeds the engine's own ``torch.Generator``; ``SamplingParams.seed`` re-seeds it for
      one batch. Re-seed between steps with :meth:`reseed` for resumable runs.

    :meth:`abort` (thread-safe) stops every generation in progress or to come: it raises
    :class:`EngineAborted` at the next token.
    """

    def __init__(
        self,
        model: Any,
        *,
        pad_token_id: int = 0,
        max_batch_size: int = 64,
        seed: int = 0,
        share_prefix: bool = True,
        record_routing: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        config = getattr(model, "config", None)
        sliding = getattr(config, "sliding_window", None) is not None or "sliding_attention" in (
            getattr(config, "layer_types", None) or ()
        )
        self.record_routing = record_routing
        self.share_prefix = share_prefix and not sliding and not record_routing
        self.min_shared_prefix = 16
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._queue: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self._sampler: ThreadPoolExecutor | None = None  # the one thread every batch runs on (module docstring)
        self._aborted = threading.Event()
        self._lock = threading.Lock()  # held by each decode step and by weight updates (module docstring)
        #: The policy version stamped on the tokens sampled from now on (module docstring); None (the default, for
        #: an engine whose owner does not count versions): no versions are recorded.
        self.policy_version: int | None = None
        self.stats = {"generate_s": 0.0, "generated_tokens": 0, "batches": 0}

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    def abort(self) -> None:
        """Stop all generation at the next token (:class:`EngineAborted`); the engine stays unusable."""
        self._aborted.set()

    @torch.no_grad()
    def update_weights(self, state: dict[str, torch.Tensor], *, version: int | None = None) -> None:
        """Copy ``state`` (parameter names of the engine's model, as ``named_parameters`` gives them; any subset)
        into the model's parameters in place, between two decode steps (module docstring). ``version``: the new
        :attr:`policy_version` (unchanged when None). ValueError naming the key for a name the model lacks or a
        shape that differs; nothing is copied then."""
        params = checked_parameters(self.model, state)
        with self._lock:
            for name, value in state.items():
                params[name].copy_(value)
            if version is not None:
                self.policy_version = int(version)

    def update_lora(self, state: dict[str, torch.Tensor], *, version: int | None = None) -> None:
        """Copy the adapter tensors ``state`` (PEFT's names, as :func:`agentrl.models.lora.adapter_state_dict`
        gives them) into the engine's model in place, between two decode steps. ``version``: the new
        :attr:`policy_version` (unchanged when None). ValueError when the model has no adapter or ``state`` does
        not fit it."""
        from agentrl.models.lora import has_lora, load_adapter_state

        if not has_lora(self.model):
            raise ValueError("update_lora: the engine's model carries no LoRA adapter")
        with self._lock:
            load_adapter_state(self.model, state, source="update_lora")
            if version is not None:
                self.policy_version = int(version)

    # ------------------------------------------------------------------ async API (micro-batched)
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Completion]:
        """Return one :class:`Completion` per prompt, in order. Safe to call from many coroutines.

        ``on_token(prompt_index, token_id)`` is called on the event loop as each token is sampled (for
        streaming), before this returns."""
        if not prompts:
            return []
        loop = asyncio.get_running_loop()
        if on_token is not None:
            user_cb = on_token

            def on_token(index: int, token: int) -> None:  # called from the sampling thread
                loop.call_soon_threadsafe(user_cb, index, token)

        request = _Request([list(p) for p in prompts], sampling, loop.create_future(), on_token)
        self._queue.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # let episodes that are ready this tick enqueue first
            key = _sampling_key(self._queue[0].sampling)
            batch: list[_Request] = []
            size = 0
            for req in list(self._queue):
                if _sampling_key(req.sampling) == key and (not batch or size + len(req.prompts) <= self.max_batch_size):
                    batch.append(req)
                    size += len(req.prompts)
                    self._queue.remove(req)
            prompts = [p for req in batch for p in req.prompts]
            routes = [(req.on_token, k) for req in batch for k in range(len(req.prompts))]
            on_token = None
            if any(cb is not None for cb, _ in routes):

                def on_token(row: int, token: int, routes=routes) -> None:
                    cb, k = routes[row]
                    if cb is not None:
                        cb(k, token)

            try:
                if self._sampler is None:
                    self._sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-sampler")
                completions = await asyncio.get_running_loop().run_in_executor(
                    self._sampler, self.generate_sync, prompts, batch[0].sampling, on_token
                )
            except Exception as exc:  # deliver the failure to every waiting caller
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            offset = 0
            for req in batch:
                if not req.future.done():
                    req.future.set_result(completions[offset : offset + len(req.prompts)])
                offset += len(req.prompts)

    @staticmethod
    def _routing_per_row(recorder: Any, attention: torch.Tensor, width: int, tokens: list[list[int]]) -> list[torch.Tensor]:
        """Split a ``[L, B, S_rec, k]`` record into per-row ``[L, n_i, k]`` over the tokens each row really
        fed: its prompt, then its own completion tokens (not the ones sampled after it stopped)."""
        from agentrl.models.routing import split_by_mask

        routing = recorder.routing()
        fed = attention[:, : routing.shape[2]].clone().cpu()
        for i, toks in enumerate(tokens):
            fed[i, width + len(toks) :] = 0
        return split_by_mask(routing, fed)

    def _shared_prefix_len(self, prompts: list[list[int]]) -> int:
        """Length of the token prefix common to all prompts, computed once and shared through the KV
        cache; 0 (no sharing) for a single prompt, a short prefix (< ``min_shared_prefix``), or a model
        with sliding-window attention (padding between prefix and suffix would shift its window)."""
        if len(prompts) < 2 or not self.share_prefix:
            return 0
        first = prompts[0]
        n = min(len(p) for p in prompts) - 1  # every row keeps >= 1 suffix token (its logits)
        for p in prompts[1:]:
            k = 0
            while k < n and p[k] == first[k]:
                k += 1
            n = k
        return n if n >= self.min_shared_prefix else 0

    # ------------------------------------------------------------------ sync core
    @torch.no_grad()  # also on the worker thread `generate` uses: grad mode is per thread
    def generate_sync(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Completion]:
        """Blocking batched sampling; splits into chunks of ``max_batch_size``. ``on_token(row, token_id)``
        is called in this thread as each token is sampled."""
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            cb = None if on_token is None else (lambda r, t, start=start: on_token(start + r, t))
            out.extend(self._generate_chunk([list(p) for p in prompts[start : start + self.max_batch_size]], sampling, cb))
        return out

    @torch.no_grad()
    def _pack(self, prompts: list[list[int]], shared: int, width: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, attention_mask, position_ids)``, ``[B, width]`` int64: the shared prefix at the left,
        then each row's suffix right-aligned (padding sits between them)."""
        device, batch = self.device, len(prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros((batch, width), dtype=torch.long, device=device)
        positions = torch.zeros((batch, width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            row = torch.tensor(p, dtype=torch.long, device=device)
            input_ids[i, :shared] = row[:shared]
            input_ids[i, width - (len(p) - shared) :] = row[shared:]
            attention[i, :shared] = 1
            attention[i, width - (len(p) - shared) :] = 1
            positions[i, :shared] = torch.arange(shared, device=device)
            positions[i, width - (len(p) - shared) :] = torch.arange(shared, len(p), device=device)
        return input_ids, attention, positions

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """The next id of each row of ``logits`` ``[B, V]`` fp32 and its log-prob (see the module docstring)."""
        if sampling.temperature > 0:
            scaled = logits / sampling.temperature
            logp_all = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(_filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        else:
            logp_all = torch.log_softmax(logits, dim=-1)
            next_ids = logits.argmax(dim=-1)
        return next_ids, logp_all.gather(-1, next_ids[:, None]).squeeze(-1)

    def _generate_chunk(
        self, prompts: list[list[int]], sampling: SamplingParams, on_token: Callable[[int, int], None] | None = None
    ) -> list[Completion]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if sampling.seed is not None:
            self.generator.manual_seed(int(sampling.seed))
        t0 = time.perf_counter()
        device = self.device
        batch = len(prompts)
        shared = self._shared_prefix_len(prompts)
        width = shared + max(len(p) - shared for p in prompts)
        input_ids, attention, positions = self._pack(prompts, shared, width)
        stop = torch.tensor(sorted(set(sampling.stop_token_ids)) or [-1], dtype=torch.long, device=device)

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logps: list[list[float]] = [[] for _ in range(batch)]
        versions: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        alive = list(range(batch))  # original row index of each live row of the cache
        was_training = self.model.training
        self.model.eval()
        # in-place KV cache with room for every token still to come (no per-step concatenation)
        cache = growing_cache_for(self.model, reserve=(width - shared if shared else 0) + sampling.max_new_tokens + 1)
        recorder = None
        if self.record_routing:
            from agentrl.models.routing import record_routing

            recorder = record_routing(self.model).__enter__()
        try:
            step_ids, step_pos = input_ids, positions
            if shared:  # the common prefix once, its KV cache copied to every row
                with self._lock:
                    cache = self.model(
                        input_ids=input_ids[:1, :shared], position_ids=positions[:1, :shared], use_cache=True,
                        logits_to_keep=1, past_key_values=cache,
                    ).past_key_values
                cache.batch_repeat_interleave(batch)
                step_ids, step_pos = input_ids[:, shared:], positions[:, shared:]
            for _ in range(sampling.max_new_tokens):
                if self._aborted.is_set():
                    raise EngineAborted("generation aborted: the engine is shutting down")
                with self._lock:  # one decode step: weight updates land before or after it (module docstring)
                    out = self.model(
                        input_ids=step_ids,
                        attention_mask=attention,
                        position_ids=step_pos,
                        past_key_values=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    version = self.policy_version
                    cache = out.past_key_values
                    next_ids, next_logp = self._sample(out.logits[:, -1, :].float(), sampling)
                ids_list = next_ids.tolist()
                lp_list = next_logp.tolist()
                is_stop = torch.isin(next_ids, stop).tolist()
                keep: list[int] = []
                for row, orig in enumerate(alive):
                    if finish[orig] == "stop":  # only when rows are not pruned (routing recording)
                        continue
                    tokens[orig].append(ids_list[row])
                    logps[orig].append(lp_list[row])
                    if version is not None:
                        versions[orig].append(version)
                    if on_token is not None:
                        on_token(orig, ids_list[row])
                    if is_stop[row]:
                        finish[orig] = "stop"
                    else:
                        keep.append(row)
                if not keep:
                    break
                step_ids = next_ids[:, None]
                step_pos = step_pos[:, -1:] + 1
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
                if len(keep) < len(alive) and recorder is None:  # drop finished rows from batch and KV cache
                    idx = torch.tensor(keep, dtype=torch.long, device=device)
                    cache.batch_select_indices(idx)
                    step_ids, step_pos, attention = step_ids[idx], step_pos[idx], attention[idx]
                    alive = [alive[r] for r in keep]
        finally:
            if recorder is not None:
                recorder.__exit__(None, None, None)
            self.model.train(was_training)
        routing = self._routing_per_row(recorder, attention, width, tokens) if recorder is not None else None
        self.stats["generate_s"] += time.perf_counter() - t0
        self.stats["generated_tokens"] += sum(len(t) for t in tokens)
        self.stats["batches"] += 1
        return [
            Completion(
                token_ids=tokens[i],
                logprobs=logps[i],
                finish_reason=finish[i],
                routing=None if routing is None else routing[i],
                policy_versions=versions[i] if len(versions[i]) == len(tokens[i]) else None,  # every token's, or none
            )
            for i in range(batch)
        ]
