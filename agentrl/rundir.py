"""Run directories: which files make up a run, and the one way every command reads and writes them.

Two kinds of run directory exist (:func:`run_kind` tells them apart)::

    agentrl train / agentrl sft (and backend=verl)    agentrl eval
    RUN_DIR/config.yaml         resolved config       OUT/config.json        what was evaluated
    RUN_DIR/metrics.jsonl       one record per step   OUT/trajectories.jsonl one finished episode per line
    RUN_DIR/summary.json        headline figures      OUT/errors.jsonl       episodes that failed
    RUN_DIR/errors.log          tracebacks            OUT/errors.log         tracebacks (:mod:`agentrl.errorlog`)
    RUN_DIR/trajectories/       step_000001.jsonl ... OUT/metrics.json       the evaluation's metrics
                                (verl: step_000001-<pid>.jsonl, eval_step_...-<pid>.jsonl)
    RUN_DIR/eval/config.json    the held-out evaluation (``agentrl eval model=RUN_DIR`` starts from it)
    RUN_DIR/eval/<label>/       one ``agentrl eval`` directory per held-out evaluation
                                (``before``, ``after_sft``, ``step_000010``)
    RUN_DIR/sft/                data.jsonl, metrics.jsonl, tensorboard/, reference.pt (the SFT stage)
    RUN_DIR/checkpoints/        step_000007/{model.pt, optimizer.pt, rng.pt, state.json}, sft_000004/, latest
    RUN_DIR/tensorboard/

Runs written before the held-out evaluation moved to ``eval/<label>/`` keep theirs in
``trajectories/eval_*.jsonl``; every reader here takes both.

Writing: whole files are replaced atomically (:func:`write_atomic`: a temporary file, fsync, rename), records
are appended with one ``write`` per call on an ``O_APPEND`` descriptor (:class:`AppendFile`), so concurrent
writers (eval worker processes, verl agent-loop workers) never interleave and a crash tears at most the last
line, which the next writer closes with a newline first.

Reading: a torn last line (no newline, not JSON: a writer was killed mid-line) is skipped silently; any other
line that is not a record is a :class:`Problem`, kept with its file and line number and reported in one line
(:meth:`Loaded.report`). What makes a file unusable (missing, empty, not JSON/YAML, a trajectory schema newer
than this agentrl, another command's run directory) raises :class:`RunDirError`: one line naming the file and
what to do, which every command prints as ``agentrl <command>: ...`` with exit status 2.

Checkpoints: a checkpoint directory is complete once its ``state.json`` exists (directories are renamed into
place atomically; temporary ones start with ``.tmp-``); SFT-stage ones (``sft_<k>``) order before RL ones
(``step_<n>``). ``model.pt`` is a full state dict under the HF parameter names, whatever the number of GPUs
that wrote it. A LoRA run's checkpoint has ``adapter/`` (PEFT's ``adapter_config.json`` +
``adapter_model.safetensors``) instead of ``model.pt``: the adapter only, the base model being the run's
``model``. Nothing here needs torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.cli_args import UsageError
from agentrl.errorlog import ERRORS_LOG
from agentrl.harmony.trajectory import Trajectory

TRAIN = "train"
EVAL = "eval"

# train run files
CONFIG_YAML = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TRAJECTORIES_DIR = "trajectories"
HELD_OUT_DIR = "eval"
SFT_DIR = "sft"
CHECKPOINTS_DIR = "checkpoints"
# eval run files
EVAL_TRAJECTORIES = "trajectories.jsonl"
EVAL_ERRORS = "errors.jsonl"
EVAL_CONFIG = "config.json"
EVAL_METRICS = "metrics.json"
EVAL_TORN = "trajectories.torn"  # last lines of trajectories.jsonl torn by a crash, set aside when a run resumes
EVAL_FILES = (EVAL_TRAJECTORIES, EVAL_ERRORS, EVAL_CONFIG, EVAL_METRICS, EVAL_TORN, "trajectories.html", ERRORS_LOG)

ADAPTER_DIR = "adapter"
"""The folder of a checkpoint that holds a LoRA adapter (instead of ``model.pt``)."""

_CHECKPOINT = re.compile(r"^(sft|step)_(\d+)$")


class RunDirError(UsageError):
    """A run directory or one of its files cannot be used; the message is one line naming the file and
    what to do (exit status 2)."""


# ---------------------------------------------------------------------------------------------- writing
def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file in the same directory, fsync, rename): a
    reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON, atomically (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2, default=repr) + "\n")


def write_trajectories(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> None:
    """A whole trajectories JSONL file, atomically."""
    write_atomic(path, "".join(t.to_json() + "\n" for t in trajectories))


class AppendFile:
    """Appends lines to one file: each :meth:`write` is a single ``write`` on an ``O_APPEND`` descriptor, so
    writers in several processes never interleave. The file is opened at the first write; a last line torn by
    a crash is then closed with a newline (the torn line is kept; readers report it). Use as a context manager
    or :meth:`close`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd = -1

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self._fd).st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")
        return self._fd

    def write(self, *lines: str) -> None:
        """Append ``lines`` (without their newlines) in one write."""
        fd = self._fd if self._fd >= 0 else self._open()
        os.write(fd, "".join(line + "\n" for line in lines).encode("utf-8"))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def append_lines(path: str | os.PathLike, lines: Sequence[str]) -> None:
    """Append ``lines`` to ``path`` in one write (see :class:`AppendFile`)."""
    with AppendFile(path) as f:
        f.write(*lines)


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Problem:
    """A line that is not a record: ``source`` is ``file:line``, ``error`` what is wrong, ``line`` its start."""

    source: str
    error: str
    line: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"source": self.source, "error": self.error, "line": self.line}


