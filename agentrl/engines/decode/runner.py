"""The device side of the decode engine: slot cache, per-slot decode state, prefill, captured decode steps.

:class:`ModelRunner` is driven by the host-side :class:`~agentrl.engines.decode.scheduler.Scheduler` through a
small interface (:meth:`reserve`, :meth:`copy_prefix`, :meth:`prefill`, :meth:`set_rows`,
:meth:`decode`, :meth:`routing`, :meth:`release`). Rows are slots: decode row ``i`` is slot ``i``, and a
decode step runs on the slots ``0 .. bucket-1`` (rows that are not live compute garbage that is never
kept, and write their keys to the slot's scratch position).

Per-slot decode state lives in device buffers (:class:`DecodeState`): the token to feed, its position,
whether the row is live, how many tokens it has produced and may produce, its sampling parameters and
request key, its stop ids. One decode step (:meth:`ModelRunner._step`) feeds every live row's token,
samples the next one on the device (:func:`~agentrl.engines.decode.sampling.sample_tokens`), checks stop ids,
the token limit and the cache capacity on the device, advances the state and writes the sampled ids,
log-probs and live flags to per-chunk output buffers. :meth:`decode` runs ``steps`` of them and copies
the outputs to the host once. On CUDA each step is replayed from a CUDA graph captured per batch bucket
(and sampling variant) on first use; the graphs are dropped when the cache is reallocated or a parameter
moves to new storage.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from agentrl.engines.base import EngineAborted
from agentrl.engines.decode.decoder import SlotDecoder
from agentrl.engines.decode.sampling import sample_tokens
from agentrl.engines.decode.slot_attention import KernelAttention, PrefillPlan, TorchAttention
from agentrl.engines.decode.slot_cache import SlotCache

#: Decode batch sizes a graph is captured for; a step runs at the smallest bucket covering its slots.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


@dataclass
class RowSampling:
    """How one request samples: limits, temperature (0 = greedy), top-k (0 = off), top-p (1 = off),
    its 62-bit key and stop ids."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    key: int
    stop_ids: tuple[int, ...]


@dataclass
class PrefillRow:
    """Feed ``tokens`` at positions ``start ..`` of ``slot`` (positions ``< start`` are already cached)."""

    slot: int
    start: int
    tokens: list[int]
    sampling: RowSampling


@dataclass
class RowState:
    """A live decode row: ``token`` (sampled, not yet fed) goes in at ``position``; ``produced`` tokens so far."""

    slot: int
    token: int
    position: int
    produced: int
    sampling: RowSampling


