"""The continuous-batching scheduler on a context-hash model: rows never mix, no token is dropped.

``ContextModel`` is a complete runner (the interface of ``agentrl.engines.decode.runner.ModelRunner``) whose cache
holds token ids instead of keys and values, and whose next token is a hash of everything its slot holds
up to the fed position (plus the request key and token index when sampling). Any bookkeeping error of the
scheduler (a row reading another slot, a prefix copied short or from the wrong slot, a turn resumed on the
wrong slot, a token lost between chunks, a stop missed) changes the tokens, so each job's output is
compared with the same job generated alone. The same checks with a real model are in
``tests/test_engine_decode.py``.
"""

from __future__ import annotations

import random

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.engines.decode.runner import ChunkOutput, ModelRunner, RowSampling
from agentrl.engines.decode.scheduler import Job, Scheduler

VOCAB = 40


def next_token(context: list[int], sampling: RowSampling, counter: int) -> int:
    if sampling.temperature <= 0:
        return hash(tuple(context)) % VOCAB
    return hash((tuple(context), sampling.key, counter)) % VOCAB


def solo(prompt: list[int], sampling: RowSampling) -> list[int]:
    """The tokens a job must get: generated alone, from its prompt."""
    context, out = list(prompt), []
    while True:
        token = next_token(context, sampling, len(out))
        out.append(token)
        context.append(token)
        if token in sampling.stop_ids or len(out) >= sampling.max_new_tokens:
            return out


class ContextModel:
    """See the module docstring. ``cache[slot][pos]`` is the token fed at ``pos`` (None: never written)."""

    records_routing = False
    bucket = staticmethod(ModelRunner.bucket)

    def __init__(self, chunk_steps: int) -> None:
        self.chunk_steps = chunk_steps
        self.cache: list[list[int | None]] = []
        self.length = 0
        self.rows: dict[int, dict] = {}
        self.prefilled_tokens = 0
        self.copies: list[tuple[int, int, int]] = []
        self.released = 0
        self.weights_changed = False

    @property
    def slots(self) -> int:
        return len(self.cache)

    def check_weights(self) -> bool:
        changed, self.weights_changed = self.weights_changed, False
        return changed

    def reserve(self, slots: int, length: int, stops: int = 1) -> None:
        self.length = max(self.length, length)
        for row in self.cache:
            row.extend([None] * (self.length - len(row)))
        while len(self.cache) < slots:
            self.cache.append([None] * self.length)

    def release(self) -> None:
        self.cache, self.length, self.rows = [], 0, {}
        self.released += 1

    def copy_prefix(self, pairs: list[tuple[int, int, int]]) -> None:
        for src, dst, n in pairs:
            assert all(t is not None for t in self.cache[src][:n]), "copied a prefix that was never written"
            self.cache[dst][:n] = self.cache[src][:n]
            self.copies.append((src, dst, n))

    def _context(self, slot: int, upto: int) -> list[int]:
        context = self.cache[slot][:upto]
        assert all(t is not None for t in context), f"slot {slot} read an unwritten position"
        return context

    def prefill(self, rows):
        slots = [r.slot for r in rows]
        assert slots == sorted(slots) and len(set(slots)) == len(slots)
        ids = []
        for row in rows:
            end = row.start + len(row.tokens)
            assert end < self.length, "prefill past the usable positions"
            self.cache[row.slot][row.start : end] = row.tokens
            self.prefilled_tokens += len(row.tokens)
            ids.append(next_token(self._context(row.slot, end), row.sampling, 0))
        return ids, [-float(i) for i in ids]

    def set_rows(self, rows, inactive) -> None:
        for slot in inactive:
            self.rows.pop(slot, None)
        for r in rows:
            self.rows[r.slot] = {"token": r.token, "pos": r.position, "n": r.produced, "s": r.sampling, "done": False}

    def decode(self, bucket: int, steps: int, variant, max_position: int) -> ChunkOutput:
        assert all(slot < bucket for slot in self.rows), "a live row is outside the decoded bucket"
        out = ChunkOutput([[0] * steps for _ in range(bucket)], [[0.0] * steps for _ in range(bucket)],
                          [[False] * steps for _ in range(bucket)])
        for i in range(steps):
            for slot, row in self.rows.items():
                if row["done"]:
                    continue
                self.cache[slot][row["pos"]] = row["token"]
                token = next_token(self._context(slot, row["pos"] + 1), row["s"], row["n"])
                out.tokens[slot][i], out.logprobs[slot][i], out.live[slot][i] = token, -float(token), True
                row["token"], row["pos"], row["n"] = token, row["pos"] + 1, row["n"] + 1
                s = row["s"]
                row["done"] = token in s.stop_ids or row["n"] >= s.max_new_tokens or row["pos"] >= self.length - 1
        return out


