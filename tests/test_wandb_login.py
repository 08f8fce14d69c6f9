"""``trainer.wandb=true`` without a W&B login is one line and exit 2 before any model loads.
W&B itself is never contacted: the check reads the environment and ~/.netrc only."""

from __future__ import annotations

import pytest

pytest.importorskip("wandb")


@pytest.fixture
def no_login(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no such file: no credentials
    return tmp_path


def test_wandb_without_login_is_refused_at_once(no_login, capsys):
    from agentrl.cli import main

    run = no_login / "run"
    assert main(["train", "env=gsm8k", "trainer.wandb=true", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentrl train: trainer.wandb=true but W&B has no login for api.wandb.ai") and "\n" not in err
    assert not run.exists()


@pytest.mark.parametrize("setting", ["WANDB_API_KEY=x", "WANDB_MODE=offline", "netrc"])
def test_wandb_with_a_login_or_offline_passes(no_login, monkeypatch, setting):
    from agentrl.train.config import build_config

    if setting == "netrc":
        (no_login / "netrc").write_text("machine api.wandb.ai login user password k\n")
    else:
        monkeypatch.setenv(*setting.split("=", 1))
    assert build_config(["env=gsm8k", "trainer.wandb=true"]).trainer.wandb
