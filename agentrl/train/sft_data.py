"""SFT data files: trajectories JSONL written by ``agentrl eval`` / ``agentrl train``, read with filters, and
written back (torch-free; :mod:`agentrl.train.sft` trains on them)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Sequence

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.teachers import is_correct, keep_trajectory


def trajectory_files(path: str) -> list[str]:
    """The JSONL files a data path names: a file, or a directory holding ``trajectories.jsonl`` (an eval run)
    or ``trajectories/*.jsonl`` (a training run; training-rollout files ``step_*.jsonl`` only, not the
    evaluation episodes). Raises FileNotFoundError saying what was looked for."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "trajectories.jsonl")):
            return [os.path.join(path, "trajectories.jsonl")]
        files = sorted(glob.glob(os.path.join(path, "trajectories", "step_*.jsonl")))
        if files:
            return files
        raise FileNotFoundError(
            f"{path!r} holds neither trajectories.jsonl (an `agentrl eval` run) nor trajectories/step_*.jsonl "
            "(an `agentrl train` run)"
        )
    raise FileNotFoundError(f"sft.data={path!r} does not exist; give a trajectories JSONL file or a run directory")


def load_trajectories(
    paths: str | Sequence[str], *, min_reward: float | None = None, correct_only: bool = False,
    vocab_size: int | None = None,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Trajectories from JSONL files/run dirs (comma-separated string or list), filtered by
    :func:`~agentrl.train.teachers.keep_trajectory`. Returns ``(kept, counts)`` with counts ``read``,
    ``kept``, ``unreadable`` (lines that are not trajectories). ``vocab_size``: refuse token ids outside
    the student's vocabulary (trajectories of another tokenizer) with a ValueError naming the file."""
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    kept: list[Trajectory] = []
    counts = {"read": 0, "kept": 0, "unreadable": 0}
    for path in paths:
        for file in trajectory_files(path):
            with open(file, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        traj = Trajectory.from_json(line)
                        traj.validate()
                    except (ValueError, KeyError, TypeError):
                        counts["unreadable"] += 1
                        continue
                    counts["read"] += 1
                    if vocab_size is not None:
                        top = max([*traj.prompt_ids, *traj.response_ids], default=0)
                        if top >= vocab_size:
                            raise ValueError(
                                f"{file}:{lineno}: token id {top} is outside the model's vocabulary ({vocab_size}); "
                                "these trajectories were written with another tokenizer/format (SFT needs the "
                                "student's own tokens: run `agentrl eval` with the student's format)"
                            )
                    if keep_trajectory(traj, min_reward=min_reward, correct_only=correct_only):
                        kept.append(traj)
    counts["kept"] = len(kept)
    return kept, counts


def save_trajectories(path: str, trajectories: Iterable[Trajectory]) -> None:
    """Write ``trajectories`` as JSONL atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(t.to_json() + "\n")
    os.replace(path + ".tmp", path)


def describe(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Summary numbers of an SFT data set: size, model/env tokens per trajectory, tool calls, correctness."""
    n = max(len(trajectories), 1)
    return {
        "sft_data/trajectories": float(len(trajectories)),
        "sft_data/model_tokens_mean": sum(sum(t.response_mask) for t in trajectories) / n,
        "sft_data/env_tokens_mean": sum(len(t.response_mask) - sum(t.response_mask) for t in trajectories) / n,
        "sft_data/tool_calls_mean": sum(len(turn.tools) for t in trajectories for turn in t.turns) / n,
        "sft_data/correct_frac": sum(is_correct(t) for t in trajectories) / n,
    }
