"""``agentrl`` command line: dispatches each subcommand to the module that owns it.

Each target is ``"module:function"``; the function takes the remaining ``argv`` and returns an exit
code. Modules are imported only when their subcommand runs, so ``agentrl --help`` needs no torch. Every
command reads ``key=value`` arguments through :mod:`agentrl.cli_args` and has ``--help``; a user error
is one line on stderr and exit status 2, never a traceback. Before a command's module is imported (and
with it torch), :func:`agentrl.cpu_threads.configure` sets how torch's CPU threads wait and how many
there are, unless the user set them.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from typing import Any

from agentrl import cpu_threads
from agentrl.cli_args import HELP_FLAGS, fail, interrupted, raise_terminated, suggest

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agentrl.train.cli:main", "train a policy: agentrl train env=retool [key=value ...]"),
    "sft": ("agentrl.train.sft_cli:main", "supervised fine-tuning on token-exact trajectories: agentrl sft env=retool ..."),
    "eval": ("agentrl.evaluation.cli:main", "evaluate a model on an env: agentrl eval env=gsm8k model=..."),
    "view": ("agentrl.viewer.html:main", "write a static HTML trajectory viewer: agentrl view RUN_OR_JSONL"),
    "plot": ("agentrl.train.plots:main", "plot run metrics: agentrl plot RUN_DIR [RUN_DIR ...]"),
    "serve model": ("agentrl.engines.server.serve_cli:main", "OpenAI-compatible server on a local model: agentrl serve model model=..."),
    "serve sandbox": ("agentrl.envs.sandbox.server:main", "SandboxFusion-compatible code sandbox server"),
}


def _usage(commands: dict[str, tuple[str, str]], group: str | None = None) -> str:
    shown = {n: t for n, t in commands.items() if group is None or n.startswith(group + " ")}
    width = max(len(name) for name in shown)
    head = f"usage: agentrl {group} <what> [key=value ...]" if group else "usage: agentrl <command> [key=value ...]"
    lines = [head, "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in shown.items()]
    lines += ["", "Every command takes key=value arguments and --help."]
    return "\n".join(lines)


def _resolve(argv: list[str], commands: dict[str, tuple[str, str]]) -> tuple[str, list[str]] | None:
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in commands:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv and argv[0] in commands:
        return argv[0], argv[1:]
    return None


def _unknown(argv: list[str], commands: dict[str, tuple[str, str]]) -> int:
    groups = {n.split(" ")[0] for n in commands if " " in n}
    if argv[0] in groups:  # `agentrl serve`, `agentrl serve modle`
        subs = [n.split(" ", 1)[1] for n in commands if n.startswith(argv[0] + " ")]
        if len(argv) == 1 or argv[1].startswith("-"):
            return fail("agentrl", f"{argv[0]} what? Use one of: {', '.join(f'{argv[0]} {s}' for s in subs)}")
        hint = suggest(argv[1], subs, fallback=f" Use one of: {', '.join(subs)}.", cutoff=0.6)
        return fail("agentrl", f"unknown command '{argv[0]} {argv[1]}'.{hint.replace('Did you mean: ', f'Did you mean: {argv[0]} ')}")
    names = sorted({n.split(" ")[0] for n in commands})
    hint = suggest(argv[0], names, fallback=" Run `agentrl --help` for the commands.", cutoff=0.6)
    return fail("agentrl", f"unknown command {argv[0]!r}.{hint}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = COMMANDS
    if not argv or argv[0] in HELP_FLAGS:
        print(_usage(commands))
        return 0 if argv else 2
    groups = {n.split(" ")[0] for n in commands if " " in n}
    if argv[0] in groups and len(argv) >= 2 and argv[1] in HELP_FLAGS:
        print(_usage(commands, argv[0]))
        return 0
    resolved = _resolve(argv, commands)
    if resolved is None:
        return _unknown(argv, commands)
    name, rest = resolved
    module_name, func_name = commands[name][0].split(":")
    cpu_threads.configure()  # before torch loads: libgomp reads its environment then
    _quiet_progress_bars()
    module = importlib.import_module(module_name)
    previous = _on_sigterm()
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except KeyboardInterrupt as exc:
        what, code = interrupted(exc)
        print(f"agentrl {name}: {what}", file=sys.stderr)
        return code
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _quiet_progress_bars() -> None:
    """When stderr is not a terminal (``agentrl train ... > log 2>&1``), no tqdm bars from transformers and the
    hub ("Loading weights", "Writing model shards", downloads): a log gets agentrl's own progress lines only.
    Before those libraries load, through the hub's variable, unless the user set it; once loaded, directly."""
    if sys.stderr is None or sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _on_sigterm() -> Any:
    """In the main thread, with SIGTERM's default action in place: SIGTERM raises :class:`Terminated` (a command
    stops as on Ctrl-C and says so). Returns the previous handler (None when unchanged)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, raise_terminated)


if __name__ == "__main__":
    sys.exit(main())
