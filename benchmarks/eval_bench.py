"""Eval throughput at concurrency 1 vs 32 against a real local OpenAI-compatible HTTP endpoint.

The endpoint is ``agentrl serve``'s app (uvicorn, in a child process) over a scripted model that answers
every request after a fixed 50 ms delay, standing in for a served model's latency. Episodes are
multi-turn retool episodes on GSM8K test questions: the scripted model runs the solution's calculator
steps with the ``python`` tool in the local sandbox (bubblewrap, one stateful session per episode), one
call per step (up to two), then gives the boxed answer. Every episode is checked to be correct, so the
tool calls really ran.

    python benchmarks/eval_bench.py [--episodes-c1 24] [--episodes-c32 384] [--delay 0.05] [--processes 1]

``--processes P`` runs the concurrency-32 eval as P client processes (``agentrl eval processes=P``).

Prints detail lines, then last: ``eval: episodes_per_s_c1=<n> episodes_per_s_c32=<n> speedup=<n>``.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.data import dataset_path  # noqa: E402

DATA = dataset_path("gsm8k")  # GSM8K test split shipped with agentrl
STEP = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
TOOL_RESULT = re.compile(
    r"<\|start\|>functions\.python to=assistant<\|channel\|>commentary<\|message\|>(.*?)<\|end\|>", re.S
)


def load_items(limit: int) -> list[dict]:
    """GSM8K test items whose solution has 1+ calculator steps and whose last step gives the answer."""
    from agentrl.envs.tasks import load_gsm8k

    items = []
    for t in load_gsm8k(DATA):
        steps = STEP.findall(t["solution"])
        if (
            steps
            and steps[-1][1].strip() == t["answer"]
            and all(re.fullmatch(r"[\d+\-*/(). ]+", e) for e, _ in steps)
        ):
            items.append(
                {"id": t["id"], "problem": t["prompt"], "answer": t["answer"], "steps": [e for e, _ in steps]}
            )
        if len(items) == limit:
            break
    return items


def make_policy(items: list[dict]):
    """python call(s) running the calculator steps (the last one in a second call), then the answer."""
    from agentrl.harmony import Message

    by_question = {it["problem"]: it["steps"] for it in items}

    def policy(prompt: str, sampling) -> list[Message]:
        question = re.findall(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", prompt, re.S)[-1]
        steps, results = by_question[question], TOOL_RESULT.findall(prompt)
        calls = [steps[:-1], steps[-1:]] if len(steps) > 1 else [steps]
        if len(results) < len(calls):
            part = calls[len(results)]
            offset = 0 if len(results) == 0 else len(calls[0])
            code = (
                "\n".join(f"s{offset + i} = {e}" for i, e in enumerate(part))
                + f"\nprint(s{offset + len(part) - 1})"
            )
            return [
                Message(
                    "assistant",
                    json.dumps({"code": code}),
                    channel="commentary",
                    recipient="functions.python",
                    content_type="json",
                )
            ]
        value = float(results[-1].strip())
        answer = int(value) if value.is_integer() else value
        return [Message("assistant", f"The answer is \\boxed{{{answer}}}.", channel="final")]

    return policy


def serve(items_path: str, port_file: str, delay: float) -> None:
    """Child process: serve the scripted model until killed."""
    import uvicorn

    from agentrl.engines.server import create_app
    from agentrl.harmony import HarmonyFormat

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _scripted_engine import ScriptedEngine  # a test helper: the scripted model is not part of agentrl

    fmt = HarmonyFormat()
    items = json.loads(Path(items_path).read_text())
    app = create_app(ScriptedEngine(fmt, make_policy(items), delay_s=delay), fmt, model_name="scripted-50ms")
    # IPPROTO_TCP so that asyncio sets TCP_NODELAY on accepted connections
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    Path(port_file).write_text(str(sock.getsockname()[1]))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


async def measure(url: str, tasks: Path, n_items: int, concurrency: int, out: Path, processes: int) -> dict:
    from agentrl.evaluation import EvalConfig, Evaluation

    cfg = EvalConfig(
        env="retool",
        model=url,
        tasks=str(tasks),
        limit=n_items,
        n=1,
        concurrency=concurrency,
        processes=processes,
        temperature=0.0,
        out=str(out),
    )
    return await Evaluation(cfg).run()


async def bench(args, url: str, tasks: Path, work: Path) -> None:
    results = {}
    for c, n, procs in ((1, args.episodes_c1, 1), (32, args.episodes_c32, args.processes)):
        m = await measure(url, tasks, n, c, work / f"c{c}", procs)
        run = m["run"]
        assert run["episodes_failed"] == 0 and m["pass@1"] == 1.0, (run, m["pass@1"])
        results[c] = run["episodes_per_s"]
        print(
            f"concurrency={c} ({procs} client process{'es' if procs > 1 else ''}): {run['episodes_run']} episodes "
            f"in {run['episodes_wall_s']:.2f} s, {m['tool_calls_per_episode']:.2f} python calls and "
            f"{m['requests_per_episode']:.2f} model requests per episode, p50 latency "
            f"{m['latency_s_p50'] * 1000:.0f} ms, pass@1 {m['pass@1']:.3f}"
        )
    print(
        f"eval: episodes_per_s_c1={results[1]:.2f} episodes_per_s_c32={results[32]:.2f} "
        f"speedup={results[32] / results[1]:.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes-c1", type=int, default=24)
    ap.add_argument("--episodes-c32", type=int, default=384)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--processes", type=int, default=1, help="client processes at concurrency 32")
    ap.add_argument("--serve", nargs=2, metavar=("ITEMS_JSON", "PORT_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.delay)
        return 0
    if not DATA.exists():
        print(f"eval_bench: {DATA} not found", file=sys.stderr)
        return 1
    items = load_items(max(args.episodes_c1, args.episodes_c32))
    with tempfile.TemporaryDirectory(prefix="eval-bench-") as tmp:
        work = Path(tmp)
        (work / "items.json").write_text(json.dumps(items))
        tasks = work / "tasks.jsonl"
        tasks.write_text(
            "".join(json.dumps({k: it[k] for k in ("id", "problem", "answer")}) + "\n" for it in items)
        )
        port_file = work / "port"
        server = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--delay",
                str(args.delay),
                "--serve",
                str(work / "items.json"),
                str(port_file),
            ]
        )
        try:
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the scripted model server did not start")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text()}/v1"
            import httpx

            while True:  # wait until it answers
                try:
                    httpx.get(f"{url}/models", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            print(
                f"{len(items)} GSM8K items, scripted model at {url} answering after {args.delay * 1000:.0f} ms"
            )
            from agentrl.evaluation.runner import run_async

            run_async(bench(args, url, tasks, work))
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
