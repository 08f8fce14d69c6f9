"""The parquet files verl's dataloader reads for an agentrl run: one row per task.

Columns (``RLHFDataset`` passes every column of a row to the agent loop as a keyword argument):

- ``agent_name``: ``"agentrl"``, so verl runs :class:`~agentrl.train.verl_backend.agent_loop.AgentrlAgentLoop`;
- ``agentrl``: the JSON episode spec ``{"env", "entry_point", "env_kwargs", "format", "task",
  "max_new_tokens", "format_reward", "trajectory_dir"}`` (JSON text, so tasks of any shape fit one parquet
  column). ``entry_point`` is the env's ``"module:Class"`` as registered in the process that wrote the
  dataset, so verl's workers build an env that a script registered with ``agentrl.envs.register`` (they
  import the module; it must be importable there). ``trajectory_dir`` (or null): where the agent loop
  appends each finished episode, as the embedded trainer's ``RUN_DIR/trajectories``;
- ``prompt``: the task's user message as ``[{"role": "user", "content": ...}]`` (verl requires the
  column; the agent loop renders the real prompt through the env's ChatFormat);
- ``data_source``: ``"agentrl/<env>"`` (verl groups validation metrics by it);
- ``reward_model``: ``{"style": "agentrl_env", "ground_truth": <task answer or "">}`` (verl's logging reads
  it; the reward itself is the env's, computed in the agent loop);
- ``extra_info``: ``{"index": i, "split": split}`` (verl reads ``index`` from it).

Tasks come from :class:`agentrl.envs.task_source.TaskSource` (``data.tasks``: the env's generator, arithmetic,
or a task file), exactly as for the embedded trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.seeds import HELD_OUT_OFFSET
from agentrl.train.verl_backend.config_map import AGENT_NAME


def episode_rows(
    env: str,
    tasks: list[dict[str, Any]],
    *,
    split: str,
    env_kwargs: dict[str, Any] | None = None,
    format: str = "auto",
    max_new_tokens: int | None = None,
    format_reward: float = 0.0,
    trajectory_dir: str | None = None,
) -> list[dict[str, Any]]:
    """One verl dataset row per task (see module docstring)."""
    rows = []
    entry_point = env_entry_point(env)
    for i, task in enumerate(tasks):
        spec = {
            "env": env,
            "entry_point": entry_point,
            "env_kwargs": dict(env_kwargs or {}),
            "format": format,
            "task": task,
            "max_new_tokens": max_new_tokens,
            "format_reward": format_reward,
            "trajectory_dir": trajectory_dir,
        }
        rows.append(
            {
                "data_source": f"agentrl/{env}",
                "reward_model": {"style": "agentrl_env", "ground_truth": str(task.get("answer", ""))},
                "agent_name": AGENT_NAME,
                "prompt": [{"role": "user", "content": str(task.get("prompt", ""))}],
                "agentrl": json.dumps(spec, ensure_ascii=False, default=str),
                "extra_info": {"index": i, "split": split},
            }
        )
    return rows


def env_entry_point(env: str) -> str:
    """The ``"module:Class"`` of the env registered as ``env`` in this process (KeyError if none)."""
    from agentrl.envs import env_class

    cls = env_class(env)
    return f"{cls.__module__}:{cls.__qualname__}"


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> str:
    """Write ``rows`` to ``path`` (parent folders created); returns the path as a string."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ValueError(f"no tasks to write to {path}; the env produced an empty task list")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_env_dataset(
    out_dir: str | Path,
    env: str,
    *,
    tasks: str,
    n_train: int,
    n_val: int,
    seed: int = 0,
    level: int = 1,
    eval_seed: int = HELD_OUT_OFFSET,
    env_kwargs: dict[str, Any] | None = None,
    format: str = "auto",
    max_new_tokens: int | None = None,
    format_reward: float = 0.0,
    trajectory_dir: str | None = None,
) -> tuple[str, str]:
    """Write ``train.parquet`` (training-stream tasks ``0..n_train-1``) and ``val.parquet`` (the ``n_val``
    held-out tasks) for ``env`` under ``out_dir``; returns their paths. ``tasks``, ``seed``, ``level`` and
    ``eval_seed`` mean what ``data.tasks``, ``seed``, ``data.level`` and the eval seed mean to the embedded
    trainer (:class:`agentrl.envs.task_source.TaskSource`), so both backends see the same task streams.
    ``trajectory_dir``: where the agent loop saves episodes (None: nowhere)."""
    from agentrl.envs import env_class
    from agentrl.envs.task_source import TaskSource

    source = TaskSource(env_class(env), tasks, seed=seed, level=level, eval_seed=eval_seed)
    common = dict(env_kwargs=env_kwargs, format=format, max_new_tokens=max_new_tokens, format_reward=format_reward,
                  trajectory_dir=trajectory_dir)
    train = [source.train(i, num_held_out=n_val) for i in range(n_train)]
    out = Path(out_dir)
    return (
        write_parquet(episode_rows(env, train, split="train", **common), out / "train.parquet"),
        write_parquet(episode_rows(env, source.held_out(n_val), split="test", **common), out / "val.parquet"),
    )
