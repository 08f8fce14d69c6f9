"""Envs named by reference (``env=module:Class``, ``env=path/file.py:Class``) without packaging, and env
constructor arguments checked by name and type before anything is loaded."""

from __future__ import annotations

import os
import sys

import pytest

from agentrl.envs import AgentEnv, EnvKwargsError, check_env_kwargs, env_class
from agentrl.envs.builtin.retool import ReToolEnv

MODULE = '''
from agentrl.envs import AgentEnv


class {name}(AgentEnv):
    """An env of the user's own, next to where the command runs."""

    single_turn = True

    def __init__(self, *, level: int = 1, words: list[str] | None = None, **kwargs):
        self.level = level
        super().__init__(**kwargs)


class NotAnEnv:
    pass
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory holding ``userenv_<n>.py``, as the current directory, which ``sys.path`` does not list
    (like the ``agentrl`` console script's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    return tmp_path


def _write(directory, module: str, name: str = "MyEnv") -> None:
    (directory / f"{module}.py").write_text(MODULE.format(name=name))


def test_module_colon_class_from_the_current_directory(user_dir):
    _write(user_dir, "userenv_a")
    cls = env_class("userenv_a:MyEnv")
    assert issubclass(cls, AgentEnv) and cls.__name__ == "MyEnv"
    env = cls(level=2, max_turns=3)
    assert env.level == 2 and env.limits.max_turns == 3
    env.close()


def test_file_path_colon_class(user_dir):
    sub = user_dir / "envs"
    sub.mkdir()
    _write(sub, "userenv_b", "FileEnv")
    assert env_class("envs/userenv_b.py:FileEnv").__name__ == "FileEnv"
    assert env_class(f"{sub / 'userenv_b.py'}:FileEnv").__name__ == "FileEnv"


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("userenv_c:Missing", r"userenv_c.Missing does not exist; AgentEnv subclasses there: MyEnv"),
        ("userenv_c:NotAnEnv", r"userenv_c.NotAnEnv is not an AgentEnv subclass"),
        ("no_such_module_xyz:Env", r"No module named 'no_such_module_xyz' \(searched the installed packages and "),
        ("nowhere/env.py:Env", r"no file 'nowhere/env.py'"),
        ("userenv_c:", r"a reference looks like 'package.module:ClassName'"),
    ],
)
def test_bad_references_say_what_is_wrong(user_dir, reference, message):
    _write(user_dir, "userenv_c")
    with pytest.raises(ValueError, match=message):
        env_class(reference)


def test_an_error_inside_the_users_module_is_reported_as_such(user_dir):
    (user_dir / "userenv_d.py").write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(ValueError, match=r"importing userenv_d failed: No module named 'not_installed_dependency_xyz'"):
        env_class("userenv_d:Env")
    (user_dir / "userenv_e.py").write_text("1/0\n")
    with pytest.raises(ValueError, match=r"importing userenv_e failed: ZeroDivisionError"):
        env_class("userenv_e:Env")


def test_unknown_plain_names_still_raise_key_error():
    with pytest.raises(KeyError, match="registered envs: gsm8k"):
        env_class("gsmk")


# ------------------------------------------------------------------------------------------- env kwargs
def test_env_kwargs_of_the_right_names_and_types_pass():
    check_env_kwargs(ReToolEnv, {"tier": "compute", "max_turns": 3, "exec_timeout_s": 5, "sandbox": "local",
                                 "sandbox_kwargs": {"workers": 2}, "tasks": "tasks.jsonl"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_turns": "abc"}, r"env_kwargs.max_turns='abc' is not valid for ReToolEnv: expected int"),
        ({"max_turns": 2.5}, r"env_kwargs.max_turns=2.5 is not valid for ReToolEnv: expected int"),
        ({"exec_timeout_s": "soon"}, r"expected float"),
        ({"foo": 1}, r"env_kwargs.foo: ReToolEnv takes no argument 'foo'. It takes: .*exec_timeout_s, format, "),
        ({"max_turn": 3}, r"Did you mean: env_kwargs.max_turns\?"),
        ({"sandbox": 5}, r"expected SandboxBackend \| str"),
    ],
)
def test_env_kwargs_are_checked_by_name_and_type(kwargs, message):
    with pytest.raises(EnvKwargsError, match=message):
        check_env_kwargs(ReToolEnv, kwargs)


def test_env_kwargs_of_a_users_env_and_the_eval_spelling(user_dir):
    _write(user_dir, "userenv_f")
    cls = env_class("userenv_f:MyEnv")
    check_env_kwargs(cls, {"level": 2, "words": ["a"], "max_tool_calls": 4})
    with pytest.raises(EnvKwargsError, match=r"^env.level='high' is not valid for MyEnv: expected int"):
        check_env_kwargs(cls, {"level": "high"}, prefix="env.")
    with pytest.raises(EnvKwargsError, match=r"expected list\[str\] \| None"):
        check_env_kwargs(cls, {"words": "a b"})


def test_train_refuses_bad_env_kwargs_before_loading_the_model(tmp_path, capsys):
    """The config's validation checks env kwargs (no model is loaded before: the command exits at once)."""
    from agentrl.cli import main
    from agentrl.train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="env_kwargs.max_turns='abc'"):
        build_config(["env=retool", "env_kwargs.max_turns=abc", f"run_dir={tmp_path / 'run'}"])
    assert main(["train", "env=retool", "env_kwargs.foo=1", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "env_kwargs.foo: ReToolEnv takes no argument 'foo'" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_eval_refuses_bad_env_kwargs_before_loading_the_model(tmp_path, capsys):
    from agentrl.evaluation.cli import main

    assert main(["env=retool", "model=smollm2-135m", "env.foo=1", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "env.foo: ReToolEnv takes no argument 'foo'" in err and "\n" not in err
    assert not (tmp_path / "out").exists()
