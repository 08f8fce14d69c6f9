"""The package structure stays true: import-linter (on grimp's import graph) checks the contracts in
pyproject.toml ``[tool.importlinter]``: packages import only the layers below them, independent siblings
never import each other, every top-level module has a layer, and there is no import cycle between
sibling modules or packages at any depth (lazy imports inside functions count too)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("contract", ["layers", "engines", "acyclic"])
def test_import_contract_is_kept(contract, capsys):
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), limit_to_contracts=(contract,),
                        no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out[out.find("Broken contracts"):] or out
