"""The core SDK must import without torch (and without transformers): product agents don't train."""

import subprocess
import sys

from _no_torch import check_imports_without_torch


def test_core_modules_import_without_torch():
    check_imports_without_torch(["agentrl", "agentrl.harmony", "agentrl.envs", "agentrl.episodes", "agentrl.engines",
                                 "agentrl.cli"])


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
