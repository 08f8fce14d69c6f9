"""Run an env's evaluation tasks against a model and write every trajectory as it finishes.

Models:

- an OpenAI-compatible endpoint (``model="http://host:port/v1"``):
  - ``api="completions"``: token-in-token-out through :class:`~agentrl.engines.openai_engine.OpenAIEngine`
    (vLLM, SGLang, ``agentrl serve model``). With ``format="auto"`` the format is the one the server
    describes (``agentrl serve model`` publishes it at ``/v1/agentrl/format``), else Harmony.
    Trajectories hold the sampled token ids and their log-probs.
  - ``api="chat"``: chat completions with tools (any server or hosted API) through
    :class:`~agentrl.runtime.ChatPolicy` (what the product ``Agent`` runs); trajectories hold the replies
    rendered in the env's format.
- a local model (a built-in name, a directory, a hub id): the transformers engine (imports torch).

Every path runs the shared episode loop (:func:`agentrl.episodes.run_episode`) that training, the verl
agent loop and the product ``Agent`` run, so an evaluation episode is exactly a training rollout.

Samples: sample ``j`` of every task is drawn with ``seed + j``.

Output directory (``out``): ``trajectories.jsonl`` (one finished episode per line, appended and flushed
as it finishes; ``metadata`` carries ``item_id``, ``sample``, ``correct``, ``answer``, ``latency_s``),
``errors.jsonl`` (episodes that failed, e.g. an endpoint down after retries; they are retried on the
next run), ``config.json`` and ``metrics.json``. Rerunning with the same ``out`` skips finished
``(item, sample)`` pairs; a config that changes what is measured (env, model, api, format, sampling)
is refused unless ``overwrite=True``, which starts the directory afresh. Nothing is written before the
run starts (its tasks loaded): a run that fails to start leaves no directory behind.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import json
import math
import multiprocessing
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.episodes import TokenPolicy, run_episode
from agentrl.evaluation.metrics import summarize
from agentrl.harmony.trajectory import Trajectory

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


def answers_comparable(env: Any) -> bool:
    """Whether ``env``'s answers can be compared for a majority vote: it is graded on an answer (a rubric
    verifier of type NumericAnswer, MathAnswer or ExactMatch), not on free text."""
    from agentrl.envs.rewards.common import ExactMatch
    from agentrl.envs.rewards.math import MathAnswer, NumericAnswer

    verifiers = [fn for _, fn, _ in getattr(getattr(env, "rubric", None), "items", [])]
    return any(isinstance(v, (MathAnswer, NumericAnswer, ExactMatch)) for v in verifiers)


def comparable_answer(env: Any, final: str | None) -> str | None:
    """A normalised answer for majority voting (see :func:`answers_comparable`); ``None`` without a final
    answer or when answers are not comparable. Math/number answers are normalised exactly (``"1,000"``,
    ``"1000.0"`` -> ``"1000"``); ExactMatch answers by the verifier's own normalisation; others by whitespace."""
    from agentrl.envs.rewards.common import ExactMatch
    from agentrl.envs.rewards.math import MathAnswer, NumericAnswer, final_answer_text, last_number, to_number

    verifiers = [fn for _, fn, _ in getattr(getattr(env, "rubric", None), "items", [])]
    if final is None or not answers_comparable(env):
        return None
    if not any(isinstance(v, (MathAnswer, NumericAnswer)) for v in verifiers):
        exact = next(v for v in verifiers if isinstance(v, ExactMatch))
        return exact.normalize(final)
    text = final_answer_text(final).strip()
    number = to_number(text)
    if number is None and any(isinstance(v, NumericAnswer) for v in verifiers):
        number = last_number(text)
    return str(number) if number is not None else " ".join(text.split())


