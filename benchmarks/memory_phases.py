"""Peak memory per phase of one ``agentrl`` command, measured inside the process that runs it.

    python benchmarks/memory_phases.py OUT.json -- train env=retool eval.num_tasks=16 trainer.total_steps=1

runs ``agentrl <args>`` in this process (import path: whatever ``PYTHONPATH`` puts first, so the same
script measures any checkout) with the trainer's phases wrapped:

- ``model load``: ``agentrl.models.loading.load_model`` (GGUF de-quantisation for SmolLM2);
- ``evaluation``: ``Trainer.evaluate`` (its rollouts included);
- ``sft data`` / ``sft``: ``agentrl.train.sft.prepare_data`` / ``Trainer.cold_start`` or ``stages.sft_stage``
  (the SFT steps);
- ``rollout`` / ``update``: the RL step's rollout and ``run_update``;
- ``checkpoint``: ``Trainer.save`` or ``Checkpoints.save``; ``other``: everything else (imports, engine and env
  setup, summaries).

What "peak" is: the kernel's resident-set high-water mark of this process (``VmHWM``), read and reset
(``/proc/self/clear_refs`` = 5) at every phase boundary, so each phase's figure is the exact peak RSS
reached while it ran (no sampling gaps). Child processes (sandbox workers, forked tool calls) are sampled
every 0.5 s: ``children_gb`` is the largest sum of their RSS seen during the phase. Phases that do not exist in
a checkout (renamed functions) are skipped, so one script measures old and new code alike. ``MALLOC_*``
environment variables apply as usual.

At the end of each phase it also records the RSS then (``rss_at_end_gb``) and glibc's ``malloc_stats()``
(``malloc_system_gb``: memory malloc holds; ``malloc_in_use_gb``: of which live allocations): a large gap is
freed memory the allocator keeps (fragmentation), not memory the phase needs. GB here are GiB (2**30 bytes).

Each phase also gets ``cpu_s``: this process's CPU seconds (all its threads, ``time.process_time``) while it
ran, a figure that a loaded machine inflates far less than wall time.

Writes ``OUT.json``: ``{"phases": {name: {"peak_rss_gb", "children_gb", "seconds", "cpu_s", "entries", "rss_at_end_gb",
"malloc_system_gb", "malloc_in_use_gb", "malloc_arenas"}}, "peak_rss_gb": <whole run>, "exit_code": <the
command's>}``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import re
import resource
import sys
import tempfile
import threading
import time
from typing import Any

_GB = 2**30


def _status_kb(field: str, pid: str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def malloc_stats() -> dict[str, float]:
    """glibc's own account of this process's heap, from ``malloc_stats()`` (written to fd 2, captured here):
    ``malloc_system_gb`` (memory malloc holds from the system, arenas and mmaps), ``malloc_in_use_gb`` (of which
    live allocations) and ``malloc_arenas``. The difference is freed memory malloc keeps (fragmentation, caching).
    Empty where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return {}
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            libc.malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    total = text.split("Total (incl. mmap):")[-1]
    values = dict(re.findall(r"(system bytes|in use bytes)\s*=\s*(\d+)", total))
    if len(values) < 2:
        return {}
    return {
        "malloc_system_gb": int(values["system bytes"]) / _GB,
        "malloc_in_use_gb": int(values["in use bytes"]) / _GB,
        "malloc_arenas": float(text.count("Arena ")),
    }


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of ``pid`` (from /proc/*/stat parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class PhaseRecorder:
    """Attributes this process's peak RSS, and its children's summed RSS, to nested named phases."""

    def __init__(self) -> None:
        self.stack: list[str] = ["other"]
        self.phases: dict[str, dict[str, float]] = {}
        self.lock = threading.Lock()
        self.since = time.perf_counter()
        self.cpu_since = time.process_time()
        self.can_reset = self._reset()
        self.stop = threading.Event()
        threading.Thread(target=self._sample_children, daemon=True).start()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _entry(self, name: str) -> dict[str, float]:
        return self.phases.setdefault(name, {"peak_rss_gb": 0.0, "children_gb": 0.0, "seconds": 0.0, "cpu_s": 0.0,
                                                 "entries": 0})

    def _close_segment(self) -> None:
        """Charge the segment since the last boundary to the phase on top of the stack."""
        now = time.perf_counter()
        entry = self._entry(self.stack[-1])
        entry["peak_rss_gb"] = max(entry["peak_rss_gb"], _status_kb("VmHWM") * 1024 / _GB)
        entry["seconds"] += now - self.since
        cpu = time.process_time()
        entry["cpu_s"] += cpu - self.cpu_since
        self.since, self.cpu_since = now, cpu
        if self.can_reset:
            self._reset()

    def push(self, name: str) -> None:
        with self.lock:
            self._close_segment()
            self.stack.append(name)
            self._entry(name)["entries"] += 1

    def pop(self) -> None:
        with self.lock:
            self._close_segment()
            entry = self._entry(self.stack.pop())
            entry["rss_at_end_gb"] = _status_kb("VmRSS") * 1024 / _GB
            entry.update(malloc_stats())

    def _sample_children(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.5):
            total = sum(_status_kb("VmRSS", str(p)) for p in descendants(me)) * 1024 / _GB
            with self.lock:
                entry = self._entry(self.stack[-1])
                entry["children_gb"] = max(entry["children_gb"], total)

    def report(self) -> dict[str, Any]:
        self.stop.set()
        with self.lock:
            self._close_segment()
        # with resets, ru_maxrss only covers the time since the last one: the run's peak is the largest phase's
        whole = max((e["peak_rss_gb"] for e in self.phases.values()), default=0.0)
        if not self.can_reset:
            whole = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return {
            "phases": {k: {m: round(v, 3) for m, v in e.items()} for k, e in self.phases.items()},
            "peak_rss_gb": round(whole, 3),
            "hwm_reset": self.can_reset,
        }


def _wrap(recorder: PhaseRecorder, fn: Any, name: str, skip_inside: tuple[str, ...] = ()) -> Any:
    """``fn`` (sync or async) recording ``name`` while it runs (not when called inside ``skip_inside``)."""
    import inspect

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            if recorder.stack[-1] in skip_inside:
                return await fn(*args, **kwargs)
            recorder.push(name)
            try:
                return await fn(*args, **kwargs)
            finally:
                recorder.pop()
        return awrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if recorder.stack[-1] in skip_inside:
            return fn(*args, **kwargs)
        recorder.push(name)
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.pop()
    return wrapper


#: (module, attribute path, phase name, phases inside which it is not a phase of its own)
TARGETS = [
    ("agentrl.models.loading", "load_model", "model load", ("model load",)),
    ("agentrl.train.trainer", "load_model", "model load", ("model load",)),
    ("agentrl.engines.server", "load_model", "model load", ("model load",)),
    ("agentrl.train.trainer", "Trainer.evaluate", "evaluation", ()),
    ("agentrl.train.sft", "prepare_data", "sft data", ()),
    ("agentrl.train.trainer", "Trainer.cold_start", "sft", ()),
    ("agentrl.train.trainer", "rollout", "rollout", ("evaluation",)),
    ("agentrl.train.trainer", "update_policy", "update", ()),
    ("agentrl.train.trainer", "Trainer.save", "checkpoint", ()),
    # the trainer split into stages (agentrl.train.actor, stages, resume): the same phases
    ("agentrl.train.actor", "load_model", "model load", ("model load",)),
    ("agentrl.train.stages", "sft_stage", "sft", ()),
    ("agentrl.train.trainer", "run_update", "update", ()),
    ("agentrl.train.resume", "Checkpoints.save", "checkpoint", ()),
]


def instrument(recorder: PhaseRecorder) -> list[str]:
    """Wrap every target that exists; returns the ones wrapped."""
    done = []
    for module_name, path, name, skip in TARGETS:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue
        setattr(owner, attr, _wrap(recorder, getattr(owner, attr), name, skip))
        done.append(f"{module_name}.{path}")
    return done


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python benchmarks/memory_phases.py OUT.json -- <agentrl command and key=value args>", file=sys.stderr)
        return 2
    out, command = argv[0], argv[2:]
    recorder = PhaseRecorder()
    wrapped = instrument(recorder)
    from agentrl.cli import main as agentrl_main

    code = 1
    try:
        code = agentrl_main(command)
    finally:
        report = recorder.report()
        report.update(exit_code=code, command=command, wrapped=wrapped)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
