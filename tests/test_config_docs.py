"""``docs/config.md`` is generated from the key declarations (``scripts/config_docs.py``) and kept current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_what_the_declarations_give():
    """Fails when a key was added, removed or changed without rerunning ``python scripts/config_docs.py``."""
    script = _script()
    assert script.OUT.read_text() == script.render(), "docs/config.md is stale: run python scripts/config_docs.py"


def test_every_key_of_every_command_has_a_row():
    from agentrl.cli_args import schema_keys

    script = _script()
    text = script.OUT.read_text()
    for name, target in script.COMMANDS:
        assert f"## `{name}`" in text
        for key in schema_keys(script._spec(target).schema):
            assert f"| `{key}` |" in text, (name, key)


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    script = _script()
    stale = tmp_path / "config.md"
    stale.write_text(script.render().replace("| `actor.lr` |", "| `actor.learning_rate` |"))
    monkeypatch.setattr(script, "OUT", stale)
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 1
    assert "config.md is stale" in capsys.readouterr().err
    assert script.main([]) == 0 and script.main(["--check"]) == 0


def test_a_field_docstring_over_several_lines_is_described_whole():
    """An attribute docstring wrapped over two lines gives its whole first paragraph, never a cut sentence."""
    from dataclasses import dataclass

    from agentrl.cli_args import field_docs

    @dataclass
    class Wrapped:
        limit: int = 1
        """Connections from one client (an address; an IPv6
        client is its /64).

        Details nobody needs in --help."""

    assert field_docs(Wrapped) == {"limit": "Connections from one client (an address; an IPv6 client is its /64)."}