class ResultStore:
    """The run directory: finished episodes (``trajectories.jsonl``), failures (``errors.jsonl``), config."""

    #: what a run writes into its directory (``overwrite`` removes exactly these)
    FILES = ("trajectories.jsonl", "errors.jsonl", "config.json", "metrics.json", "trajectories.html")

    def __init__(self, out: Path, config: EvalConfig, *, write_config: bool = True):
        self.out = out
        if write_config and config.overwrite:
            for name in self.FILES:
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.traj_path = out / "trajectories.jsonl"
        self.error_path = out / "errors.jsonl"
        cfg_path = out / "config.json"
        self.unreadable = 0
        self._fd = self._err = -1
        if not write_config:  # a child process of a multi-process run: the parent checked the config
            self._open()
            return
        current = {
            f.name: getattr(config, f.name) for f in fields(config)
        }  # shallow: env_kwargs may hold live objects
        if cfg_path.exists():
            previous = json.loads(cfg_path.read_text())
            now = json.loads(json.dumps({k: current[k] for k in RESUME_KEYS}, default=repr))
            diff = {k: (previous.get(k), now[k]) for k in RESUME_KEYS if previous.get(k) != now[k]}
            if diff:
                raise ValueError(
                    f"{out} holds a run with a different config ({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                    "use another out=..., or overwrite=true to start it afresh"
                )
        saved = {k: v for k, v in current.items() if k != "api_key"}
        cfg_path.write_text(json.dumps(saved, indent=1, default=repr))
        self._ensure_newline(self.traj_path)
        self._ensure_newline(self.error_path)
        self._open()

    def _open(self) -> None:
        """Append-only descriptors: each record is one ``write`` of a whole line, so records from several
        processes never interleave."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._fd = os.open(self.traj_path, flags, 0o644)
        self._err = os.open(self.error_path, flags, 0o644)

    @staticmethod
    def _ensure_newline(path: Path) -> None:
        """A line torn by a crash is kept; new lines start after it."""
        if path.exists() and path.stat().st_size:
            with path.open("rb+") as fh:
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def load(self) -> list[Trajectory]:
        """Every readable finished trajectory (torn or foreign lines are counted in ``unreadable``)."""
        out, self.unreadable = [], 0
        if self.traj_path.exists():
            for line in self.traj_path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    out.append(Trajectory.from_json(line))
                except (ValueError, KeyError, TypeError):
                    self.unreadable += 1
        return out

    def write(self, traj: Trajectory) -> None:
        os.write(self._fd, (traj.to_json() + "\n").encode("utf-8"))

    def write_error(self, item_id: str, sample: int, exc: BaseException) -> None:
        record = {
            "item_id": item_id,
            "sample": sample,
            "error": f"{type(exc).__name__}: {exc}",
            "time": time.time(),
        }
        os.write(self._err, (json.dumps(record) + "\n").encode("utf-8"))

    def close(self) -> None:
        for fd in (self._fd, self._err):
            if fd >= 0:
                os.close(fd)
        self._fd = self._err = -1


def items_digest(items: list[tuple[str, dict[str, Any]]]) -> str:
    """A fingerprint of the evaluated items (ids and task contents), so runs over different items can be
    told apart (``agentrl eval --compare`` warns)."""
    import hashlib

    blob = json.dumps([[i, t] for i, t in items], sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def load_tasks(config: EvalConfig) -> list[tuple[str, dict[str, Any]]]:
    """``(item_id, task)`` for the first ``limit`` tasks of ``tasks`` (a file or a shipped dataset's name), else of
    the env's shipped evaluation dataset for ``split=test`` (gsm8k: GSM8K test; verifyif: IFEval), else of its
    offline generator's ``split`` (with the generator arguments among ``env_kwargs``, e.g. retool's ``tier``)."""
    from agentrl.envs.registry import env_class

    cls = env_class(config.env)
    path = config.tasks or (cls.eval_dataset if config.split == "test" else None)
    extra = cls.generator_kwargs(config.env_kwargs) if path is None and hasattr(cls, "generator_kwargs") else {}
    tasks = cls.tasks(split=config.split, n=config.limit, seed=config.seed, path=path, **extra)
    ids = [str(t.get("id", i)) for i, t in enumerate(tasks)]
    if len(set(ids)) != len(ids):
        ids = [str(i) for i in range(len(tasks))]
    return list(zip(ids, tasks, strict=True))


class Evaluation:
    """One ``agentrl eval`` invocation. ``await run()`` returns the metrics dict (also in ``metrics.json``).

    ``on_progress(done, total, failed)`` is called after each episode.
    """

    def __init__(
        self,
        config: EvalConfig,
        *,
        on_progress: Callable[[int, int, int], Any] | None = None,
        _child: bool = False,
    ):
        self.config = config
        self.on_progress = on_progress
        self.window = (0.0, 0.0)  # monotonic start/end of the episodes this process ran
        # the parent opens the directory in run(), once the tasks loaded: a failed start writes nothing
        self.store: ResultStore = ResultStore(config.out_dir(), config, write_config=False) if _child else None  # type: ignore[assignment]

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        items = load_tasks(cfg)
        self.store = ResultStore(cfg.out_dir(), cfg)
        done = {(t.metadata.get("item_id"), t.metadata.get("sample")) for t in self.store.load()}
        todo = [
            (item_id, task, j) for item_id, task in items for j in range(cfg.n) if (item_id, j) not in done
        ]
        t0 = time.perf_counter()
        if cfg.processes > 1 and len(todo) > 1:
            finished, failed, episodes_wall = await self._run_processes(todo)
        else:
            finished, failed, episodes_wall = await self._run_all(todo)
        wall = time.perf_counter() - t0
        self.store.close()
        metrics = self.summary(items)
        metrics["run"] = {
            "episodes_run": finished,
            "episodes_failed": failed,
            "episodes_skipped": len(items) * cfg.n - len(todo),
            "wall_s": wall,
            "episodes_wall_s": episodes_wall,
            "episodes_per_s": finished / episodes_wall if episodes_wall > 0 and finished else 0.0,
            "unreadable_lines": self.store.unreadable,
        }
        (self.store.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    def summary(self, items: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """Metrics over the finished samples ``0..n-1`` of the configured items."""
        wanted = {item_id for item_id, _ in items}
        grouped: dict[str, dict[int, Trajectory]] = defaultdict(dict)
        for t in self.store.load():
            item, sample = t.metadata.get("item_id"), t.metadata.get("sample")
            if item in wanted and isinstance(sample, int) and sample < self.config.n:
                grouped[item][sample] = t
        metrics = summarize({k: list(v.values()) for k, v in grouped.items()}, self.config.ks)
        metrics["env"], metrics["model"], metrics["api"] = self.config.env, self.config.model, self.config.api
        metrics["items_digest"] = items_digest(items)
        metrics["incomplete_items"] = len(wanted) - sum(
            1 for v in grouped.values() if len(v) == self.config.n
        )
        return metrics

    async def _run_all(self, todo: list[tuple[str, dict[str, Any], int]]) -> tuple[int, int, float]:
        """Run ``todo`` on ``concurrency`` workers; returns ``(finished, failed, seconds)`` where the
        seconds count from the first episode's start (after engine/sandbox setup) to the last one's end."""
        cfg = self.config
        if not todo:
            return 0, 0, 0.0
        queue: asyncio.Queue = asyncio.Queue()
        for entry in todo:
            queue.put_nowait(entry)
        counts = {"done": 0, "failed": 0, "streak": 0}
        # this many consecutive failures with no success means the model is unreachable: stop
        abort_after = 2 * cfg.concurrency + 2
        async with contextlib.AsyncExitStack() as stack:
            runner = await self._episode_runner(stack)

            async def worker() -> None:
                env = await runner.make_env()
                try:
                    while not queue.empty():
                        if counts["streak"] >= abort_after and counts["done"] == 0:
                            return
                        item_id, task, j = queue.get_nowait()
                        try:
                            traj = await runner.episode(env, task, j)
                        except Exception as exc:  # noqa: BLE001 - recorded, retried on the next run
                            self.store.write_error(item_id, j, exc)
                            counts["failed"] += 1
                            counts["streak"] += 1
                        else:
                            traj.metadata.update(
                                item_id=item_id,
                                sample=j,
                                env_name=cfg.env,
                                model=cfg.model,
                                correct=bool(traj.reward_components.get("correct", traj.reward >= 1.0)),
                            )
                            if answers_comparable(env):  # present (even None) = maj@k is reported
                                traj.metadata["answer"] = comparable_answer(env, _final(traj))
                            self.store.write(traj)
                            counts["done"] += 1
                            counts["streak"] = 0
                        if self.on_progress:
                            self.on_progress(counts["done"] + counts["failed"], len(todo), counts["failed"])
                finally:
                    await env.aclose()

            self.window = (time.monotonic(), 0.0)
            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(todo)))))
            self.window = (self.window[0], time.monotonic())
            seconds = self.window[1] - self.window[0]
        if counts["done"] == 0 and counts["failed"]:
            last = self.store.error_path.read_text().strip().splitlines()[-1]
            raise RuntimeError(
                f"every episode failed ({counts['failed']}); last error: {json.loads(last)['error']}"
            )
        return counts["done"], counts["failed"], seconds

    async def _run_processes(self, todo: list[tuple[str, dict[str, Any], int]]) -> tuple[int, int, float]:
        """Split ``todo`` over ``processes`` child processes (each a client with its share of the
        concurrency), so Python's per-request CPU is spread over cores. Children append to the same
        files; the parent aggregates progress. Returns like :meth:`_run_all`."""
        cfg = self.config
        procs_n = min(cfg.processes, len(todo))
        child_cfg = replace(cfg, concurrency=math.ceil(cfg.concurrency / procs_n), processes=1)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_child_main, args=(child_cfg, todo[k::procs_n], queue, k), daemon=True)
            for k in range(procs_n)
        ]
        for proc in procs:
            proc.start()
        progress = {k: (0, 0) for k in range(procs_n)}
        results: dict[int, tuple] = {}
        loop = asyncio.get_running_loop()
        try:
            while len(results) < procs_n:
                msg = await loop.run_in_executor(None, _get, queue, procs)
                if msg is None:
                    dead = [k for k, p in enumerate(procs) if not p.is_alive() and k not in results]
                    raise RuntimeError(f"eval worker process(es) {dead} died without reporting")
                kind, k, *rest = msg
                if kind == "progress":
                    progress[k] = tuple(rest)
                    if self.on_progress:
                        done = sum(d for d, _ in progress.values())
                        self.on_progress(done, len(todo), sum(f for _, f in progress.values()))
                elif kind == "error":
                    raise RuntimeError(f"eval worker process {k} failed: {rest[0]}")
                else:
                    results[k] = tuple(rest)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        finished = sum(r[0] for r in results.values())
        failed = sum(r[1] for r in results.values())
        start = min(r[2] for r in results.values())
        end = max(r[3] for r in results.values())
        return finished, failed, end - start

    async def _episode_runner(self, stack: contextlib.AsyncExitStack) -> _EpisodeRunner:
        cfg = self.config
        from agentrl.envs.registry import env_class

        cls = env_class(cfg.env)
        env_kwargs = dict(cfg.env_kwargs)
        if "sandbox" in inspect.signature(cls.__init__).parameters and "sandbox" not in env_kwargs:
            from agentrl.envs.sandbox import make_backend

            backend = await stack.enter_async_context(make_backend(cfg.sandbox))  # shared by all envs
            await backend.run("pass")  # start the pool before the first episode
            env_kwargs["sandbox"] = backend
        if cfg.api == "chat":
            from agentrl.engines.openai_engine import ChatClient, Endpoint

            client = await stack.enter_async_context(ChatClient(self._endpoint(Endpoint)))
            return _ChatRunner(cls, env_kwargs, cfg, client)
        if cfg.is_endpoint:
            from agentrl.engines.openai_engine import Endpoint, OpenAIEngine

            engine = await stack.enter_async_context(OpenAIEngine(self._endpoint(Endpoint)))
            served = await _served_format(engine.endpoint) if cfg.format == "auto" else None
            if served is not None:  # auto: the server's own format (agentrl serve model describes it)
                fmt = served
            else:
                from agentrl.harmony import make_format

                fmt = make_format(cfg.format)
        else:
            from agentrl.engines.server import load_local_engine

            engine, fmt, _ = load_local_engine(cfg.model, format=cfg.format, seed=cfg.seed)
        return _TokenRunner(cls, {**env_kwargs, "format": fmt}, cfg, engine)

    def _endpoint(self, endpoint_cls: Any) -> Any:
        cfg = self.config
        return endpoint_cls(
            cfg.model,
            api_key=cfg.api_key,
            model=cfg.served_model,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.retries,
            max_concurrency=cfg.concurrency,
        )


async def _served_format(endpoint: Any) -> Any:
    """The endpoint's own ChatFormat, or ``None`` if it describes none or cannot be reached now (the
    episodes then fail, are recorded in ``errors.jsonl`` and retried by the next run)."""
    from agentrl.engines.openai_engine import EndpointError

    try:
        return await endpoint.served_format()
    except EndpointError:
        return None


def _get(queue: Any, procs: list[Any]) -> Any:
    """Next message from the children, or ``None`` once a child died silently."""
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                return None


def _child_main(cfg: EvalConfig, shard: list[tuple[str, dict[str, Any], int]], queue: Any, k: int) -> None:
    """Entry point of one eval worker process: run ``shard`` and report counts and its time window."""
    from agentrl.evaluation.cli import run_async

    def progress(done: int, total: int, failed: int) -> None:
        queue.put(("progress", k, done, failed))

    async def go() -> None:
        ev = Evaluation(cfg, on_progress=progress, _child=True)
        try:
            done, failed, _ = await ev._run_all(shard)
        finally:
            ev.store.close()
        queue.put(("done", k, done, failed, *ev.window))

    try:
        run_async(go())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", k, f"{type(exc).__name__}: {exc}"))


def _final(traj: Trajectory) -> str | None:
    return next((t.parsed.final for t in reversed(traj.turns) if t.parsed.final is not None), None)


class _EpisodeRunner(abc.ABC):
    def __init__(self, cls: type, env_kwargs: dict[str, Any], cfg: EvalConfig, backend: Any):
        self.cls, self.env_kwargs, self.cfg, self.backend = cls, env_kwargs, cfg, backend

    async def make_env(self) -> Any:
        return self.cls(**self.env_kwargs)

    @abc.abstractmethod
    async def episode(self, env: Any, task: dict[str, Any], sample: int) -> Trajectory:
        """Run one episode of ``task`` (sample index ``sample``) in ``env`` and return its trajectory."""


class _TokenRunner(_EpisodeRunner):
    """Token-in-token-out episodes: a :class:`~agentrl.episodes.TokenPolicy` on the engine."""

    _stop_ids: list[int] | None = None

    def stop_ids(self, env: Any) -> list[int]:
        """The format's stop ids, looked up once (openai-harmony computes them on each call)."""
        if self._stop_ids is None:
            self._stop_ids = list(env.format.stop_token_ids)
        return self._stop_ids

    async def episode(self, env: Any, task: dict[str, Any], sample: int) -> Trajectory:
        cfg = self.cfg
        sampling = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=self.stop_ids(env),
            seed=cfg.seed + sample,
        )
        result = await run_episode(env, TokenPolicy(self.backend, sampling), task=task, seed=cfg.seed + sample)
        result.trajectory.metadata.update(
            api="completions", latency_s=result.wall_s, env_s=result.env_s, requests=len(result.steps)
        )
        return result.trajectory


class _ChatRunner(_EpisodeRunner):
    """Chat-completions episodes: a :class:`~agentrl.runtime.ChatPolicy` on the endpoint."""

    async def episode(self, env: Any, task: dict[str, Any], sample: int) -> Trajectory:
        from agentrl.runtime import ChatPolicy

        cfg = self.cfg
        sampling = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_completion_tokens": cfg.max_new_tokens,
            "seed": cfg.seed + sample,
        }
        policy = ChatPolicy(self.backend, sampling)
        result = await run_episode(env, policy, task=task, seed=cfg.seed + sample)
        policy.annotate(result)
        return result.trajectory
