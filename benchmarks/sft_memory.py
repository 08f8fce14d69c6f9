"""Peak RSS of ``agentrl sft data=<an eval-style run>`` for SmolLM2-135M at the default micro-batch, old code
against new (issue 27 §1).

    python benchmarks/sft_memory.py --before /tmp/agentrl-main-918ee58 [--after .]

1. Builds an eval-style run (``OUT/eval/trajectories.jsonl`` with the metadata ``agentrl eval`` writes) of
   ``--trajectories`` retool episodes of SmolLM2's chat format, played through the real env, its tokenizer
   and its local code sandbox, no network, no model: episode ``i`` first "rambles" for ``i mod
   (--max-rambles + 1)`` turns, ``--ramble-tokens`` tokens of prose each with no tool call and no end-of-turn
   token (what an untrained SmolLM2 does when ``agentrl eval``'s ``max_new_tokens`` cuts it), then the scripted
   retool teacher makes its python call and gives the boxed tool output. So the data has the long, mixed-length
   multi-turn episodes of a real eval run (the env's own parse errors and notes included), deterministically.
2. Runs ``agentrl sft data=OUT/eval steps=--steps`` in a child process once per checkout (``PYTHONPATH`` = the
   checkout; everything else at its defaults: micro-batch, batch size, the held-out evaluations before and
   after), and measures the child's peak RSS (``ru_maxrss`` from ``wait4``; sandbox workers are separate
   processes, sampled and reported apart). A child whose RSS passes ``--limit-gb`` is killed (the shared box
   must survive the old code); its figure is then a lower bound, marked ``>=``.

The data is built with the code this script imports (the "after" checkout, via ``PYTHONPATH``), so both runs
train on the same file. "before" is main's code before the fix: run it on a worktree of commit 918ee58
(``git worktree add /tmp/agentrl-main-918ee58 918ee58``). The last line is
``sft_memory: peak_rss_gb_before=<a> peak_rss_gb_after=<b> trajectories=<n> micro_batch=<m>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from memory_phases import descendants  # this directory is on sys.path when the script runs

PROSE = (
    "Let me think about this problem step by step. First I need to understand what the question asks, then I "
    "will work out the numbers carefully, checking each intermediate result before I move on to the next one. "
)


class RamblingStudent:
    """A policy: ``rambles(task_index)`` turns of ``tokens`` prose tokens without a tool call or an end-of-turn
    token, then the scripted retool teacher (python call, boxed answer)."""

    def __init__(self, teacher, rambles: dict[str, int], tokens: int, fmt) -> None:
        self.teacher, self.rambles, self.tokens = teacher, rambles, tokens
        ids = list(fmt.encode(PROSE))
        self.ramble = (ids * (tokens // len(ids) + 1))[:tokens]

    async def act(self, episode):
        if len(episode.steps) < self.rambles[episode.task["id"]]:
            return [list(self.ramble)]
        return await self.teacher.act(episode)


async def _episodes(args: argparse.Namespace):
    from agentrl.envs.builtin.retool import ReToolEnv
    from agentrl.envs.sandbox import make_backend
    from agentrl.episodes import EnvPool, EpisodeJob, collect
    from agentrl.harmony import ChatTemplateFormat
    from agentrl.models.loading import load_smollm2_tokenizer

    fmt = ChatTemplateFormat(load_smollm2_tokenizer())
    tasks = ReToolEnv.tasks(split="train", n=args.trajectories, seed=args.seed)
    for i, task in enumerate(tasks):
        task["id"] = f"task-{i}"
    rambles = {t["id"]: i % (args.max_rambles + 1) for i, t in enumerate(tasks)}
    policy = RamblingStudent(ReToolEnv.scripted_teacher(), rambles, args.ramble_tokens, fmt)
    async with make_backend("local", workers=2) as sandbox:
        pool = EnvPool(lambda: ReToolEnv(format=fmt, sandbox=sandbox), 8)
        try:
            jobs = [EpisodeJob(t, args.seed + i, t["id"]) for i, t in enumerate(tasks)]
            return await collect(pool, policy, jobs)
        finally:
            await pool.aclose()


def build_eval_run(args: argparse.Namespace, out: str) -> dict[str, float]:
    """Write the eval-style run to ``out``; returns its size statistics."""
    results = asyncio.run(_episodes(args))
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} data episodes failed, first: {failed[0]}")
    os.makedirs(out, exist_ok=True)
    lengths = []
    with open(os.path.join(out, "trajectories.jsonl"), "w", encoding="utf-8") as f:
        for r in results:
            traj = r.trajectory  # the typed fields agentrl eval sets
            traj.task_id, traj.sample, traj.env, traj.model = str(r.task_id), 0, "retool", "smollm2-135m (scripted)"
            f.write(traj.to_json() + "\n")
            lengths.append(len(traj.prompt_ids) + len(traj.response_ids))
    return {"trajectories": len(lengths), "tokens_mean": sum(lengths) / len(lengths), "tokens_max": max(lengths),
            "correct": sum(r.trajectory.correct for r in results)}


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def run_sft(checkout: str, data: str, run_dir: str, args: argparse.Namespace) -> dict[str, object]:
    """``agentrl sft`` on ``data`` with ``checkout``'s code in a child; its peak RSS and the run's micro-batch."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "agentrl.cli", "sft", f"data={data}", f"run_dir={run_dir}", f"steps={args.steps}",
           "trainer.progress=false", *args.extra]
    log = open(run_dir + ".log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    peak = {"self_kb": 0, "workers_kb": 0, "killed": False}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            mine = _rss_kb(proc.pid)
            workers = sum(_rss_kb(p) for p in descendants(proc.pid))
            peak["self_kb"], peak["workers_kb"] = max(peak["self_kb"], mine), max(peak["workers_kb"], workers)
            if mine > args.limit_gb * 2**20:
                peak["killed"] = True
                os.killpg(proc.pid, signal.SIGKILL)
                return

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    log.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    micro = None
    config = os.path.join(run_dir, "config.yaml")
    if os.path.exists(config):
        from omegaconf import OmegaConf

        micro = int(OmegaConf.load(config).sft.micro_batch_size)
    return {
        "peak_rss_gb": max(usage.ru_maxrss, peak["self_kb"]) / 2**20,
        "workers_peak_gb": peak["workers_kb"] / 2**20,
        "killed_at_limit": peak["killed"],
        "exit_code": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "micro_batch": micro,
        "log": run_dir + ".log",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="checkout of the old code (e.g. a worktree of 918ee58); omit to skip")
    parser.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--max-rambles", type=int, default=3)
    parser.add_argument("--ramble-tokens", type=int, default=384)
    parser.add_argument("--steps", type=int, default=2, help="SFT steps (the peak is reached in the first)")
    parser.add_argument("--limit-gb", type=float, default=18.0, help="kill a child whose RSS passes this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep data and runs here (default: a temporary directory)")
    parser.add_argument("extra", nargs="*", help="more key=value arguments for agentrl sft")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sft-memory-") as tmp:
        work = args.workdir or tmp
        data = os.path.join(work, "eval")
        stats = build_eval_run(args, data)
        print(f"data: {json.dumps(stats)}", flush=True)
        results = {}
        for label, checkout in (("before", args.before), ("after", args.after)):
            if checkout:
                results[label] = run_sft(checkout, data, os.path.join(work, f"sft-{label}"), args)
                print(f"{label} ({checkout}): {json.dumps(results[label])}", flush=True)
        for label, r in results.items():
            if r["exit_code"] != 0 and not r["killed_at_limit"]:
                print(f"{label}: agentrl sft failed (exit {r['exit_code']}), see {r['log']}", file=sys.stderr)
                return 1

    def figure(label: str) -> str:
        if label not in results:
            return "na"
        r = results[label]
        return (">=" if r["killed_at_limit"] else "") + f"{r['peak_rss_gb']:.2f}"

    micro = results.get("after", results.get("before", {})).get("micro_batch")
    print(f"sft_memory: peak_rss_gb_before={figure('before')} peak_rss_gb_after={figure('after')} "
          f"trajectories={stats['trajectories']} micro_batch={micro}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
