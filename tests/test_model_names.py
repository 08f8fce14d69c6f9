"""A model name that is a local path which does not exist fails at once with one line: no trip to
the hub, no traceback, exit 2 from ``agentrl eval``, nothing written."""

from __future__ import annotations

import os

import pytest

from agentrl.models.names import check_model_name, looks_like_path


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A working directory with a ``runs/`` folder, a saved model, a run-less folder and a file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.gguf").write_text("x")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("./nope", r"model='./nope': no such directory \(.*/nope\); give a built-in"),
        ("../nope", r"no such directory"),
        ("/definitely/not/here", r"no such directory \(/definitely/not/here\)"),
        ("runs/retool-typo", r"no such directory"),  # runs/ exists here: a path, not the hub id 'runs/...'
        ("a/b/c", r"no such directory"),
        ("~/no-such-model-xyz", r"no such directory"),
        ("weights.gguf", r"model='weights.gguf' is a file"),
        ("empty", r"model directory 'empty' has no config.json"),
        ("smollm2-13m", r"unknown model 'smollm2-13m'. Did you mean: smollm2-135m"),
    ],
)
def test_names_that_cannot_load_are_refused_with_one_line(cwd, name, message):
    with pytest.raises(ValueError, match=message) as info:
        check_model_name(name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-gpt-oss", "saved", "./saved", "HuggingFaceTB/SmolLM2-135M"])
def test_names_that_may_load_pass(cwd, name):
    check_model_name(name)


def test_hub_ids_are_not_paths(cwd):
    assert not looks_like_path("org/name") and not looks_like_path("name")
    assert looks_like_path("runs/x") and looks_like_path("./x") and looks_like_path("x/")


def test_load_model_never_asks_the_hub_for_a_missing_local_path(cwd, monkeypatch):
    pytest.importorskip("torch")
    import transformers

    from agentrl.models.loading import load_model

    def hub(*args, **kwargs):
        raise AssertionError("went to the hub")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", hub)
    with pytest.raises(ValueError, match="no such directory"):
        load_model("./nope")


def test_eval_refuses_a_missing_local_model_with_exit_2_and_writes_nothing(cwd, capsys):
    from agentrl.evaluation.cli import main

    assert main(["env=gsm8k", "model=./nope", "limit=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentrl eval: ") and "model='./nope': no such directory" in err and "\n" not in err
    assert sorted(os.listdir(cwd)) == ["empty", "runs", "saved", "weights.gguf"]
