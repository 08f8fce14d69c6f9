"""SFT data: trajectories written by ``agentrl eval`` / ``agentrl train`` (read through :mod:`agentrl.rundir`),
filtered for supervised fine-tuning (torch-free; :mod:`agentrl.train.sft` trains on them)."""

from __future__ import annotations

from collections.abc import Sequence

from agentrl import rundir
from agentrl.harmony.trajectory import Trajectory


def data_paths(paths: str | Sequence[str]) -> list[str]:
    """The comma-separated data paths of ``sft.data`` (or a list of them)."""
    return [p for p in paths.split(",") if p] if isinstance(paths, str) else list(paths)


def check_data(paths: str | Sequence[str], *, min_reward: float | None = None, correct_only: bool = False) -> None:
    """Raise :class:`~agentrl.rundir.RunDirError` (one line) unless the paths hold trajectories SFT can read (a
    JSONL file, an ``agentrl eval`` directory or an ``agentrl train`` run: its training episodes) and the
    filters keep at least one; the message names what each filter dropped. Reads the files (no model)."""
    files = [str(f) for path in data_paths(paths) for f in rundir.trajectory_files(path, "train")]
    kept, counts = load_sft_data(paths, min_reward=min_reward, correct_only=correct_only)
    if kept:
        return
    dropped = [f"{counts[k]} {what}" for k, what in (
        ("unreadable", "unreadable lines (not trajectories)"), ("failed", "failed (rollout or reward error, or no model token)"),
        ("below_min_reward", f"below sft.min_reward={min_reward}"), ("not_correct", "not correct (sft.correct_only=true)"),
    ) if counts.get(k)]
    raise rundir.RunDirError(
        f"sft.data={paths}: no trajectory left for SFT in {', '.join(files)} ({counts['read']} read; {', '.join(dropped) or 'no complete record in the files'}); "
        "give other data, or loosen sft.min_reward / sft.correct_only=false"
    )


def rejection(traj: Trajectory, *, min_reward: float | None = None, correct_only: bool = False) -> str | None:
    """Why the SFT data filter drops ``traj`` (``failed``, ``below_min_reward``, ``not_correct``), or None
    when it keeps it (see :func:`keep_trajectory`)."""
    if traj.error or traj.reward_error or not any(traj.response_mask):
        return "failed"
    if min_reward is not None and traj.reward < min_reward:
        return "below_min_reward"
    return "not_correct" if correct_only and not traj.correct else None


def keep_trajectory(traj: Trajectory, *, min_reward: float | None = None, correct_only: bool = False) -> bool:
    """The SFT data filter: usable (no rollout or reward error, at least one model token), reward >= ``min_reward``
    when given, and correct (:attr:`~agentrl.harmony.trajectory.Trajectory.correct`) when ``correct_only``
    (rejection sampling)."""
    return rejection(traj, min_reward=min_reward, correct_only=correct_only) is None


def load_sft_data(
    paths: str | Sequence[str], *, min_reward: float | None = None, correct_only: bool = False,
    vocab_size: int | None = None,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Trajectories from JSONL files / run directories (comma-separated string or list; a training run gives
    its training episodes, not its evaluations), filtered by :func:`keep_trajectory`. Returns ``(kept,
    counts)`` with counts ``read``, ``kept``, ``unreadable`` (lines that are not trajectories). ``vocab_size``:
    refuse token ids outside the student's vocabulary (trajectories of another tokenizer) with a ValueError
    naming the file and line. Raises RunDirError for a path without trajectories."""
    kept: list[Trajectory] = []
    counts = {"read": 0, "kept": 0, "unreadable": 0}
    for path in data_paths(paths):
        loaded = rundir.load_trajectories(path, "train")
        counts["unreadable"] += len(loaded.problems)
        for source, traj in loaded.items:
            counts["read"] += 1
            top = max([*traj.prompt_ids, *traj.response_ids], default=0)
            if vocab_size is not None and top >= vocab_size:
                raise ValueError(
                    f"{path}/{source}: token id {top} is outside the model's vocabulary ({vocab_size}); these "
                    "trajectories were written with another tokenizer/format (SFT needs the student's own tokens: "
                    "run `agentrl eval` with the student's format)"
                )
            reason = rejection(traj, min_reward=min_reward, correct_only=correct_only)
            if reason is None:
                kept.append(traj)
            else:
                counts[reason] = counts.get(reason, 0) + 1
    counts["kept"] = len(kept)
    return kept, counts


def infer_env(paths: str | Sequence[str]) -> str | None:
    """The registered env name recorded by the first trajectory of ``paths`` (schema-1 files of the trainer
    recorded the env class; it is mapped to its registered name), or None."""
    import agentrl.envs.registry as registry

    for path in data_paths(paths):
        loaded = rundir.load_trajectories(path, "train")
        if loaded.items:
            env = loaded.items[0][1].env
            names = registry.registered()
            if env in names:
                return env
            for name in names:
                if env and registry.env_class(name).__name__ == env:
                    return name
            return None
    return None


def describe(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Summary numbers of an SFT data set: size, model/env tokens per trajectory, tool calls, correctness."""
    n = max(len(trajectories), 1)
    return {
        "sft_data/trajectories": float(len(trajectories)),
        "sft_data/model_tokens_mean": sum(sum(t.response_mask) for t in trajectories) / n,
        "sft_data/env_tokens_mean": sum(len(t.response_mask) - sum(t.response_mask) for t in trajectories) / n,
        "sft_data/tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "sft_data/correct_frac": sum(t.correct for t in trajectories) / n,
    }