def _sampling(rng: random.Random, key: int) -> RowSampling:
    stops = tuple(sorted(rng.sample(range(VOCAB), rng.choice([0, 1, 2]))))
    return RowSampling(rng.randint(1, 12), rng.choice([0.0, 1.0]), 0, 1.0, key, stops)


def _drive(scheduler: Scheduler, arrivals: dict[int, list[Job]], follow_ups, max_steps: int = 10_000) -> list[Job]:
    """Submit ``arrivals[step]`` before each step; ``follow_ups(job)`` may return a next-turn job that is
    submitted when ``job`` finishes (an episode's next turn). Returns every finished job."""
    done: list[Job] = []
    step = 0
    while scheduler.has_work() or any(s >= step for s in arrivals):
        for job in arrivals.pop(step, []):
            scheduler.submit(job)
        _, finished = scheduler.step()
        for job in finished:
            done.append(job)
            nxt = follow_ups(job)
            if nxt is not None:
                arrivals.setdefault(step + 1 + nxt[0], []).append(nxt[1])
        step += 1
        assert step < max_steps
    return done


@settings(max_examples=examples(80))
@given(seed=st.integers(0, 10_000), max_rows=st.sampled_from([1, 1, 2, 3, 6]), extra_slots=st.sampled_from([0, 0, 1, 4]),
       chunk=st.integers(1, 5), share=st.booleans(), canonical=st.booleans())
def test_random_arrivals_never_mix_rows_or_drop_tokens(seed, max_rows, extra_slots, chunk, share, canonical):
    rng = random.Random(seed)
    model = ContextModel(chunk)
    scheduler = Scheduler(model, max_rows=max_rows, max_slots=max_rows + extra_slots, chunk_steps=chunk,
                          share_prefix=share, canonical_order=canonical)
    system = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 5, 20, 20, 40]))]
    arrivals: dict[int, list[Job]] = {}
    turns_left: dict[int, int] = {}
    for episode in range(rng.randint(1, 12)):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 25))]
        job = Job(prompt, _sampling(rng, episode), order=(episode, 9), tag=episode)
        arrivals.setdefault(rng.randint(0, 15), []).append(job)
        turns_left[episode] = rng.randint(0, 3)

    def follow_up(job: Job):
        if turns_left[job.tag] == 0:
            return None
        turns_left[job.tag] -= 1
        observation = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        nxt = Job(job.prompt + job.tokens + observation, _sampling(rng, job.tag * 100 + turns_left[job.tag]),
                  order=(job.tag, turns_left[job.tag]), tag=job.tag)
        return rng.randint(0, 4), nxt

    finished = _drive(scheduler, arrivals, follow_up)
    assert finished and not scheduler.running and not scheduler.queue
    for job in finished:
        assert job.tokens == solo(job.prompt, job.sampling), f"job {job.tag} got tokens of another context"
        assert job.logprobs == [-float(t) for t in job.tokens]
        stopped = job.tokens[-1] in job.sampling.stop_ids
        assert job.finish == ("stop" if stopped else "length")
        assert len(job.tokens) <= job.sampling.max_new_tokens


def test_next_turn_resumes_its_slot_and_prefills_only_the_new_tokens():
    model = ContextModel(4)
    scheduler = Scheduler(model, max_rows=2, max_slots=4, chunk_steps=4)
    greedy = RowSampling(6, 0.0, 0, 1.0, 1, ())
    first = Job(list(range(30)), greedy)
    [first_done] = _drive(scheduler, {0: [first]}, lambda j: None)
    before = model.prefilled_tokens
    second = Job(first.prompt + first.tokens + [7, 8, 9], greedy)
    _drive(scheduler, {0: [second]}, lambda j: None)
    assert second.slot == first.slot and not model.copies
    assert model.prefilled_tokens - before == 1 + 3  # the last sampled token of turn 1 and the observation
    assert second.tokens == solo(second.prompt, greedy)


def test_shared_prompts_are_prefilled_once_and_copied():
    model = ContextModel(2)
    scheduler = Scheduler(model, max_rows=8, max_slots=8, chunk_steps=2)
    prompt = list(range(1, 50))
    jobs = [Job(list(prompt), RowSampling(3, 1.0, 0, 1.0, k, ()), order=k) for k in range(4)]
    _drive(scheduler, {0: list(jobs)}, lambda j: None)
    assert model.prefilled_tokens == len(prompt) + 3  # one full prefill, then one token per copy
    assert sorted(n for _, _, n in model.copies) == [len(prompt) - 1] * 3
    for job in jobs:
        assert job.tokens == solo(prompt, job.sampling)


