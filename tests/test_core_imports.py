"""The core SDK must import without torch (and without transformers): product agents don't train."""

import subprocess
import sys

import pytest

BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'triton', 'verl'}:
            raise ImportError(f'{name} is blocked in this test')
        return None
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize(
    "module", ["agentrl", "agentrl.harmony", "agentrl.envs", "agentrl.episodes", "agentrl.engines", "agentrl.cli"]
)
def test_core_module_imports_without_torch(module):
    code = BLOCK_HEAVY + f"import {module}\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_cli_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for command in ("train", "plot", "eval", "view", "serve sandbox", "serve model"):
        assert command in out.stdout


def test_cli_unknown_command_is_a_clear_error():
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "trian"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "unknown command" in out.stderr and "train" in out.stderr
