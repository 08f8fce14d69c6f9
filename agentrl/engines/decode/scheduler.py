"""Continuous batching on the host: which request runs in which cache slot, and when.

The :class:`Scheduler` is device-agnostic: it drives any runner with :class:`~agentrl.engines.decode.runner.ModelRunner`'s
interface and keeps only Python state, so its logic runs and is tested on the CPU. One :meth:`Scheduler.step`:

1. **Admit** waiting jobs while fewer than ``max_rows`` run: first come first served, or, with
   ``canonical_order``, sorted by each job's ``order`` key (batch formation then depends only on which jobs
   are waiting, not on when they arrived). A job joins as soon as a row is free; it never waits for the
   running batch to drain.
2. **Place** each admitted job in a slot, reusing cached keys where the tokens allow (:mod:`prefix_index`):

   - the next turn of an episode: the slot that holds an earlier prefix of its prompt (the previous
     turn's prompt and completion) and nothing else is taken over as it is (no copy, no recompute);
   - a shared prefix (system prompt, tool docs, a GRPO group's identical prompt): the first ``n`` cached
     positions of the slot holding the longest common prefix are copied into the job's slot, including
     from a job admitted in the same step (its prefill runs first: two prefill phases);
   - otherwise a free slot (the cache grows up to ``max_slots`` slots), else the least recently used
     idle slot is evicted, else the job waits.

   At least the prompt's last token is always prefilled (its logits give the first token).
3. **Prefill** the uncached part of each admitted prompt and sample its first token.
4. **Decode** up to ``chunk_steps`` steps of every running row on the device, then read the sampled
   tokens back; rows that hit a stop id, their token limit or the cache capacity finish.

A finished job's slot stays cached (idle) with the tokens fed so far (prompt + completion minus its last
token), for the episode's next turn or as a prefix donor, until it is evicted or the engine releases its
memory. Every choice is a function of the jobs and their order (no clocks, no randomness), so a replay
of the same submissions in the same steps gives the same slots, batches and tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.decode.prefix_index import BLOCK, PrefixIndex
from agentrl.engines.decode.runner import PrefillRow, RowSampling, RowState


@dataclass(eq=False)
class Job:
    """One prompt to complete. Filled as it runs: ``tokens``/``logprobs`` (sampled so far), ``versions`` (the
    engine's policy version per sampled token, filled by the engine after each step), ``finish`` (``"stop"`` or
    ``"length"`` once done), ``routing`` (with routing recording), ``error``."""

    prompt: list[int]
    sampling: RowSampling
    order: Any = 0
    tag: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    routing: Any = None
    error: BaseException | None = None
    slot: int | None = None
    emitted: int = 0
    owner: Any = None

    @property
    def position(self) -> int:
        """Where the last sampled token is fed next (= cached positions after prefill)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def fed(self) -> list[int]:
        """The tokens whose keys are cached: the prompt and every sampled token but the last."""
        return self.prompt + self.tokens[:-1]


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)
    job: Job | None = None
    used: int = -1
    owner: Any = None
    done: bool = False  # its owner said it will not continue: the first idle slot to evict


@dataclass
class _Plan:
    job: Job
    slot: int
    reuse: int
    copy_from: int | None
    phase: int


def _round_up(n: int, to: int) -> int:
    return int(math.ceil(n / to) * to)


