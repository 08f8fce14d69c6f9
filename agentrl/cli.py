"""``agentrl`` command line: dispatches each subcommand to the module that owns it.

Each target is ``"module:function"``; the function takes the remaining ``argv`` and returns an exit
code. Modules are imported only when their subcommand runs, so ``agentrl --help`` needs no torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agentrl.train.cli:main", "train a policy: agentrl train env=retool [key=value ...]"),
    "sft": ("agentrl.train.sft_cli:main", "supervised fine-tuning on token-exact trajectories: agentrl sft env=retool ..."),
    "plot": ("agentrl.train.plots:main", "plot run metrics: agentrl plot RUN_DIR [RUN_DIR ...]"),
    "eval": ("agentrl.evaluation.cli:main", "evaluate a model on an env: agentrl eval env=gsm8k model=..."),
    "view": ("agentrl.viewer.html:main", "write a static HTML trajectory viewer: agentrl view RUN_OR_JSONL"),
    "serve sandbox": ("agentrl.envs.sandbox.server:main", "SandboxFusion-compatible code sandbox server"),
    "serve model": ("agentrl.engines.server:main", "OpenAI-compatible token server on a local transformers model"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: agentrl <command> [args]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def _resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in COMMANDS:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv and argv[0] in COMMANDS:
        return argv[0], argv[1:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    resolved = _resolve(argv)
    if resolved is None:
        print(f"agentrl: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = resolved
    module_name, func_name = COMMANDS[name][0].split(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
