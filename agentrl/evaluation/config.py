"""What ``agentrl eval`` evaluates: :class:`EvalConfig` (its keys) and the tasks it selects.

Models (``model=``):

- an OpenAI-compatible endpoint (``model="http://host:port/v1"``):
  - ``api="completions"``: token-in-token-out through :class:`~agentrl.engines.client.OpenAIEngine`
    (vLLM, SGLang, ``agentrl serve model``). With ``format="auto"`` the format is the one the server
    describes (``agentrl serve model`` publishes it at ``/v1/agentrl/format``), else Harmony.
    Trajectories hold the sampled token ids and their log-probs.
  - ``api="chat"``: chat completions with tools (any server or hosted API) through
    :class:`~agentrl.runtime.ChatPolicy` (what the product ``Agent`` runs); trajectories hold the replies
    rendered in the env's format.
- a local model (a built-in name, a directory, a training run directory, a hub id): the transformers
  engine (imports torch).

Samples: sample ``j`` of every task is drawn with ``seed + j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.cli_args import check_declared, key

SANDBOXES = ("local", "unsafe_local", "sandboxfusion", "e2b")

#: Config fields that must match when resuming into an existing run directory.
RESUME_KEYS = (
    "env",
    "model",
    "api",
    "format",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "seed",
    "split",
    "tasks",
    "task_seed",
    "level",
    "format_reward",
    "env_kwargs",
)


def _env_names() -> list[str]:
    from agentrl.envs.registry import registered

    return list(registered())


def _is_env_reference(name: str) -> bool:
    from agentrl.envs.registry import is_reference

    return is_reference(name)


@dataclass
class EvalConfig:
    """What to evaluate and how: the keys of ``agentrl eval`` (see the module docstring for ``model``/``api``),
    each declared once with its default, valid values and description (:func:`agentrl.cli_args.key`)."""

    env: str = key(doc="the env to evaluate on (a registered name, module:Class or file.py:Class)", choices=_env_names,
                   accept=_is_env_reference)
    model: str = key(doc="an OpenAI-compatible base URL, or a local model (a built-in, a directory, a run, a hub id)")
    n: int = key(1, "samples per task", min=1)
    ks: list[int] | None = key(None, "the k of pass@k / maj@k (default: powers of two up to n)")
    limit: int = key(100, "tasks evaluated (the first ones of the source)", min=1)
    tasks: str | None = key(None, "a task file, a shipped dataset's name, env (the generator) or arithmetic")
    split: str = key("test", "the generator's split (test: the held-out stream)", choices=("train", "test"))
    task_seed: int | None = key(None, "seed of generated tasks (default: seed)")
    level: int = key(1, "difficulty of tasks=arithmetic", choices=(1, 2, 3))
    format_reward: float = key(0.0, "weight of a bonus for a \\boxed{} final answer added to the env's reward")
    max_batch_size: int = key(64, "most sequences a local model samples in one batch", min=1)
    api: str = key("completions", "completions (token ids, exact log-probs) or chat (chat completions with tools)",
                   choices=("completions", "chat"))
    format: str = key("auto", "chat format of token APIs (auto: the endpoint's own, else what fits the model)")
    concurrency: int = key(32, "episodes in flight (also the HTTP request bound)", min=1)
    processes: int = key(1, "client processes (endpoints only)", min=1)
    temperature: float = key(1.0, "sampling temperature (0: greedy)", min=0)
    top_p: float = key(1.0, "nucleus sampling mass", gt=0, max=1)
    top_k: int = key(0, "sample among the k most likely tokens (0: all)", min=0)
    max_new_tokens: int = key(1024, "most tokens of one model action", min=1)
    seed: int = key(0, "sample j of every task is drawn with seed + j (env and request seed; a local decode engine "
                               "samples it through a client seeded by seed, item and j)")
    out: str | None = key(None, "the run directory (default: runs/eval/<env>-<model>)")
    api_key: str | None = key(None, "API key (default: $OPENAI_API_KEY)")
    served_model: str | None = key(None, "model name sent to the endpoint (default: $OPENAI_MODEL or the server's)")
    retries: int = key(4, "retries per request", min=0)
    timeout_s: float = key(300.0, "timeout per request", gt=0)
    sandbox: str = key("local", "the code-sandbox backend shared by envs that take one", choices=SANDBOXES)
    env_kwargs: dict[str, Any] = key({}, "env constructor arguments (env.KEY=VALUE)")
    overwrite: bool = key(False, "replace the results already in out instead of resuming them")
    progress: bool = key(True, "show a progress bar")
    progress_interval_s: float = key(30.0, "stdout not a terminal: seconds between plain progress lines (0: none)",
                                     min=0)

    def __post_init__(self) -> None:
        check_declared(self)
        if self.processes > 1 and not self.is_endpoint:
            raise ValueError("processes > 1 needs an endpoint (each process is a client)")
        if self.api == "chat" and not self.is_endpoint:
            raise ValueError("api=chat needs an endpoint URL as model (http://...)")
        if self.ks and max(self.ks) > self.n:
            raise ValueError(f"every k must be <= n={self.n}, got ks={self.ks}")

    def check_sources(self) -> None:
        """Before anything loads: the env and its ``env_kwargs`` (by name and type), and a local ``model`` that
        the disk rules out (a path that does not exist: no trip to the hub). Raises ``ValueError`` saying what
        is wrong."""
        from agentrl.envs.env_kwargs import check_env_kwargs
        from agentrl.envs.registry import env_class
        from agentrl.models.names import check_model_name

        try:
            check_env_kwargs(env_class(self.env), self.env_kwargs, prefix="env.")
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        if not self.is_endpoint:
            check_model_name(self.model)

    @property
    def is_endpoint(self) -> bool:
        return self.model.startswith(("http://", "https://"))

    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        if self.is_endpoint:
            name = self.served_model or self.model.split("://", 1)[1].split("/", 1)[0]
        else:
            name = self.model.rstrip("/").rsplit("/", 1)[-1]
        env = self.env.rstrip("/").rsplit("/", 1)[-1]  # file.py:Class -> its file's name, not its folders
        return Path("runs") / "eval" / f"{_path_safe(env)}-{_path_safe(name) or 'model'}"


def _path_safe(name: str) -> str:
    """``name`` as one portable path component: ``:`` (``module:Class``), slashes and backslashes become ``_``."""
    return name.replace(":", "_").replace("/", "_").replace("\\", "_")


def load_tasks(config: EvalConfig) -> list[tuple[str, dict[str, Any]]]:
    """``(item_id, task)`` for the first ``limit`` tasks of the configured source (:class:`~agentrl.envs.task_source.
    TaskSource`): ``tasks`` (a file, a shipped dataset's name, ``env`` for the env's offline generator, or
    ``arithmetic`` at ``level``), by default the env's shipped evaluation dataset for ``split=test`` (gsm8k: GSM8K
    test; verifyif: IFEval), else its offline generator (with the generator arguments among ``env_kwargs``, e.g.
    retool's ``tier``). The ``test`` split is the trainer's held-out stream drawn with ``task_seed`` (default
    ``seed``): distinct problems, the same list as a training run's held-out evaluation with that seed."""
    from agentrl.envs.registry import env_class
    from agentrl.envs.task_source import TASK_SOURCES, TaskSource

    cls = env_class(config.env)
    source = config.tasks or ((cls.eval_dataset if config.split == "test" else None) or "env")
    extra = cls.generator_kwargs(config.env_kwargs) if source == "env" else {}
    task_seed = config.seed if config.task_seed is None else config.task_seed
    if config.split == "test":
        src = TaskSource(cls, source, seed=task_seed, level=config.level, eval_seed=task_seed, generator_kwargs=extra)
        tasks = src.held_out(config.limit)
    elif source in TASK_SOURCES and source != "env":
        src = TaskSource(cls, source, seed=task_seed, level=config.level, generator_kwargs=extra)
        tasks = [src.train(i) for i in range(config.limit)]
    else:
        path = None if source == "env" else source
        tasks = cls.tasks(split=config.split, n=config.limit, seed=task_seed, path=path, **extra)
    ids = [str(t.get("id", i)) for i, t in enumerate(tasks)]
    if len(set(ids)) != len(ids):
        ids = [str(i) for i in range(len(tasks))]
    return list(zip(ids, tasks, strict=True))
