"""The README is a front door that works as written: its python blocks run and print what they say, its shell
commands parse (every `agentrl` command line is read by its command's own parser; nothing long runs), and
every link and repository path in it and in ``docs/`` exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: top-level folders whose paths, written as `code` in the docs, must exist in the repository
REPO_DIRS = ("agentrl/", "tests/", "benchmarks/", "examples/", "scripts/", "docs/", ".ci/")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def _commands(text: str) -> list[str]:
    """Every command line of the ``bash`` blocks: continuation lines joined, trailing ``# comments`` dropped."""
    lines = []
    for block in _blocks(text, "bash"):
        lines += block.replace("\\\n", " ").splitlines()
    return [c for c in (re.split(r"\s+#\s", line)[0].strip() for line in lines) if c and not c.startswith("#")]


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_readme_python_blocks_run_and_print_what_their_comments_say(tmp_path):
    """The blocks run in order as one script in a fresh interpreter; each ``print(...)  # ...: X`` line's output
    is the comment's last part (``X``, after its last ``: ``)."""
    blocks = _blocks(README.read_text(), "python")
    assert blocks, "the README has no python block"
    script = "\n".join(blocks)
    expected = [re.split(r": ", comment)[-1].strip()
                for comment in re.findall(r"^print\(.*\)\s+#\s*(.*)$", script, flags=re.M)]
    (tmp_path / "readme_blocks.py").write_text(script)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == expected


def _parse_agentrl(words: list[str]) -> None:
    """Read an ``agentrl ...`` command line with its command's own parser; raises on a line it refuses."""
    from agentrl import cli_args
    from agentrl.cli import main as cli_main

    if words[-1] == "--help":
        assert cli_main(words) == 0, words
        return
    if words[0] in ("train", "sft"):
        from agentrl.train.config import SFT_SPEC, build_config

        args = [w for w in words[1:] if w != "--dry-run"]
        if words[0] == "sft":
            build_config(args, spec=SFT_SPEC, profile="sft")
        else:
            build_config(args)
        return
    specs = {"eval": "agentrl.evaluation.cli", "serve model": "agentrl.engines.server.serve_cli",
             "serve sandbox": "agentrl.envs.sandbox.server", "view": "agentrl.viewer.html", "plot": "agentrl.train.plots"}
    name = " ".join(words[:2]) if " ".join(words[:2]) in specs else words[0]
    assert name in specs, f"the README runs `agentrl {' '.join(words)}`, which this test cannot check yet"
    import importlib

    spec = importlib.import_module(specs[name]).SPEC
    cli_args.parse(spec, words[len(name.split()):])


def _install_profiles() -> set[str]:
    return set(re.findall(r"^\s+(\w+)\)", (ROOT / "scripts" / "install.sh").read_text(), flags=re.M))


