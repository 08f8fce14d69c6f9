"""How fast `agentrl serve model` stops on SIGTERM with a generation in flight, against an older agentrl.

    python benchmarks/serve_shutdown_bench.py --baseline 6abf408   # a commit of this repo (git archive)

Both servers load tiny-gpt-oss, get one /v1/completions request for 100,000 tokens, and receive SIGTERM 2 s
later; the time from the signal to the process exit is measured (a server still alive after --limit-s is
killed and counted as that limit). Prints one summary line last.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_time(root: Path, limit_s: float) -> float:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, "-m", "agentrl.cli", "serve", "model", "model=tiny-gpt-oss", f"port={port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    body = {"prompt": [1, 2, 3], "max_tokens": 100_000, "stop_token_ids": [-1]}

    def request() -> None:
        try:
            httpx.post(f"{url}/completions", json=body, timeout=limit_s + 60)
        except httpx.HTTPError:
            pass

    threading.Thread(target=request, daemon=True).start()
    time.sleep(2.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=limit_s)
        return time.monotonic() - t0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return limit_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="6abf408", help="commit of this repo to compare against")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--limit-s", type=float, default=120.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "agentrl"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        old, new = [], []
        for _ in range(args.repeats):
            old.append(stop_time(Path(tmp), args.limit_s))
            new.append(stop_time(REPO, args.limit_s))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"baseline {args.baseline}: {[round(x, 2) for x in old]} s; this tree: {[round(x, 2) for x in new]} s")
    capped = " (killed at the limit)" if med(old) >= args.limit_s else ""
    print(f"serve model SIGTERM stop with a generation in flight: {med(new):.2f} s vs {med(old):.2f} s{capped} "
          f"at {args.baseline}, {med(old) / med(new):.0f}x faster")


if __name__ == "__main__":
    main()