@dataclass
class Loaded:
    """Records read from one or more JSONL files: ``items`` as ``(source "file:line", record)``, the
    ``problems`` (lines that are not records), and how many ``torn`` last lines were skipped."""

    items: list[tuple[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    torn: int = 0

    @property
    def records(self) -> list[Any]:
        return [record for _, record in self.items]

    def report(self) -> str | None:
        """One line about the problems (``None`` when there are none)."""
        if not self.problems:
            return None
        first = self.problems[0]
        more = f" ({len(self.problems)} lines in all)" if len(self.problems) > 1 else ""
        return f"skipped unreadable lines: {first.source}: {first.error}{more}"

    def extend(self, other: Loaded) -> None:
        self.items += other.items
        self.problems += other.problems
        self.torn += other.torn


def read_jsonl(path: str | os.PathLike, parse: Any = None, *, label: str | None = None) -> Loaded:
    """The records of a JSONL file: each line's JSON, turned into a record by ``parse`` (e.g.
    ``Trajectory.from_dict``) when given. Blank lines are ignored, a torn last line is skipped, other bad lines
    are :class:`Problem` s. ``label`` names the file in sources (default: its path). Raises RunDirError when
    ``parse`` raises RunDirError (a whole-file problem, e.g. a schema from a newer agentrl)."""
    path = Path(path)
    name = label or str(path)
    out = Loaded()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise RunDirError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    lines = text.split("\n")
    ends_with_newline = text.endswith("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        is_last = lineno == len(lines) and not ends_with_newline
        try:
            data = json.loads(line)
        except ValueError as exc:
            if is_last:
                out.torn += 1
            else:
                out.problems.append(Problem(f"{name}:{lineno}", f"not JSON ({exc})", line[:2000]))
            continue
        try:
            record = parse(data) if parse is not None else data
        except RunDirError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            out.problems.append(Problem(f"{name}:{lineno}", _describe(exc), line[:2000]))
            continue
        out.items.append((f"{name}:{lineno}", record))
    return out


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"not a record of this file (no {exc.args[0]!r} field)"
    return f"{type(exc).__name__}: {exc}"


def read_json(path: str | os.PathLike, *, what: str, fix: str) -> Any:
    """The JSON document at ``path`` (``what`` it is, e.g. "the eval config"); a missing, empty or broken file
    raises RunDirError saying ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise RunDirError(f"{path} is missing ({what}); {fix}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise RunDirError(f"{path} is empty ({what}: a write was interrupted?); {fix}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RunDirError(f"{path} is not valid JSON ({what}; {exc}); {fix}") from None


CONFIG_HEAD = "# agentrl run config (written by agentrl; its last line marks the end of the file)"
CONFIG_END = "# end of the agentrl run config"
"""The first and last lines of every ``config.yaml`` agentrl writes: a file that starts with :data:`CONFIG_HEAD`
but does not end with :data:`CONFIG_END` was cut short. A file without the head (written by hand, or by an agentrl
before these lines existed) is read as it is."""


def config_yaml_text(cfg: Any) -> str:
    """The text of ``config.yaml`` for an OmegaConf config: :data:`CONFIG_HEAD`, its YAML, :data:`CONFIG_END`."""
    from omegaconf import OmegaConf

    return f"{CONFIG_HEAD}\n{OmegaConf.to_yaml(cfg)}{CONFIG_END}\n"


def read_config_yaml(run_dir: str | os.PathLike, *, fix: str) -> Any:
    """``RUN_DIR/config.yaml`` as an OmegaConf ``DictConfig``; a missing, empty or broken file raises
    RunDirError saying ``fix``."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        kind = run_kind(run_dir)
        if kind == EVAL:
            raise RunDirError(f"{run_dir} is an `agentrl eval` directory, not a training run; {fix}")
        raise RunDirError(f"{path} is missing: {run_dir} is not a training run directory; {fix}")
    try:
        text = path.read_text()
        cfg = OmegaConf.create(text)
    except Exception as exc:  # noqa: BLE001 - yaml and OmegaConf raise many types for a damaged file
        raise RunDirError(f"{path} is not a readable config ({type(exc).__name__}); {fix}") from None
    lines = text.rstrip().splitlines()
    if lines and lines[0] == CONFIG_HEAD and lines[-1] != CONFIG_END:
        raise RunDirError(f"{path} is not a readable config (cut short: it does not end with {CONFIG_END!r}); {fix}")
    if not OmegaConf.is_dict(cfg) or not cfg:
        raise RunDirError(f"{path} is empty or not a mapping (a write was interrupted?); {fix}")
    return cfg


def _trajectory(data: Any) -> Trajectory:
    try:
        traj = Trajectory.from_dict(data)
    except ValueError as exc:
        if "newer than this agentrl" in str(exc):
            raise RunDirError(str(exc)) from None
        raise
    traj.validate()
    return traj


def load_trajectories(path: str | os.PathLike, which: str = "all") -> Loaded:
    """The trajectories of a JSONL file or a run directory (:func:`trajectory_files` with ``which``), every
    schema version; sources are ``file:line`` with the file relative to a directory. Raises RunDirError when
    the path holds no trajectory file or a file was written by a newer agentrl."""
    root = Path(path)
    out = Loaded()
    for file in trajectory_files(root, which):
        label = file.name if file == root else str(file.relative_to(root))
        try:
            out.extend(read_jsonl(file, _trajectory, label=label))
        except RunDirError as exc:
            raise RunDirError(f"{file}: {exc}") from None
    return out


# ---------------------------------------------------------------------------------------------- layout
def run_kind(path: str | os.PathLike) -> str | None:
    """``"train"`` for a directory written by ``agentrl train``/``sft`` (its ``config.yaml``), ``"eval"`` for
    one written by ``agentrl eval`` (``config.json`` or ``trajectories.jsonl``), else None."""
    path = Path(path)
    if (path / CONFIG_YAML).is_file():
        return TRAIN
    if (path / EVAL_CONFIG).is_file() or (path / EVAL_TRAJECTORIES).is_file():
        return EVAL
    return None


def trajectory_files(path: str | os.PathLike, which: str = "all") -> list[Path]:
    """The trajectory files a path names, in a stable order: a file is itself; an eval directory has
    ``trajectories.jsonl``; a training run has the training episodes ``trajectories/step_*.jsonl`` and, for
    ``which="all"``, its held-out evaluations (``eval/*/trajectories.jsonl``, older runs'
    ``trajectories/eval_*.jsonl``) and SFT data (``sft/data.jsonl``). ``which="train"``: training episodes only
    (what SFT learns from). Raises RunDirError saying what was looked for."""
    if which not in ("all", "train"):
        raise ValueError(f"which must be 'all' or 'train', got {which!r}")
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RunDirError(f"{path} does not exist; give a trajectories JSONL file or a run directory")
    if (path / EVAL_TRAJECTORIES).is_file():
        return [path / EVAL_TRAJECTORIES]
    steps = sorted((path / TRAJECTORIES_DIR).glob("step_*.jsonl"))
    extra: list[Path] = []
    if which == "all":
        extra = sorted((path / TRAJECTORIES_DIR).glob("eval_*.jsonl"))
        extra += sorted(p for p in (path / HELD_OUT_DIR).glob(f"*/{EVAL_TRAJECTORIES}") if p.is_file())
        extra += [p for p in (path / SFT_DIR / "data.jsonl",) if p.is_file()]
    if steps or extra:
        return steps + extra
    raise RunDirError(
        f"{path} holds no trajectories: neither {EVAL_TRAJECTORIES} (an `agentrl eval` run) nor "
        f"{TRAJECTORIES_DIR}/step_*.jsonl (an `agentrl train` run)"
    )


class TrainRun:
    """The paths of a training run directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    config = property(lambda self: self.root / CONFIG_YAML)
    metrics = property(lambda self: self.root / METRICS)
    summary = property(lambda self: self.root / SUMMARY)
    trajectories = property(lambda self: self.root / TRAJECTORIES_DIR)
    sft = property(lambda self: self.root / SFT_DIR)
    held_out = property(lambda self: self.root / HELD_OUT_DIR)
    checkpoints = property(lambda self: self.root / CHECKPOINTS_DIR)

    def step_trajectories(self, step: int) -> Path:
        """The training episodes of RL step ``step``."""
        return self.trajectories / f"step_{step:06d}.jsonl"

    def evaluation(self, label: str) -> Path:
        """The ``agentrl eval`` directory of the held-out evaluation ``label`` (``before``, ``after_sft``,
        ``step_000010``)."""
        return self.held_out / label

    @property
    def held_out_config(self) -> Path:
        """The held-out evaluation's config (an ``agentrl eval`` config.json)."""
        return self.held_out / EVAL_CONFIG


# ---------------------------------------------------------------------------------------------- metrics
def read_metrics(run_dir: str | os.PathLike, *, name: str = METRICS) -> list[dict[str, Any]]:
    """Records of ``RUN_DIR/metrics.jsonl`` sorted by step, one per step (the last one wins); a torn last line
    is skipped. Raises RunDirError when the file is missing or a line is not a record."""
    path = Path(run_dir) / name
    if not path.is_file():
        raise RunDirError(f"{path} not found: is {str(run_dir)!r} a training run directory?")
    loaded = read_jsonl(path, _metrics_record)
    if loaded.problems:
        raise RunDirError(f"{loaded.problems[0].source}: {loaded.problems[0].error}; the metrics log is damaged")
    by_step = {int(r["step"]): r for r in loaded.records}
    return [by_step[s] for s in sorted(by_step)]


def _metrics_record(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        raise ValueError("not a metrics record (no integer 'step')")
    return data


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Drop the records of steps after ``step`` (and a torn last line) from a metrics log, atomically; used on
    resume, so a step logged but not checkpointed is not logged twice. Bad lines raise RunDirError (the file is
    left as it is)."""
    path = Path(path)
    if not path.is_file():
        return
    loaded = read_jsonl(path, _metrics_record)
    if loaded.problems:
        raise RunDirError(
            f"{loaded.problems[0].source}: {loaded.problems[0].error}; the metrics log is damaged: fix or remove "
            "that line, then resume again"
        )
    kept = [json.dumps(r) for r in loaded.records if r["step"] <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))


# ---------------------------------------------------------------------------------------------- checkpoints
def _order(name: str) -> tuple[int, int]:
    m = _CHECKPOINT.match(name)
    assert m is not None
    return (0 if m.group(1) == "sft" else 1, int(m.group(2)))


def checkpoint_root(run_dir: str | os.PathLike) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR)


def checkpoint_name(step: int, sft_step: int | None = None) -> str:
    """``step_000007``, or ``sft_000004`` for a checkpoint written at SFT step 4 (before RL step 1)."""
    return f"step_{step:06d}" if sft_step is None else f"sft_{sft_step:06d}"


def is_run_dir(path: str | os.PathLike) -> bool:
    """True for a training run directory with checkpoints (``config.yaml`` and a ``checkpoints/`` folder)."""
    return os.path.isfile(os.path.join(path, CONFIG_YAML)) and os.path.isdir(checkpoint_root(path))


def list_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Complete checkpoint directory names, oldest first (temporary ones excluded)."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if _CHECKPOINT.match(n) and os.path.exists(os.path.join(root, n, "state.json"))]
    return sorted(names, key=_order)


def check_weights_file(path: str | os.PathLike, *, fix: str) -> None:
    """Raise RunDirError (one line naming ``path`` and ``fix``) for a ``torch.save`` file that is missing, empty
    or cut short (without the zip directory ``torch.save`` writes at its end), read without loading it."""
    import zipfile

    if not os.path.isfile(path):
        raise RunDirError(f"{path} is missing (an incomplete checkpoint); {fix}")
    if os.path.getsize(path) == 0:
        raise RunDirError(f"{path} is empty (a write was interrupted?); {fix}")
    if not zipfile.is_zipfile(path):
        raise RunDirError(f"{path} is not a readable checkpoint file (cut short or damaged: it does not end with "
                          f"torch.save's zip directory); {fix}")


def exception_line(exc: BaseException, limit: int = 160) -> str:
    """``Type: message`` of ``exc`` in one line: its message's first sentence, cut at a word when longer than
    ``limit`` (torch's messages run to several sentences)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.split(r"(?<=[a-z0-9)])\. ", text, maxsplit=1)[0].rstrip(".")
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def latest_checkpoint(run_dir: str | os.PathLike) -> str | None:
    """Directory of the newest complete checkpoint (the one ``checkpoints/latest`` names, else the newest
    complete one), or None."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        if name and _CHECKPOINT.match(name) and os.path.exists(os.path.join(root, name, "state.json")):
            return os.path.join(root, name)
    names = list_checkpoints(run_dir)
    return os.path.join(root, names[-1]) if names else None


def read_checkpoint_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (RunDirError when it is damaged)."""
    state = read_json(
        Path(checkpoint) / "state.json", what="the checkpoint's state",
        fix="remove that checkpoint directory to resume from the one before it",
    )
    wrong = [k for k in ("step", "data_position") if not isinstance(state, dict) or type(state.get(k)) is not int]
    if wrong:
        raise RunDirError(
            f"{Path(checkpoint) / 'state.json'} is not a checkpoint state (no integer {wrong[0]!r}); remove that "
            "checkpoint directory to resume from the one before it"
        )
    return state
