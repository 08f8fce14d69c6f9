"""The new-user trial's defects (issue 36, part 2), each pinned as a one-line error or the expected behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.cli import main as cli_main
from agentrl.evaluation.config import EvalConfig


def test_default_eval_dir_is_one_path_component_without_colons():
    cfg = EvalConfig(env="examples/custom_env.py:WordCountEnv", model="org/some:model")
    out = cfg.out_dir()
    assert out.parent == Path("runs") / "eval" and ":" not in out.name, out
    assert out.name == "custom_env.py_WordCountEnv-some_model"
    assert EvalConfig(env="mypkg.envs:MyEnv", model="http://127.0.0.1:9/v1").out_dir().name == "mypkg.envs_MyEnv-127.0.0.1_9"


def test_eval_points_to_errors_only_when_episodes_failed(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "eval"
    assert cli_main(["eval", "env=gsm8k", "model=tiny-gpt-oss", "limit=1", "max_new_tokens=2", "progress=false",
                     f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert "0 failed)" in text and "errors" not in text.split("0 failed")[-1], text
    assert not (out / "errors.jsonl").exists()


def test_env_file_imports_a_module_next_to_it(tmp_path, monkeypatch):
    import sys

    from agentrl.envs.registry import env_class

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "newcomer_helpers.py").write_text("PROMPT = 'count the words'\n")
    (tmp_path / "newcomer_env.py").write_text(
        "from newcomer_helpers import PROMPT\n"
        "from agentrl.envs import AgentEnv\n\n\n"
        "class HelperEnv(AgentEnv):\n"
        "    prompt = PROMPT\n"
    )
    monkeypatch.chdir(Path(__file__).parent)  # not the env's folder
    cls = env_class(f"{tmp_path / 'newcomer_env.py'}:HelperEnv")
    assert cls.prompt == "count the words"
