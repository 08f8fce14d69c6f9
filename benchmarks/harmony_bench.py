"""Harmony layer throughput: parse speed and the cost of appending one tool turn to a trajectory.

- ``parse_tok_per_s``: completion tokens parsed per second by ``HarmonyFormat.parse`` (a ~32k-token
  completion: long analysis, a commentary preamble and a JSON tool call), median of repeats.
- ``append_1k_us`` / ``append_32k_us``: median microseconds for one tool turn (``add_model`` of a ~70-token
  call with log-probs, then ``add_env`` of the ~40-token tool result) on a trajectory that already holds
  ~1k / ~32k response tokens. Their ratio shows whether appending is O(new tokens).

Run: ``python benchmarks/harmony_bench.py``. The last line is the summary.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

from agentrl.harmony import HarmonyFormat, Message, ToolSpec, TrajectoryBuilder

LOOKUP = ToolSpec("lookup", "Look up a fact", {"type": "object", "properties": {"q": {"type": "string"}}})


def _words(rng: random.Random, n: int) -> str:
    vocab = "the model checks each step carefully before calling a tool with arguments 42 ÷ π café".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def _builder(fmt: HarmonyFormat, history_tokens: int, rng: random.Random) -> TrajectoryBuilder:
    """A builder whose response already holds ``history_tokens`` (+-1%) ids, ready for the next completion."""
    prompt = fmt.render_prompt([Message("user", "Find the answer.")], [LOOKUP])
    call = Message(
        "assistant",
        json.dumps({"q": "x"}),
        channel="commentary",
        recipient="functions.lookup",
        content_type="json",
    )
    obs_msgs = [Message("tool", "nothing yet", name="functions.lookup")]
    n_words = history_tokens
    for _ in range(4):  # words -> tokens is not 1:1; rescale until the history has the requested size
        c = fmt.render_completion([Message("assistant", _words(rng, n_words), channel="analysis"), call])
        size = len(c) + len(fmt.render_observation(obs_msgs, completion_ids=c))
        if abs(size - history_tokens) <= history_tokens // 100:
            break
        n_words = max(1, round(n_words * history_tokens / size))
    b = TrajectoryBuilder(fmt, prompt, tools=[LOOKUP])
    b.add_model(c, [-0.1] * len(c))
    b.add_env(fmt.render_observation(obs_msgs, completion_ids=c))
    return b


def bench_parse(fmt: HarmonyFormat, rng: random.Random, repeats: int = 7) -> float:
    msgs = [
        Message("assistant", _words(rng, 27000), channel="analysis"),
        Message("assistant", _words(rng, 40), channel="commentary"),
        Message(
            "assistant",
            json.dumps({"q": _words(rng, 20)}),
            channel="commentary",
            recipient="functions.lookup",
            content_type="json",
        ),
    ]
    ids = fmt.render_completion(msgs)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        turn = fmt.parse(ids, tools=[LOOKUP])
        rates.append(len(ids) / (time.perf_counter() - t0))
        assert turn.ok and turn.tool_calls
    print(f"parse: {len(ids)} tokens, median {statistics.median(rates):,.0f} tok/s")
    return statistics.median(rates)


def bench_append(fmt: HarmonyFormat, sizes: tuple[int, ...], rng: random.Random, n: int = 80) -> list[float]:
    """Median microseconds per tool turn for each history size; sizes are timed interleaved so load changes
    on the machine hit them alike."""
    pools = {s: [_builder(fmt, s, rng) for _ in range(n)] for s in sizes}
    call = Message(
        "assistant",
        json.dumps({"q": _words(rng, 12)}),
        channel="commentary",
        recipient="functions.lookup",
        content_type="json",
    )
    completion = fmt.render_completion([Message("assistant", _words(rng, 40), channel="analysis"), call])
    logprobs = [-0.5] * len(completion)
    obs = fmt.render_observation(
        [Message("tool", _words(rng, 30), name="functions.lookup")], completion_ids=completion
    )
    times: dict[int, list[float]] = {s: [] for s in sizes}
    gc.collect()
    gc.disable()
    try:
        for i in range(n):
            for s in sizes:
                b = pools[s][i]
                t0 = time.perf_counter()
                b.add_model(completion, logprobs)
                b.add_env(obs)
                times[s].append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.enable()
    out = []
    for s in sizes:
        hist = statistics.median(
            len(b.trajectory.response_ids) - len(completion) - len(obs) for b in pools[s]
        )
        us = statistics.median(times[s])
        print(
            f"append: history {hist:.0f} tokens, turn {len(completion)}+{len(obs)} tokens, median {us:.1f} us"
        )
        out.append(us)
    return out


def main() -> None:
    fmt = HarmonyFormat()
    rng = random.Random(0)
    parse_rate = bench_parse(fmt, rng)
    a1, a32 = bench_append(fmt, (1000, 32000), rng)
    print(f"append_32k_us / append_1k_us = {a32 / a1:.2f}")
    print(f"harmony: parse_tok_per_s={parse_rate:.0f} append_1k_us={a1:.1f} append_32k_us={a32:.1f}")


if __name__ == "__main__":
    main()
