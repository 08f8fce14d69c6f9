"""What ``agentrl eval`` evaluates: :class:`EvalConfig` (its keys) and the tasks it selects.

Models (``model=``):

- an OpenAI-compatible endpoint (``model="http://host:port/v1"``):
  - ``api="completions"``: token-in-token-out through :class:`~agentrl.engines.openai_engine.OpenAIEngine`
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.models.names import check_model_name

#: Config fields that must match when resuming into an existing run directory.
RESUME_KEYS = (
    "env",
    "model",
    "api",
    "format",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "split",
    "tasks",
    "env_kwargs",
)


@dataclass
class EvalConfig:
    """What to evaluate and how (the keys of ``agentrl eval``; see the module docstring for ``model``/``api``).

    ``n`` samples per task, ``ks`` the k of pass@k/maj@k (default: powers of two up to ``n``), ``limit``
    tasks from ``tasks`` (a file in the env's format) or the env's offline ``split``; ``format`` the
    ChatFormat for token APIs (``auto``: the endpoint's own when it describes one, else Harmony;
    what fits a local model); ``concurrency``
    episodes in flight (also the HTTP request bound), ``processes`` client processes; sampling
    ``temperature``/``top_p``/``max_new_tokens`` per model action, ``seed`` (sample j uses ``seed + j``);
    ``out`` the run directory; ``api_key``/``served_model`` override ``OPENAI_API_KEY``/``OPENAI_MODEL``;
    ``retries``/``timeout_s`` per request; ``sandbox`` the code-sandbox backend shared by envs that take
    one; ``env_kwargs`` env constructor arguments (e.g. limits); ``overwrite`` replaces the results
    already in ``out`` instead of resuming them; ``progress`` shows a progress bar.
    """

    env: str
    model: str
    n: int = 1
    ks: list[int] | None = None
    limit: int = 100
    tasks: str | None = None
    split: str = "test"
    api: str = "completions"
    format: str = "auto"
    concurrency: int = 32
    processes: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0
    out: str | None = None
    api_key: str | None = None
    served_model: str | None = None
    retries: int = 4
    timeout_s: float = 300.0
    sandbox: str = "local"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.n < 1 or self.limit < 1 or self.concurrency < 1:
            raise ValueError(
                f"n, limit and concurrency must be >= 1 (got {self.n}, {self.limit}, {self.concurrency})"
            )
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if self.processes < 1 or (self.processes > 1 and not self.is_endpoint):
            raise ValueError(
                "processes must be >= 1, and > 1 only with an endpoint (each process is a client)"
            )
        if self.api == "chat" and not self.is_endpoint:
            raise ValueError("api=chat needs an endpoint URL as model (http://...)")
        if self.ks and max(self.ks) > self.n:
            raise ValueError(f"every k must be <= n={self.n}, got ks={self.ks}")
        if not self.is_endpoint:
            check_model_name(self.model)  # e.g. a local path that does not exist: refused now, no trip to the hub

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
        name = name.replace(":", "_").replace("/", "_") or "model"
        return Path("runs") / "eval" / f"{self.env}-{name}"


def load_tasks(config: EvalConfig) -> list[tuple[str, dict[str, Any]]]:
    """``(item_id, task)`` for the first ``limit`` tasks of ``tasks`` (a file or a shipped dataset's name), else of
    the env's shipped evaluation dataset for ``split=test`` (gsm8k: GSM8K test; verifyif: IFEval), else of its
    offline generator's ``split`` (with the generator arguments among ``env_kwargs``, e.g. retool's ``tier``)."""
    from agentrl.envs.env_kwargs import check_env_kwargs
    from agentrl.envs.registry import env_class

    cls = env_class(config.env)
    check_env_kwargs(cls, config.env_kwargs, prefix="env.")  # before any model loads
    path = config.tasks or (cls.eval_dataset if config.split == "test" else None)
    extra = cls.generator_kwargs(config.env_kwargs) if path is None and hasattr(cls, "generator_kwargs") else {}
    tasks = cls.tasks(split=config.split, n=config.limit, seed=config.seed, path=path, **extra)
    ids = [str(t.get("id", i)) for i, t in enumerate(tasks)]
    if len(set(ids)) != len(ids):
        ids = [str(i) for i in range(len(tasks))]
    return list(zip(ids, tasks, strict=True))

