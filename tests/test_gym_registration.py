"""Gymnasium conventions after a plain ``import agentrl`` (fresh interpreters, as a user starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, extra_path: Path | None = None) -> str:
    env = dict(os.environ)
    if extra_path is not None:  # a directory of installed distributions (dist-info with entry points)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _third_party(site: Path, entry_points: str) -> None:
    """A package ``thirdpkg`` "installed" into ``site`` (its dist-info declares ``entry_points``)."""
    (site / "thirdpkg").mkdir(parents=True)
    (site / "thirdpkg" / "__init__.py").write_text(
        "from agentrl.envs import AgentEnv\n\n\nclass EchoEnv(AgentEnv):\n    single_turn = True\n"
    )
    info = site / "thirdpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_import_agentrl_registers_the_gymnasium_ids_and_stays_light():
    code = (
        "import sys, agentrl, gymnasium\n"
        "heavy = [m for m in ('torch', 'agentrl.envs.env', 'agentrl.envs.builtin.retool') if m in sys.modules]\n"
        "env = gymnasium.make('agentrl/ReTool-v0')\n"
        "print(heavy, type(env.unwrapped).__name__, sorted(agentrl.envs.registered()))\n"
        "env.close()\n"
    )
    assert _python(code) == "[] ReToolEnv ['gsm8k', 'jobs', 'retool', 'verifyif']"


def test_module_prefixed_id_needs_no_import():
    code = "import gymnasium\nenv = gymnasium.make('agentrl:agentrl/GSM8K-v0')\nprint(type(env.unwrapped).__name__)\nenv.close()"
    assert _python(code) == "GSM8KEnv"


def test_a_third_party_env_is_found_by_gymnasium_make_after_a_plain_import(tmp_path):
    _third_party(tmp_path, "[agentrl.envs]\necho = thirdpkg:EchoEnv\n")
    code = (
        "import sys, agentrl, gymnasium\n"
        "print('thirdpkg' in sys.modules)\n"  # found through the metadata, not imported
        "env = gymnasium.make('agentrl/echo-v0')\n"
        "print(type(env.unwrapped).__name__)\n"
        "env.close()\n"
    )
    assert _python(code, tmp_path).splitlines() == ["False", "EchoEnv"]


def test_a_broken_entry_point_is_skipped_with_a_warning(tmp_path):
    _third_party(tmp_path, "[agentrl.envs]\nbroken = thirdpkg.EchoEnv\necho = thirdpkg:EchoEnv\n")
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import agentrl\n"
        "print(sorted(agentrl.envs.registered()))\n"
        "print([str(w.message) for w in caught if 'broken' in str(w.message)][0])\n"
    )
    names, warning = _python(code, tmp_path).splitlines()
    assert "'echo'" in names and "'broken'" not in names
    assert "ignoring the agentrl.envs entry point 'broken'" in warning