class Scheduler:
    """See the module docstring.

    - ``runner``: a :class:`~agentrl.engines.decode.runner.ModelRunner` or anything with its interface.
    - ``max_rows``: most jobs decoding at once; ``max_slots``: most cache slots (>= ``max_rows``; the
      extra ones keep idle sequences for reuse).
    - ``chunk_steps``: decode steps between host reads.
    - ``share_prefix``: reuse cached prefixes (turns, shared prompts); off: every prompt is prefilled whole.
    - ``min_length``: the least slot length to allocate (positions), so that later turns rarely grow it.
    """

    def __init__(self, runner: Any, *, max_rows: int, max_slots: int, chunk_steps: int, share_prefix: bool = True,
                 canonical_order: bool = False, min_length: int = 0) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.runner = runner
        self.max_rows = max_rows
        self.max_slots = max(max_slots, max_rows)
        self.chunk_steps = max(1, chunk_steps)
        self.share_prefix = share_prefix
        self.canonical_order = canonical_order
        self.min_length = min_length
        self.incoming: deque[Job] = deque()
        self.finished_owners: deque[Any] = deque()
        self.queue: list[Job] = []
        self.running: dict[int, Job] = {}
        self.slots: list[_Slot] = []
        self.index = PrefixIndex()
        self.clock = 0
        self._deactivate: list[int] = []
        self.admissions = 0  # steps that admitted (prefilled) at least one job
        self.chunks = 0  # decode chunks run

    # ------------------------------------------------------------------ submission
    def submit(self, job: Job) -> None:
        """Queue ``job`` (safe from another thread: it is picked up at the next step)."""
        self.incoming.append(job)

    def has_work(self) -> bool:
        return bool(self.incoming or self.queue or self.running)

    def owner_done(self, owner: Any) -> None:
        """Jobs of ``owner`` (e.g. an episode) will not continue: their idle slots are evicted first (their
        tokens still serve as shared prefixes until then). Safe from another thread."""
        self.finished_owners.append(owner)

    def _drain(self) -> None:
        done = set()
        while self.finished_owners:
            done.add(self.finished_owners.popleft())
        if done:
            for slot in self.slots:
                if slot.job is None and slot.owner in done:
                    slot.done = True
        while self.incoming:
            self.queue.append(self.incoming.popleft())
        if self.canonical_order:
            self.queue.sort(key=lambda job: job.order)

    # ------------------------------------------------------------------ one step
    def step(self) -> tuple[list[Job], list[Job]]:
        """Admit, prefill, decode one chunk; returns ``(jobs that got tokens, jobs that finished)``."""
        self._drain()
        if not self.queue and not self.running:
            return [], []
        if self.runner.check_weights():  # cached keys came from other weights: forget the idle sequences
            for i, slot in enumerate(self.slots):
                if slot.job is None:
                    self.index.remove(i)
                    slot.tokens, slot.done = [], False
        plans = self._admit()
        finished: list[Job] = []
        advanced = [p.job for p in plans]
        if plans:
            self.admissions += 1
            finished += self._prefill(plans)
        if self.running:
            self.chunks += 1
            advanced += [job for job in self.running.values() if job not in advanced]
            finished += self._decode()
        return advanced, finished

    def release(self) -> None:
        """Forget every cached sequence and free the runner's memory (only between batches of work)."""
        if self.running:
            raise RuntimeError("cannot release the cache while jobs are running")
        self.runner.release()
        self.slots.clear()
        self.index.clear()
        self._deactivate.clear()

    def fail_all(self, error: BaseException) -> list[Job]:
        """Mark every queued and running job failed with ``error`` and drop the cached state; returns them."""
        jobs = list(self.running.values()) + self.queue + list(self.incoming)
        self.queue, self.running = [], {}
        self.incoming.clear()
        for job in jobs:
            job.error = error
        self.slots.clear()
        self.index.clear()
        self._deactivate.clear()
        try:
            self.runner.release()
        except Exception:  # noqa: BLE001 - the original error is what the callers need to see
            pass
        return jobs

    # ------------------------------------------------------------------ capacity
    def _ensure_capacity(self, jobs: Sequence[Job], slots: int) -> None:
        """Grow the runner to at least ``slots`` slots, the length ``jobs`` need and their stop-id count."""
        need = max((len(j.prompt) + j.sampling.max_new_tokens + 1 for j in jobs), default=0)
        length = self.runner.length
        if need > length:
            length = _round_up(max(need, self.min_length, int(length * 1.5)), 64)
        stops = max((len(j.sampling.stop_ids) for j in jobs), default=1)
        self.runner.reserve(max(slots, self.runner.slots, 1), length, stops=max(stops, 1))
        while len(self.slots) < self.runner.slots:
            self.slots.append(_Slot())

    def _initial_slots(self) -> int:
        want = min(self.max_slots, max(len(self.queue), 1))
        return min(self.max_slots, 1 << (want - 1).bit_length())

    # ------------------------------------------------------------------ admission and placement
    def _admit(self) -> list[_Plan]:
        if not self.queue or len(self.running) >= self.max_rows:
            return []
        self._ensure_capacity(self.queue, self._initial_slots() if not self.slots else self.runner.slots)
        plans: list[_Plan] = []
        pending: dict[int, int] = {}  # slot -> prefill phase of a job admitted in this step
        waiting: list[Job] = []
        for job in self.queue:
            if len(self.running) + len(plans) >= self.max_rows:
                waiting.append(job)
                continue
            plan = self._place(job, pending)
            if plan is None:
                waiting.append(job)
                continue
            plans.append(plan)
            pending[plan.slot] = plan.phase
        self.queue = waiting
        return plans

    def _place(self, job: Job, pending: dict[int, int]) -> _Plan | None:
        donor, shared = None, 0
        if self.share_prefix:
            donor, shared = self.index.best(
                job.prompt, held=lambda s: [] if pending.get(s) == 2 else self.slots[s].tokens,
                prefer=lambda s: (-self.slots[s].used,))
        reuse = min(shared, len(job.prompt) - 1)
        idle_donor = donor is not None and donor not in pending and self.slots[donor].job is None
        slot = None
        if not (idle_donor and shared == len(self.slots[donor].tokens)):  # else: the episode's next turn
            slot = self._free_slot(exclude=set(pending) | ({donor} if donor is not None else set()))
        if slot is None and idle_donor:  # take the donor over (what it held past the shared prefix is dropped)
            slot = donor
        if slot is None:
            return None
        copy_from = donor if donor is not None and donor != slot and reuse >= BLOCK else None
        if slot != donor and copy_from is None:
            reuse = 0
        phase = 2 if copy_from is not None and pending.get(copy_from) == 1 else 1
        state = self.slots[slot]
        state.tokens, state.job, state.used, state.owner, state.done = list(job.prompt), job, self._tick(), job.owner, False
        self.index.register(slot, job.prompt)
        job.slot = slot
        return _Plan(job, slot, reuse, copy_from, phase)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _free_slot(self, exclude: set[int]) -> int | None:
        """A slot for a new sequence, the lowest index first (decode batches cover slots ``0 .. highest``):
        an empty one, else an idle one whose owner is done (evicted), else a new one (growing the cache),
        else the least recently used idle one (evicted), else None."""
        for i, s in enumerate(self.slots):
            if s.job is None and (not s.tokens or s.done) and i not in exclude:
                if s.tokens:
                    self.index.remove(i)
                    s.tokens = []
                return i
        if len(self.slots) < self.max_slots:
            grown = min(self.max_slots, max(len(self.slots) * 2, 1))
            self._ensure_capacity([], grown)
            return self._free_slot(exclude)
        idle = [(s.used, i) for i, s in enumerate(self.slots) if s.job is None and i not in exclude]
        if not idle:
            return None
        _, slot = min(idle)
        self.index.remove(slot)
        self.slots[slot].tokens = []
        return slot

    # ------------------------------------------------------------------ prefill and decode
    def _prefill(self, plans: list[_Plan]) -> list[Job]:
        self._ensure_capacity([p.job for p in plans], self.runner.slots)
        first: dict[int, tuple[int, float]] = {}
        for phase in (1, 2):
            group = sorted((p for p in plans if p.phase == phase), key=lambda p: p.slot)
            if not group:
                continue
            self.runner.copy_prefix([(p.copy_from, p.slot, p.reuse) for p in group if p.copy_from is not None])
            rows = [PrefillRow(p.slot, p.reuse, p.job.prompt[p.reuse :], p.job.sampling) for p in group]
            ids, lps = self.runner.prefill(rows)
            for p, token, lp in zip(group, ids, lps, strict=True):
                first[p.slot] = (token, lp)
        finished, live = [], []
        for p in plans:
            job = p.job
            token, lp = first[p.slot]
            job.tokens.append(token)
            job.logprobs.append(lp)
            if self._finish_reason(job) is not None:
                self._finish(job, self._finish_reason(job))
                finished.append(job)
            else:
                self.running[p.slot] = job
                live.append(RowState(p.slot, token, job.position, 1, job.sampling))
        self.runner.set_rows(live, self._take_deactivated())
        return finished

    def _take_deactivated(self) -> list[int]:
        out, self._deactivate = self._deactivate, []
        return out

    def _finish_reason(self, job: Job) -> str | None:
        if job.tokens[-1] in job.sampling.stop_ids:
            return "stop"
        if len(job.tokens) >= job.sampling.max_new_tokens or job.position >= self.runner.length - 1:
            return "length"
        return None

    def _finish(self, job: Job, reason: str) -> None:
        job.finish = reason
        fed = job.fed
        if self.runner.records_routing:
            job.routing = self.runner.routing(job.slot, len(fed))
        slot = self.slots[job.slot]
        slot.tokens, slot.job, slot.used = fed, None, self._tick()
        self.index.register(job.slot, fed)
        self.running.pop(job.slot, None)
        self._deactivate.append(job.slot)

    def _decode(self) -> list[Job]:
        if self._deactivate:
            self.runner.set_rows([], self._take_deactivated())
        jobs = self.running
        bucket = self.runner.bucket(max(jobs))
        steps = min(self.chunk_steps, max(j.sampling.max_new_tokens - len(j.tokens) for j in jobs.values()))
        variant = (max(j.sampling.top_k for j in jobs.values()), any(j.sampling.top_p < 1 for j in jobs.values()))
        out = self.runner.decode(bucket, steps, variant, max(j.position for j in jobs.values()))
        finished = []
        for slot, job in list(jobs.items()):
            live = out.live[slot]
            got = sum(live)
            if got == len(live):
                job.tokens += out.tokens[slot]
                job.logprobs += out.logprobs[slot]
            else:  # live steps are a prefix: a row stops for good
                job.tokens += out.tokens[slot][:got]
                job.logprobs += out.logprobs[slot][:got]
            reason = self._finish_reason(job)
            if reason is None and got == 0:  # the device stopped a row the host still counts as running
                reason = "length"
            if reason is not None:
                self._finish(job, reason)
                finished.append(job)
        return finished
