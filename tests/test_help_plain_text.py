"""``--help`` shows plain text, not the docstrings' reST/Sphinx markup."""

from __future__ import annotations

import re

from agentrl.cli_args import plain_text


def test_plain_text_drops_the_markup():
    doc = "see :class:`~agentrl.train.config.SFTConfig`, :func:`the runner <agentrl.x.run>`, :mod:`agentrl.rundir` and ``steps=12``"
    assert plain_text(doc) == "see SFTConfig, the runner, agentrl.rundir and steps=12"


def test_sft_help_has_no_markup(capsys):
    from agentrl.cli import main

    assert main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    assert "supervised fine-tuning" in out and "sft.steps=12" in out
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out