def test_idle_slots_are_evicted_least_recently_used_first():
    model = ContextModel(1)
    scheduler = Scheduler(model, max_rows=1, max_slots=2, chunk_steps=1, share_prefix=True)
    greedy = RowSampling(2, 0.0, 0, 1.0, 0, ())
    a, b, c = (Job([base + i for i in range(20)], greedy) for base in (0, 100, 200))
    for job in (a, b, c):
        _drive(scheduler, {0: [job]}, lambda j: None)
    assert c.slot == a.slot  # a was the least recently used idle slot
    assert scheduler.slots[b.slot].tokens == b.fed


def test_a_lone_idle_slot_sharing_a_prefix_is_taken_over():
    model = ContextModel(2)
    scheduler = Scheduler(model, max_rows=1, max_slots=1, chunk_steps=2)
    greedy = RowSampling(3, 0.0, 0, 1.0, 0, ())
    system = list(range(1, 33))
    a, b = Job(system + [40, 41], greedy), Job(system + [50], greedy)
    _drive(scheduler, {0: [a], 3: [b]}, lambda j: None)
    assert a.slot == b.slot == 0 and b.tokens == solo(b.prompt, greedy)
    assert model.prefilled_tokens == len(a.prompt) + 1  # b reused the 32 shared tokens in place


def test_finished_owners_slots_are_reused_before_the_cache_grows():
    model = ContextModel(2)
    scheduler = Scheduler(model, max_rows=2, max_slots=4, chunk_steps=2)
    greedy = RowSampling(2, 0.0, 0, 1.0, 0, ())
    a, b = Job(list(range(20)), greedy, owner="a"), Job(list(range(100, 120)), greedy, owner="b")
    _drive(scheduler, {0: [a, b]}, lambda j: None)
    scheduler.owner_done("a")
    c = Job(list(range(200, 220)), greedy, owner="c")
    _drive(scheduler, {0: [c]}, lambda j: None)
    assert c.slot == a.slot and model.slots == 2  # a's slot, not a new one
    assert scheduler.slots[b.slot].tokens == b.fed  # b may still continue


def test_changed_weights_drop_the_cached_sequences():
    model = ContextModel(2)
    scheduler = Scheduler(model, max_rows=2, max_slots=2, chunk_steps=2)
    greedy = RowSampling(3, 0.0, 0, 1.0, 0, ())
    first = Job(list(range(30)), greedy)
    _drive(scheduler, {0: [first]}, lambda j: None)
    model.weights_changed = True
    before = model.prefilled_tokens
    again = Job(first.prompt + first.tokens, greedy)
    _drive(scheduler, {0: [again]}, lambda j: None)
    assert model.prefilled_tokens - before == len(again.prompt)  # nothing reused


def test_release_forgets_cached_sequences():
    model = ContextModel(2)
    scheduler = Scheduler(model, max_rows=2, max_slots=2, chunk_steps=2)
    job = Job(list(range(20)), RowSampling(3, 0.0, 0, 1.0, 0, ()))
    _drive(scheduler, {0: [job]}, lambda j: None)
    scheduler.release()
    assert model.released == 1 and model.slots == 0 and not scheduler.slots
    again = Job(job.prompt + job.tokens, RowSampling(3, 0.0, 0, 1.0, 0, ()))
    _drive(scheduler, {0: [again]}, lambda j: None)
    assert again.tokens == solo(again.prompt, again.sampling)


def test_canonical_order_admits_by_key_not_by_arrival():
    orders = []
    for arrival in ([2, 0, 1], [1, 2, 0]):
        model = ContextModel(1)
        scheduler = Scheduler(model, max_rows=1, max_slots=1, chunk_steps=1, canonical_order=True)
        jobs = {k: Job([k + 1] * 3, RowSampling(1, 0.0, 0, 1.0, k, ()), order=k) for k in range(3)}
        for k in arrival:
            scheduler.submit(jobs[k])
        seen = []
        while scheduler.has_work():
            _, finished = scheduler.step()
            seen += [j.order for j in finished]
        orders.append(seen)
    assert orders == [[0, 1, 2], [0, 1, 2]]


def test_bad_construction():
    with pytest.raises(ValueError, match="max_rows"):
        Scheduler(ContextModel(1), max_rows=0, max_slots=1, chunk_steps=1)
