"""Gymnasium conventions after a plain ``import agentrl`` (fresh interpreters, as a user starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


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