@dataclass
class ChunkOutput:
    """Decode steps over the rows ``0 .. bucket-1``, per row (``tokens[row][step]``): sampled ids, log-probs,
    and whether the row was live at that step (its token counts), on the host."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    live: list[list[bool]]


class DecodeState:
    """Per-slot device buffers (see the module docstring); ``slots`` rows, ``steps`` output columns."""

    def __init__(self, slots: int, steps: int, stops: int, device: torch.device) -> None:
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.ids, self.pos, self.n_gen, self.max_new, self.top_k, self.key = (z(slots) for _ in range(6))
        self.active, self.done = z(slots, dtype=torch.bool), z(slots, dtype=torch.bool)
        self.temp, self.top_p = z(slots, dtype=torch.float32), z(slots, dtype=torch.float32)
        self.stops = torch.full((slots, stops), -1, dtype=torch.int64, device=device)
        self.out_tok, self.out_lp = z(steps, slots), z(steps, slots, dtype=torch.float32)
        self.out_live = z(steps, slots, dtype=torch.bool)
        self.t = z(1)
        self.slots, self.steps, self.n_stops = slots, steps, stops

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.ids, self.pos, self.n_gen, self.done, self.t)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for dst, src in zip((self.ids, self.pos, self.n_gen, self.done, self.t), saved, strict=True):
            dst.copy_(src)


class ModelRunner:
    """See the module docstring.

    - ``model``: a model :class:`~agentrl.engines.decode.decoder.SlotDecoder` supports, on its device.
    - ``chunk_steps``: the most decode steps between two host copies.
    - ``cuda_graphs``: capture decode steps (CUDA only).
    - ``attention``: ``"kernel"`` (:class:`~agentrl.engines.decode.slot_attention.KernelAttention`), ``"torch"``
      (:class:`~agentrl.engines.decode.slot_attention.TorchAttention`) or ``"exact"`` (torch prefill, decoding with
      the IEEE float32 kernel of :mod:`agentrl.engines.decode.decode_attention`).
    - ``fused``: the Triton element-wise kernels (:mod:`agentrl.engines.decode.fused_ops`).
    - ``record_routing``: keep each cached token's MoE experts (GPT-OSS).
    """

    def __init__(self, model: torch.nn.Module, *, chunk_steps: int, cuda_graphs: bool, attention: str, fused: bool,
                 record_routing: bool = False, prefill_tokens: int = 8192) -> None:
        self.decoder = SlotDecoder(model, fused=fused)
        self.device = self.decoder.device
        if attention not in ("kernel", "torch", "exact"):
            raise ValueError(f"attention must be 'kernel', 'torch' or 'exact', got {attention!r}")
        if attention != "torch" and self.decoder.head_dim not in (16, 32, 64, 128, 256):
            raise ValueError(f"attention={attention!r} needs head_dim in 16..256 (a power of two), "
                             f"got {self.decoder.head_dim}")
        if record_routing and not self.decoder.moe_layers:
            raise ValueError("record_routing needs an MoE model (GPT-OSS); this model has no router")
        d = self.decoder
        self.cache = SlotCache(layers=d.n_layers, kv_heads=d.hkv, head_dim=d.head_dim, dtype=d.dtype,
                               device=self.device, layout="token" if attention == "kernel" else "head",
                               moe_layers=d.moe_layers if record_routing else 0, top_k=d.top_k)
        self.attention = (KernelAttention(self.cache) if attention == "kernel"
                          else TorchAttention(self.cache, exact_kernel=attention == "exact"))
        self.chunk_steps = max(1, int(chunk_steps))
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.prefill_tokens = max(1, int(prefill_tokens))
        self.state: DecodeState | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._rows: list[int] = []
        self.aborted = threading.Event()

    # ------------------------------------------------------------------ memory
    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def records_routing(self) -> bool:
        return self.cache.moe_layers > 0

    def reserve(self, slots: int, length: int, stops: int = 1) -> None:
        """At least ``slots`` slots of ``length`` positions (scratch included) and room for ``stops`` stop ids
        per row; keeps cached keys and live decode state."""
        old_length = self.cache.length
        grown = self.cache.reserve(slots, length)
        if grown and self.cache.length != old_length:
            self.decoder.build_rope(self.cache.length)
        steps = self.chunk_steps
        if self.state is None or self.state.slots < self.cache.slots or self.state.n_stops < stops:
            new = DecodeState(self.cache.slots, steps, max(stops, self.state.n_stops if self.state else 1), self.device)
            if self.state is not None:
                for name in ("ids", "pos", "n_gen", "max_new", "top_k", "key", "active", "done", "temp", "top_p"):
                    getattr(new, name)[: self.state.slots].copy_(getattr(self.state, name))
                new.stops[: self.state.slots, : self.state.n_stops].copy_(self.state.stops)
            self.state = new
            grown = True
        if grown:
            self._drop_graphs()

    def check_weights(self) -> bool:
        """Call before work: refreshes the fused weight copies when the model's parameters were updated in
        place, and drops the captured graphs (and rebuilds the copies) when one moved to new storage.
        Returns True when the weights changed since the last call (cached keys are then stale)."""
        moved, updated = self.decoder.weights_changed()
        if moved or not self.decoder.weights_ready:
            self._drop_graphs()
            self.decoder.sync_weights(rebuild=True)
        elif updated:
            self.decoder.sync_weights()
        return moved or updated

    def release(self) -> None:
        """Free the cache, the decode state and the captured graphs."""
        self._drop_graphs()
        self.cache.release()
        self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    def copy_prefix(self, pairs: list[tuple[int, int, int]]) -> None:
        self.cache.copy_prefix(pairs)

    def routing(self, slot: int, n: int) -> torch.Tensor:
        return self.cache.routing_of(slot, n)

    # ------------------------------------------------------------------ prefill
    def _row_tensors(self, rows: list[RowSampling]) -> dict[str, torch.Tensor]:
        dev = self.device
        return {
            "temp": torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev),
            "top_k": torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=dev),
            "top_p": torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev),
            "key": torch.tensor([r.key for r in rows], dtype=torch.int64, device=dev),
        }

    @torch.no_grad()
    def prefill(self, rows: list[PrefillRow]) -> tuple[list[int], list[float]]:
        """Feed each row's tokens (rows in increasing slot order, distinct slots); returns the first sampled
        id and its log-prob per row (sampling counter 0). Long batches run in pieces of at most
        ``prefill_tokens`` tokens; a row's later piece attends to its earlier pieces through the cache."""
        pieces: list[list[tuple[int, int, list[int]]]] = [[]]
        budget = self.prefill_tokens
        for i, row in enumerate(rows):
            for off in range(0, len(row.tokens), self.prefill_tokens):
                part = row.tokens[off : off + self.prefill_tokens]
                piece = (i, row.start + off, part)
                if (len(part) > budget or any(j == i for j, _, _ in pieces[-1])
                        or not self._fits_padded(pieces[-1] + [piece])):
                    pieces.append([])
                    budget = self.prefill_tokens
                pieces[-1].append(piece)
                budget -= len(part)
        last_logits: dict[int, torch.Tensor] = {}
        for group in pieces:
            if not group:
                continue
            group.sort(key=lambda piece: rows[piece[0]].slot)
            logits = self._prefill_forward([(rows[i].slot, start, toks) for i, start, toks in group])
            for (i, start, toks), lg in zip(group, logits, strict=True):
                if start + len(toks) == rows[i].start + len(rows[i].tokens):
                    last_logits[i] = lg
        logits = torch.stack([last_logits[i] for i in range(len(rows))])
        tensors = self._row_tensors([r.sampling for r in rows])
        top_k = tensors["top_k"] if any(r.sampling.top_k for r in rows) else None
        top_p = tensors["top_p"] if any(r.sampling.top_p < 1 for r in rows) else None
        ids, lp = sample_tokens(logits, tensors["temp"], tensors["key"], torch.zeros_like(tensors["key"]),
                                top_k=top_k, top_p=top_p, k_cap=max(r.sampling.top_k for r in rows))
        return ids.tolist(), lp.tolist()

    def _fits_padded(self, group: list[tuple[int, int, list[int]]]) -> bool:
        """Whether batched torch prefill attention over ``group`` keeps its float32 scores under 2**27
        elements (always true for the kernel path, which does not pad)."""
        if isinstance(self.attention, KernelAttention) or not group:
            return True
        max_q = max(len(toks) for _, _, toks in group)
        max_keys = max(start + len(toks) for _, start, toks in group)
        return len(group) * max_q * max_keys * self.decoder.hq <= 2**27 or len(group) == 1

    def _prefill_forward(self, pieces: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One forward over ``(slot, start, tokens)`` pieces (increasing slots); logits of each piece's last token."""
        dev = self.device
        ids = torch.tensor([t for _, _, toks in pieces for t in toks], dtype=torch.int64, device=dev)
        positions = torch.tensor([p for _, s, toks in pieces for p in range(s, s + len(toks))], dtype=torch.int64,
                                 device=dev)
        slots = torch.tensor([slot for slot, _, toks in pieces for _ in toks], dtype=torch.int64, device=dev)
        n_q = [len(toks) for _, _, toks in pieces]
        n_keys = [s + len(toks) for _, s, toks in pieces]
        last = torch.tensor(n_q, device=dev).cumsum(0) - 1
        slot_list = [slot for slot, _, _ in pieces]
        if isinstance(self.attention, KernelAttention):
            cu = KernelAttention.bounds(torch.tensor(slot_list, device=dev), torch.tensor(n_q, device=dev),
                                        torch.tensor(n_keys, device=dev), self.cache.length)

            def attend(layer, q, sinks, window, scale):
                return self.attention(layer, q, cu, max(n_q), sinks=sinks, window=window, scale=scale)
        else:
            plan = PrefillPlan.build(slot_list, n_q, n_keys, dev)

            def attend(layer, q, sinks, window, scale):
                return self.attention.prefill(layer, q, plan, sinks=sinks, window=window, scale=scale)

        return self.decoder.forward(ids, positions, positions, slots, self.cache, attend, dense_moe=False, rows=last)

    # ------------------------------------------------------------------ decode state
    def set_rows(self, rows: list[RowState], inactive: list[int]) -> None:
        """Make ``rows`` live (state uploaded) and the slots ``inactive`` not live."""
        st = self.state
        if inactive:
            st.active[torch.tensor(inactive, device=self.device)] = False
        if not rows:
            return
        dev = self.device
        idx = torch.tensor([r.slot for r in rows], device=dev)
        t = self._row_tensors([r.sampling for r in rows])
        st.ids[idx] = torch.tensor([r.token for r in rows], device=dev)
        st.pos[idx] = torch.tensor([r.position for r in rows], device=dev)
        st.n_gen[idx] = torch.tensor([r.produced for r in rows], device=dev)
        st.max_new[idx] = torch.tensor([r.sampling.max_new_tokens for r in rows], device=dev)
        for name in ("temp", "top_k", "top_p", "key"):
            getattr(st, name)[idx] = t[name]
        stops = torch.full((len(rows), st.n_stops), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            stops[i, : len(r.sampling.stop_ids)] = torch.tensor(r.sampling.stop_ids, dtype=torch.int64)
        st.stops[idx] = stops.to(dev)
        st.active[idx] = True
        st.done[idx] = False

    # ------------------------------------------------------------------ decode
    def _step(self, b: int, variant: tuple[int, bool], key_len: int | None = None) -> None:
        """One decode step over slots ``0 .. b-1`` (the body of a captured graph). ``variant``: ``(k_cap,
        top_p on)``; ``key_len``: keys read by torch attention (``None``: the whole slot)."""
        st, cache = self.state, self.cache
        live = st.active[:b] & ~st.done[:b]
        pos = st.pos[:b]
        scratch = cache.length - 1
        write_pos = torch.where(live, pos, torch.full_like(pos, scratch))
        n_keys = torch.where(live, pos + 1, torch.ones_like(pos))
        slots = torch.arange(b, device=self.device)
        attend = self._decode_attend(b, slots, n_keys, key_len)
        logits = self.decoder.forward(st.ids[:b], pos, write_pos, slots, cache, attend, dense_moe=self.cuda_graphs)
        k_cap, use_top_p = variant
        ids, lp = sample_tokens(logits, st.temp[:b], st.key[:b], st.n_gen[:b],
                                top_k=st.top_k[:b] if k_cap else None, top_p=st.top_p[:b] if use_top_p else None,
                                k_cap=k_cap)
        st.out_tok[:, :b].index_copy_(0, st.t, ids[None])
        st.out_lp[:, :b].index_copy_(0, st.t, lp[None])
        st.out_live[:, :b].index_copy_(0, st.t, live[None])
        st.ids[:b] = torch.where(live, ids, st.ids[:b])
        step = live.to(torch.int64)
        st.pos[:b] += step
        st.n_gen[:b] += step
        stop_hit = (ids[:, None] == st.stops[:b]).any(-1)
        finished = stop_hit | (st.n_gen[:b] >= st.max_new[:b]) | (st.pos[:b] >= scratch)
        st.done[:b] |= live & finished
        st.t += 1

    def _decode_attend(self, b: int, slots: torch.Tensor, n_keys: torch.Tensor, key_len: int | None):
        if isinstance(self.attention, KernelAttention):
            cu = KernelAttention.bounds(slots, torch.ones_like(slots), n_keys, self.cache.length)

            def attend(layer, q, sinks, window, scale):
                return self.attention(layer, q, cu, 1, sinks=sinks, window=window, scale=scale)

            return attend
        length = key_len if key_len is not None else self.cache.length

        def attend(layer, q, sinks, window, scale):
            return self.attention.decode(layer, q, b, n_keys, length, sinks=sinks, window=window, scale=scale)

        return attend

    def _graph(self, b: int, variant: tuple[int, bool]) -> torch.cuda.CUDAGraph:
        key = (b, *variant)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        saved = self.state.snapshot()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles Triton kernels, settles allocations; the state is restored after
                self._step(b, variant)
                self.state.restore(saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(b, variant)
        self._pool = graph.pool()
        self.state.restore(saved)
        self._graphs[key] = graph
        return graph

    @staticmethod
    def bucket(highest_slot: int) -> int:
        """The smallest bucket covering slots ``0 .. highest_slot``."""
        need = highest_slot + 1
        return next((b for b in BUCKETS if b >= need), need)

    @torch.no_grad()
    def decode(self, bucket: int, steps: int, variant: tuple[int, bool], max_position: int) -> ChunkOutput:
        """Run ``steps`` decode steps over slots ``0 .. bucket-1`` and copy the outputs to the host.
        ``max_position``: the largest position a live row feeds at the first step (sizes the keys torch
        attention reads when steps are not captured). Raises :class:`EngineAborted` once :attr:`aborted` is set."""
        st = self.state
        steps = min(steps, st.steps)
        bucket = min(bucket, self.cache.slots)
        st.t.zero_()
        graph = self._graph(bucket, variant) if self.cuda_graphs else None
        for i in range(steps):
            if self.aborted.is_set():
                raise EngineAborted("generation aborted: the engine is shutting down")
            if graph is not None:
                graph.replay()
            else:
                self._step(bucket, variant, key_len=min(self.cache.length, max_position + i + 1))
        tok = st.out_tok[:steps, :bucket].t().to("cpu")
        lp = st.out_lp[:steps, :bucket].t().to("cpu")
        live = st.out_live[:steps, :bucket].t().to("cpu")
        return ChunkOutput(tok.tolist(), lp.tolist(), live.tolist())
