"""agentrl.cpu_threads: the thread settings the ``agentrl`` command makes before torch loads (the CPU cost
under contention is measured by ``benchmarks/contention_bench.py``, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl
from agentrl import cpu_threads

REPO = str(Path(agentrl.__file__).parent.parent)


def _python(code: str, env: dict[str, str], tmp_path: Path) -> dict:
    """Run ``code`` in a fresh interpreter (torch not yet imported) and return the JSON it prints."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    base["PYTHONPATH"] = os.pathsep.join([str(tmp_path), REPO])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **env}, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env, expected", [
    ({}, {"policy": None, "spin": "30000"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"policy": "PASSIVE", "spin": None}),  # the user's choice stays
    ({"GOMP_SPINCOUNT": "300000"}, {"policy": None, "spin": "300000"}),  # the user's spin count stays
])
def test_the_command_sets_the_wait_policy_before_torch_loads(tmp_path, env, expected):
    """A command module imported by ``agentrl`` sees the policy in its environment, and torch not loaded."""
    (tmp_path / "probe_command.py").write_text(textwrap.dedent("""
        import json, os, sys
        SEEN = {"policy": os.environ.get("OMP_WAIT_POLICY"), "spin": os.environ.get("GOMP_SPINCOUNT"),
                "torch_loaded": "torch" in sys.modules}
        def main(argv):
            print(json.dumps(SEEN))
            return 0
    """))
    code = """
        from agentrl import cli
        cli.COMMANDS["probe"] = ("probe_command:main", "test probe")
        raise SystemExit(cli.main(["probe"]))
    """
    assert _python(code, env, tmp_path) == {**expected, "torch_loaded": False}


def test_nothing_is_set_once_torch_is_loaded(tmp_path):
    code = """
        import json, torch
        from agentrl import cpu_threads
        env = {}
        print(json.dumps({"set": cpu_threads.configure(env), "env": env}))
    """
    assert _python(code, {}, tmp_path) == {"set": {}, "env": {}}


def test_the_user_s_thread_count_is_kept(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as before torch loads (configure only reads this)
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 1)
    env = {"OMP_NUM_THREADS": "3"}
    assert cpu_threads.configure(env) == {"GOMP_SPINCOUNT": "30000"} and env["OMP_NUM_THREADS"] == "3"
    env = {}
    assert cpu_threads.configure(env) == {"GOMP_SPINCOUNT": "30000", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_cgroup_quota(tmp_path, files, cpus):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert cpu_threads._quota(tmp_path) == cpus


def test_the_thread_count_follows_the_tightest_quota_of_the_process_s_cgroups(tmp_path, monkeypatch):
    """cgroup v2 ``0::/a/b``: quotas of ``/a/b`` and its parents; the tightest one, rounded up, caps the
    affinity mask; cgroup v1 ``cpu,cpuacct`` likewise."""
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", tmp_path)
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    dirs = cpu_threads._cgroup_dirs("0::/a/b\n")
    assert dirs == [tmp_path / "a" / "b", tmp_path / "a", tmp_path]
    assert min(q for q in map(cpu_threads._quota, dirs) if q is not None) == 2.5
    v1 = tmp_path / "cpu,cpuacct" / "docker"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads._cgroup_dirs("4:memory:/x\n3:cpu,cpuacct:/docker\n") == [v1, tmp_path / "cpu,cpuacct"]
    monkeypatch.setattr(cpu_threads.Path, "read_text",
                        lambda self, *a, **k: "3:cpu,cpuacct:/docker\n" if str(self) == "/proc/self/cgroup"
                        else open(self).read())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads.available_cpus() == 1  # ceil(0.5)