def _check_command(command: str) -> None:
    """One README command line: each part joined by ``&&`` is checked for what it is."""
    for part in (p.strip() for p in command.split("&&")):
        words = shlex.split(part)
        if words[0] == "scripts/install.sh":
            assert (ROOT / words[0]).exists() and words[1] in _install_profiles(), part
        elif words[0] in ("agentrl", ".venv/bin/agentrl"):
            _parse_agentrl(words[1:])
        elif words[:3] in (["python", "-m", "pytest"], [".venv/bin/python", "-m", "pytest"]):
            # the same options, collecting one small file only: pytest refuses an unknown option or marker
            done = subprocess.run([sys.executable, "-m", "pytest", *words[3:], "--collect-only", "-p",
                                   "no:cacheprovider", "tests/test_config_docs.py"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, (part, done.stdout[-2000:], done.stderr[-2000:])
        elif words[0] == "bash" and words[1].startswith("examples/"):
            assert subprocess.run(["bash", "-n", str(ROOT / words[1])]).returncode == 0, part
        else:
            pytest.fail(f"the README runs {part!r}, which this test cannot check yet")


def test_readme_shell_commands_parse(monkeypatch):
    """Every command line of the README's bash blocks, as written (from the repository root): the install
    profile exists, pytest takes the options, each ``agentrl`` line is accepted by its command's parser (a
    ``--dry-run`` line is parsed, not planned; ``--help`` runs), each example script is valid bash."""
    pytest.importorskip("torch")
    monkeypatch.chdir(ROOT)
    commands = _commands(README.read_text())
    assert "scripts/install.sh train && .venv/bin/agentrl train env=retool" in commands
    assert any(c.startswith("scripts/install.sh test && .venv/bin/python -m pytest") for c in commands)
    for command in commands:
        _check_command(command)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_repository_paths_exist(page):
    """Every relative Markdown link resolves from the page's folder, and every `path` into the repository's
    folders written as code exists (a placeholder such as ``runs/<run>`` is not a repository path)."""
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+://|#|mailto:", target) and not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    for path in re.findall(r"`([\w./-]+)`", text):
        if path.startswith(REPO_DIRS) and "*" not in path and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{page.name}: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    assert [p for p in DOCS if f"](docs/{p.name})" not in text] == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_python_blocks_are_valid_python(page):
    """The docs' examples (which need a server, a GPU or tensors, so they are not run) at least compile."""
    for block in _blocks(page.read_text(), "python"):
        compile(block, str(page), "exec")


_TRANSCRIPT_RUNNER = """
import contextlib, io, json, shlex, sys
from agentrl.cli import main
results = []
for command in json.load(sys.stdin):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(shlex.split(command))
    results.append([rc, out.getvalue()])
print(json.dumps(results))
"""


def test_docs_transcripts_are_what_the_commands_print():
    """Each ``$ agentrl ...`` line of a docs transcript, run as written in a fresh interpreter (as a user's shell
    would: no env registered by another test), prints the lines under it and exits 2."""
    pytest.importorskip("torch")
    transcripts = [m for page in DOCS for m in re.findall(r"^\$ agentrl (.*)\n((?:[^$`].*\n)+)", page.read_text(), flags=re.M)]
    assert transcripts
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.run([sys.executable, "-c", _TRANSCRIPT_RUNNER], input=json.dumps([c for c, _ in transcripts]),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    for (command, printed), (rc, out) in zip(transcripts, json.loads(child.stdout.splitlines()[-1]), strict=True):
        assert rc == 2, command
        assert out.strip() == printed.strip(), command


#: verl's own keys, which docs/scale-out.md names as verl's (they are no agentrl train key)
VERL_KEYS = {"data.train_files", "data.train_batch_size", "trainer.logger", "trainer.resume_mode",
             "verl.plugins", "verl.trainer.main_ppo"}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_trainer_key_the_docs_name_exists(page):
    """A dotted ``agentrl train`` key in the README or a docs page (``actor.lora.rank``, ``trainer.n_gpus``) is
    declared, or a section of declared keys (``algorithm.rollout_correction``), or under an open mapping
    (``env_kwargs.tier``, ``verl.overrides``)."""
    from agentrl.train.config import all_keys

    keys = set(all_keys())
    sections = {k.rsplit(".", 1)[0] for k in keys} | {k.rsplit(".", 2)[0] for k in keys}
    pattern = r"(?<![\w./])((?:actor|rollout|trainer|algorithm|sft|eval|data|verl|env_kwargs|model_kwargs)\.[a-z_][\w.]*\w)"
    unknown = {name for name in re.findall(pattern, page.read_text())
               if name not in keys | sections | VERL_KEYS and not name.startswith(("env_kwargs.", "model_kwargs."))}
    assert not unknown, f"{page.name} names keys that agentrl train does not declare: {sorted(unknown)}"


def _needs_more_than_a_parse(command: str) -> bool:
    """Docs command lines this parse cannot stand for: placeholders (``<run>``, ``...``), lines that read what an
    earlier run wrote (``resume=``, ``data=runs/``, ``--compare``), other programs (pip, ray, a shell ``export``,
    ``VAR=value`` prefixes) and printed output lines (``ready: ...``)."""
    first = command.split()[0]
    return (any(mark in command for mark in ("<", "...", "resume=", "data=runs/", "--compare"))
            or "=" in first or first not in ("agentrl", ".venv/bin/agentrl", "scripts/install.sh", "bash"))


def test_docs_shell_commands_parse(monkeypatch, capsys):
    """The docs' command lines, as far as a parse can check them (:func:`_needs_more_than_a_parse` says which
    are left out): each is accepted by its command's parser, as the README's are."""
    pytest.importorskip("torch")
    monkeypatch.chdir(ROOT)
    checked = 0
    for page in DOCS:
        for command in _commands(page.read_text()):
            if not _needs_more_than_a_parse(command):
                _check_command(command)
                checked += 1
    capsys.readouterr()  # --help output
    assert checked >= 20, checked


@pytest.mark.slow
def test_readme_verl_dry_run_plans_as_written(tmp_path):
    """The README's ``backend=verl ... --dry-run`` lines run as written (``agentrl`` of this interpreter's venv on
    PATH, in an empty folder): verl's own config validation passes and nothing launches."""
    import os

    pytest.importorskip("verl")
    dry_runs = [c for c in _commands(README.read_text()) if "backend=verl" in c and c.endswith("--dry-run")]
    assert dry_runs
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    for command in dry_runs:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and "--dry-run: nothing launched." in done.stdout, (command, done.stderr[-2000:])


def test_ci_runs_the_readme_test_command():
    """The README says `.ci/run` runs exactly the two steps of its test command: each is a line of `.ci/run`."""
    command = next(c for c in _commands(README.read_text()) if c.startswith("scripts/install.sh test"))
    ci = [line.split(" || ")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [part.strip() for part in command.split("&&") if part.strip() not in ci] == []
